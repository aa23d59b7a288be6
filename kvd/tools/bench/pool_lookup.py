"""``kvd bench pool``'s chain lookup: a chain stored through member 0 (handed
to its owners), looked up through member 1, which holds only its own share,
against a single daemon holding all of it.

The pool is measured as it runs by default, ``pool_lookup_hint_ms`` at
``LOOKUP_HINT_MS``, where a chain looked up again is answered from its
owners' recent answers (the timed lookups repeat one chain, as an engine's
scheduler asks about a waiting request at every step), and with the
setting at 0, where every lookup waits for the owners (as a chain's first
lookup does either way).
The timed lookups come back to back, or ``pace_ms`` apart, as an engine's
scheduler asks once a step.

Then both again with each node on its own CPUs (``split_cpus``): the
asking member and the engine (this process's calling thread) on the first
CPU, the other members on the rest, and the single daemon and its engine
on the first CPU alone. On one host five processes otherwise share every
CPU: an owner learning from a lookup (a PEER_TELL, a PEER_EXISTS) takes the
CPU the asking member and the engine need, which no owner on a node of its
own does. On two CPUs the three owners share the second, so an asked
lookup still waits for them one after the other. Where this process may
use fewer than two CPUs, these cases are left out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvd.client import Client
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.bench.pool_nodes import Pool, write_tokens

MiB = 1 << 20
MEMBERS = 4
LOOKUP_WARMUP = 5
# pool_lookup_hint_ms of the lookups measured with hints (the default).
LOOKUP_HINT_MS = 500
# Forwarded puts reach their owners in the background (4 in flight): a
# 1,000-key chain lands within seconds; a bound, not a wait.
SETTLE_S = 60.0
CALL_TIMEOUT_S = 60.0
# Peer calls may take 1 s here (the daemon's default is 200 ms): the bench
# measures the pool's speed, not a loaded machine's timeouts.
PEER_TIMEOUT_MS = 1000
NS = "bench-chain"

Progress = Callable[[str], None]


def lookup_times(client: Client, keys: list[bytes], count: int, pace_s: float = 0.0) -> list[float]:
    """``count`` timed lookups of the chain, ``pace_s`` apart (0: back to
    back), after ``LOOKUP_WARMUP`` untimed ones (as ``kvd bench lookup``):
    connections and caches warm on both sides. Before the daemon ran its own
    full garbage collections (kvd.util.collector), the second lookup of a
    1,000-key chain took 18-24 ms on one daemon as on a pool, a full
    collection, and of 200 lookups such a start was the p99."""
    for _ in range(LOOKUP_WARMUP):
        client.lookup(NS, keys)
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        found = client.lookup(NS, keys)
        seconds.append(time.perf_counter() - started)
        if found != len(keys):
            raise RuntimeError(f"lookup found {found} of {len(keys)} keys")
        if pace_s:
            time.sleep(pace_s)
    return seconds


def _wait_found(client: Client, keys: list[bytes]) -> None:
    deadline = time.monotonic() + SETTLE_S
    while client.lookup(NS, keys) != len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the chain did not reach its owners within {SETTLE_S:.0f} s")
        time.sleep(0.1)


def _dram(keys: list[bytes]) -> str:
    """L1 for the chain: a key takes one 64 KiB page, twice over, and room besides."""
    return str(len(keys) * 64 * 1024 * 2 + 64 * MiB)


def _percentiles_ms(seconds: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(seconds, [50, 99]) * 1e3
    return {"p50_ms": float(p50), "p99_ms": float(p99), "n": len(seconds)}


def cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def _pin(pid: int, where: set[int]) -> None:
    """Every thread of ``pid`` on ``where`` (the threads it starts later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), where)


@contextlib.contextmanager
def split_cpus(asking: int, others: list[int]) -> Iterator[None]:
    """``asking`` (a daemon's pid) and the calling thread on the first CPU,
    ``others`` on the rest; the calling thread's CPUs back after."""
    mine = os.sched_getaffinity(0)
    first, *rest = cpus()
    _pin(asking, {first})
    for pid in others:
        _pin(pid, set(rest))
    os.sched_setaffinity(0, {first})
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def _pool_case(
    root: Path, keys: list[bytes], lookups: int, pace_s: float, netns: bool,
    extra: tuple[str, ...], split: bool,
) -> tuple[list[float], dict[str, Any]]:  # fmt: skip
    items = [(key, key * 16) for key in keys]
    with Pool(root, MEMBERS, netns=netns, dram=_dram(keys), ssd="", peer_timeout_ms=PEER_TIMEOUT_MS,
              extra=extra) as pool:  # fmt: skip
        token = pool.token
        with Client(pool.members[0].socket_target, token=token, timeout_s=CALL_TIMEOUT_S) as c:
            c.put_many(NS, items, chained=True)
        asking = pool.members[1]
        others = [m.running.proc.pid for m in pool.members if m is not asking]
        pinned = split_cpus(asking.running.proc.pid, others) if split else contextlib.nullcontext()
        with Client(asking.socket_target, token=token, timeout_s=CALL_TIMEOUT_S) as c:
            _wait_found(c, keys)
            with pinned:
                seconds = lookup_times(c, keys, lookups, pace_s)
        facts = {
            "peer_errors": asking.metric("kvd_cluster_peer_errors_total"),
            "hinted": asking.metric("kvd_cluster_hinted_lookups_total"),
            "where": pool.where,
            "owners": len(set(pool.placement().owners(NS, keys))),
            "owns": len(pool.owned_by(1, NS, keys)),
        }
    return seconds, facts


def _single(root: Path, keys: list[bytes], lookups: int, pace_s: float, split: bool) -> list[float]:
    root.mkdir(parents=True)
    token, auth = write_tokens(root)
    daemon = SpawnedDaemon(root, auth, dram=_dram(keys), ssd="")
    try:
        pinned = split_cpus(daemon.proc.pid, []) if split else contextlib.nullcontext()
        with Client(daemon.socket_target, token=token, timeout_s=CALL_TIMEOUT_S) as c:
            c.put_many(NS, [(key, key * 16) for key in keys], chained=True)
            with pinned:
                return lookup_times(c, keys, lookups, pace_s)
    finally:
        daemon.stop()


def run(
    root: Path, chain_keys: int, lookups: int, pace_ms: float, netns: bool, progress: Progress
) -> dict[str, Any]:
    keys = [f"chain-{i:05d}".encode() for i in range(chain_keys)]
    pace_s = pace_ms / 1e3
    hint = ("--pool-lookup-hint-ms", str(LOOKUP_HINT_MS))
    splits = (False, True) if len(cpus()) >= 2 else (False,)
    result: dict[str, Any] = {
        "keys": chain_keys, "pace_ms": pace_ms, "peer_errors": 0.0,
        "default": "pool", "hint_ms": LOOKUP_HINT_MS,
    }  # fmt: skip
    for split in splits:
        on = ", each node on its own CPUs" if split else ""
        suffix = "_split" if split else ""
        for case, extra in (("pool", hint), ("pool_asked", ("--pool-lookup-hint-ms", "0"))):
            what = "hinted" if extra == hint else "asked"
            progress(
                f"pool: lookup of a {chain_keys}-key chain over {MEMBERS} members ({what}{on})"
            )
            seconds, facts = _pool_case(
                root / f"lookup-{what}{suffix}", keys, lookups, pace_s, netns, extra, split
            )
            result[case + suffix] = _percentiles_ms(seconds)
            result["peer_errors"] += facts["peer_errors"]
            if extra == hint and not split:
                result["hinted_lookups"] = facts["hinted"]
            result.update(
                where=facts["where"], owners=facts["owners"], asked_member_owns=facts["owns"]
            )
        progress(f"pool: the same lookup on a single daemon{on}")
        alone = _single(root / f"lookup-single{suffix}", keys, lookups, pace_s, split)
        result["single" + suffix] = _percentiles_ms(alone)
    if len(splits) > 1:
        result["split_cpus"] = {"first": cpus()[0], "rest": cpus()[1:]}
    return result
