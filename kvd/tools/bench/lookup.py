"""Chain lookups: how long an engine's scheduler waits on one.

vLLM asks its connector for every waiting request, once per step
(``get_num_new_matched_tokens``), how much of the prompt kvd holds; long
contexts in small blocks make that thousands of keys, and the scheduler
stalls for every request until the answer comes. This suite times a lookup
of a chain of 1, 1,000 and 10,000 keys (all in L1, a lease taken as the
connectors do, released after each call, untimed) over each way a client
reaches the daemon:

* ``shm-socket``: the daemon's Unix socket, one frame each way: what a
  client on the daemon's node (every connector by default) uses;
* ``shm-burst``: the same, ``BURST`` lookups back to back and then their
  releases, as a scheduler step asks for each waiting request in turn:
  each lookup may wait for the work the daemon does after answering the
  one before (the eviction policy's learning, its plan every 64 lookups),
  which a release between lookups hides;
* ``grpc-unix``: gRPC over the same Unix socket path's gRPC listener;
* ``grpc-tcp``: gRPC over loopback TCP (a client on another node).

Each case reports the wall time per call (p50, p90, p99, max) and the CPU
time per call of the daemon's event loop thread (its schedstat, lookups and
their releases together, the policy's learning after the answer included)
and of the client: CPU time is what noise on a shared machine
does not inflate. The 1-key row of a path is its floor: the round trip
itself.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.tools.bench.daemon import SpawnedDaemon

CHAIN_KEYS = (1, 1_000, 10_000)
PATHS = ("shm-socket", "shm-burst", "grpc-unix", "grpc-tcp")
# Lookups in a row on the shm-burst path, then their releases.
BURST = 16
# The connectors' default lease (kvd.connectors.common.DEFAULT_LEASE_MS).
LEASE_MS = 10_000
VALUE_BYTES = 1024
# Each 1 KiB value takes one 64 KiB page: 11,001 values ~ 690 MiB.
DRAM = "1GiB"
# Calls per case: enough for a p99 of a few hundred samples; fewer for the
# 10,000-key chain, which takes ~10x as long a call.
CALLS = {1: 400, 1_000: 400, 10_000: 150}
TARGET_P99_MS = {1_000: 2.0, 10_000: 10.0}  # the connectors' default path

Progress = Callable[[str], None]


@dataclass
class Row:
    path: str
    keys: int
    calls: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    daemon_cpu_us: float  # per lookup (and its release)
    client_cpu_us: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def chain(keys: int, salt: bytes = b"") -> list[bytes]:
    """A chain of 32-byte keys, as the connectors' chained hashes are."""
    return [hashlib.sha256(b"%s chain %d key %d" % (salt, keys, i)).digest() for i in range(keys)]


def _cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread so far (its event loop):
    schedstat counts nanoseconds, /proc/PID/stat only clock ticks (10 ms)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(sorted_s: Sequence[float], share: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * share))] * 1e3


def time_lookups(
    client: Client, ns: str, keys: list[bytes], calls: int, pid: int, burst: int = 1
) -> Row:
    """``calls`` timed lookups of ``keys`` through ``client``, ``burst`` in a
    row before their releases; the row's path is the caller's."""
    for _ in range(5):  # connections open, caches warm
        found = client.lookup_ex(ns, keys, LEASE_MS)
        client.release(ns, found.lease_id)
    walls: list[float] = []
    daemon_start, client_start = _cpu_s(pid), time.process_time()
    for first in range(0, calls, burst):
        leases = []
        for _ in range(min(burst, calls - first)):
            start = time.perf_counter()
            found = client.lookup_ex(ns, keys, LEASE_MS)
            walls.append(time.perf_counter() - start)
            if found.prefix_len != len(keys):
                raise RuntimeError(f"lookup found {found.prefix_len} of {len(keys)} keys")
            leases.append(found.lease_id)
        for lease in leases:
            client.release(ns, lease)
    daemon_cpu = _cpu_s(pid) - daemon_start
    client_cpu = time.process_time() - client_start
    walls.sort()
    return Row(
        "", len(keys), calls,
        round(_percentile(walls, 0.5), 3), round(_percentile(walls, 0.9), 3),
        round(_percentile(walls, 0.99), 3), round(walls[-1] * 1e3, 3),
        round(daemon_cpu / calls * 1e6, 1), round(client_cpu / calls * 1e6, 1),
    )  # fmt: skip


def _client(daemon: SpawnedDaemon, path: str) -> Client:
    if path in ("shm-socket", "shm-burst"):
        client = Client(daemon.socket_target)
        if "shm-socket" not in client.paths:
            raise RuntimeError("the client did not get the daemon's shm socket")
        return client
    if path == "grpc-unix":
        return Client(daemon.socket_target, shm=False)
    return Client(daemon.target, bulk=False)


def run(
    progress: Progress,
    chain_keys: Sequence[int] = CHAIN_KEYS,
    paths: Sequence[str] = PATHS,
    calls: dict[int, int] | None = None,
) -> list[Row]:
    calls = calls or CALLS
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-lookup-") as tmp:
        daemon = SpawnedDaemon(Path(tmp), [], dram=DRAM, ssd="")
        try:
            chains = {n: chain(n) for n in chain_keys}
            with Client(daemon.socket_target) as loader:
                value = os.urandom(VALUE_BYTES)
                for keys in chains.values():
                    for start in range(0, len(keys), 1000):
                        part = keys[start : start + 1000]
                        parent = keys[start - 1] if start else None
                        loader.put_many("bench", [(k, value) for k in part], chained=True,
                                        parent=parent)  # fmt: skip
            for path in paths:
                burst = BURST if path == "shm-burst" else 1
                with _client(daemon, path) as client:
                    for n, keys in chains.items():
                        progress(f"lookup {path} {n} keys")
                        row = time_lookups(client, "bench", keys, calls.get(n, 200),
                                           daemon.proc.pid, burst)  # fmt: skip
                        row.path = path
                        rows.append(row)
        finally:
            daemon.stop()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| path | keys | calls | p50 ms | p90 ms | p99 ms | max ms "
        "| daemon CPU µs | client CPU µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.path} | {r.keys:,} | {r.calls} | {r.p50_ms:.3f} | {r.p90_ms:.3f} | "
            f"{r.p99_ms:.3f} | {r.max_ms:.3f} | {r.daemon_cpu_us:,.0f} | {r.client_cpu_us:,.0f} |"
        )
    return "\n".join(lines)


def targets(rows: list[Row]) -> dict[str, Any]:
    """The p99 targets on the connectors' default path (shm-socket, one
    lookup at a time and in bursts), met or not."""
    found = {}
    for r in rows:
        goal = TARGET_P99_MS.get(r.keys)
        if r.path in ("shm-socket", "shm-burst") and goal is not None:
            name = "lookup" if r.path == "shm-socket" else "lookup_burst"
            found[f"{name}_{r.keys}_p99_ms"] = {"value": r.p99_ms, "target": goal,
                                                "met": r.p99_ms <= goal}  # fmt: skip
    return found
