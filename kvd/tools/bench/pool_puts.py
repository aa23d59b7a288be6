"""``kvd bench pool``'s puts handed on (``kvd.tools.bench.pool``): an engine
on node A puts values that node B owns; A answers each put and hands the
value to B in the background (``kvd.cluster.forwards``: a PUT on B's bulk
port, or a gRPC BatchPut on the ``grpc`` transport). Timed from the first
put until B holds the last one (B asked every ``POLL_S``, an Exists of
the values not seen there yet: cheaper for the daemons than scraping
A's metrics), against the TCP ceiling between the same two nodes; each
daemon's CPU over the same time (schedstat, the polls included), and every
value then read back from B and checked."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvd.client import Client
from kvd.tools.bench.procs import process_cpu_ns
from kvd.tools.replay.run import block_value

if TYPE_CHECKING:
    from kvd.tools.bench.pool_nodes import Member

# Puts handed on before the clock starts: the connections to B up.
WARM_PUTS = 4
# Longest the last value may take to reach B after its put was answered.
HANDOFF_WAIT_S = 60.0
POLL_S = 0.002


def cpu_s(pid: int) -> float:
    """A daemon's CPU seconds so far (``process_cpu_ns``: every thread's
    schedstat, in ns, not /proc/PID/stat's 10 ms ticks); 0 once it is gone."""
    return (process_cpu_ns(pid) or 0) / 1e9


def handed_on(
    a: Member, b: Member, token: str, ns: str, keys: list[bytes], value_bytes: int,
    timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Put ``keys`` (B owns them; key i holds ``block_value(i)``) through A,
    the first ``WARM_PUTS`` untimed; the rate until B has them all."""
    warm, timed = keys[:WARM_PUTS], keys[WARM_PUTS:]
    values = [block_value(i, value_bytes) for i in range(len(keys))]
    pids = (a.running.proc.pid, b.running.proc.pid)
    engine = Client(a.socket_target, token=token, timeout_s=timeout_s)
    owner = Client(b.socket_target, token=token, timeout_s=timeout_s)
    with engine, owner:
        for i, key in enumerate(warm):
            engine.put(ns, key, values[i])
        _wait_held(owner, ns, warm)
        cpu_before = [cpu_s(pid) for pid in pids]
        started = time.perf_counter()
        for i, key in enumerate(timed, len(warm)):
            engine.put(ns, key, values[i])
        answered_s = time.perf_counter() - started
        _wait_held(owner, ns, timed)
        seconds = time.perf_counter() - started
        cpu_a, cpu_b = (cpu_s(pid) - before for pid, before in zip(pids, cpu_before, strict=True))
        wrong = misses = 0
        for i, key in enumerate(keys):
            got = owner.get(ns, key)
            if got is None:
                misses += 1
            elif got != values[i]:
                wrong += len(got)
    moved = len(timed) * value_bytes
    return {
        "values": len(timed),
        "value_bytes": value_bytes,
        "bytes_per_s": moved / seconds,
        "puts_answered_bytes_per_s": moved / answered_s,
        "cpu_ms_per_value": {"member": cpu_a / len(timed) * 1e3, "owner": cpu_b / len(timed) * 1e3},
        "forward_errors": a.metric("kvd_cluster_forward_errors_total"),
        "wrong_bytes": wrong,
        "misses": misses,
    }


def _wait_held(owner: Client, ns: str, keys: list[bytes]) -> None:
    """Until the owner holds every one of ``keys``, or ``HANDOFF_WAIT_S``
    passed (a put not handed on: its get is then a miss, reported)."""
    deadline = time.monotonic() + HANDOFF_WAIT_S
    while keys and time.monotonic() < deadline:
        keys = [key for key, held in zip(keys, owner.exists(ns, keys), strict=True) if not held]
        if keys:
            time.sleep(POLL_S)
