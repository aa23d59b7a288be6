"""``kvd bench pool``'s replay with a join (``kvd.tools.bench.pool``): a
trace's first half through four members whose membership comes from a real
etcd (request i through member i mod 4, as the hit-ratio replay sends it),
then a fifth member joins; once the old members have handed it the values
it owns (``kvd.cluster.rebalance``: their hand-off counters quiet for
``HANDOFF_QUIET_S``), the second half through the five (request i through
member i mod 5).

Reported: the block hit ratio of the first ``WINDOW`` requests after the
join and of all of them, beside the pool simulator's for the same members,
capacities and join (``kvd.tools.replay.pool_sim``): with the values handed
on with their history in the old owner's eviction policy, as the daemon
hands them; without it (as before PEER_HISTORY); and without the join.
The simulator hands the values on between two requests, the daemon while
the replay waits for it, so their decisions differ in timing only (which
values each old member walks first among them). Every block read is
checked. The members run on loopback, as the join's; without the etcd
binary the case is skipped and says so.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.store.eviction.policy import DEFAULT_POLICY
from kvd.tools.bench.etcd import etcd_binary
from kvd.tools.bench.pool_join import JOIN_WAIT_S, MEMBERS, EtcdMembers
from kvd.tools.bench.pool_nodes import Member
from kvd.tools.replay.pool_sim import simulate_pool
from kvd.tools.replay.report import head
from kvd.tools.replay.run import ReplayStats, _request, capacity_of, dram_bytes_for
from kvd.tools.replay.trace import Trace

NS = "replay"  # the simulator's namespace: the same owners
WINDOW = 1000  # requests right after the join, reported apart
# The old members' hand-off is done once their counters and forward queues
# have been still this long.
HANDOFF_QUIET_S = 1.0
CALL_TIMEOUT_S = 30.0


def run(
    root: Path, trace: Trace, capacity_fraction: float, block_bytes: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """The replay with a fifth member joining halfway (module doc)."""
    if etcd_binary() is None:
        return {"skipped": "no etcd binary (apt-get install etcd-server)"}
    if len(trace) < 2:
        return {"skipped": f"a trace of {len(trace)} requests"}
    unique = len(set(trace.blocks.tolist()))
    member_dram = dram_bytes_for(max(1, int(unique * capacity_fraction) // MEMBERS), block_bytes)
    per_member = capacity_of(member_dram, block_bytes)
    at = len(trace) // 2
    window = min(WINDOW, len(trace) - at)
    workdir = Path(tempfile.mkdtemp(prefix="join-replay-", dir=root))
    pool = EtcdMembers(workdir, str(member_dram), max_value=str(max(block_bytes, 1024)))
    clients: list[Client] = []
    before, right_after, later = ReplayStats(), ReplayStats(), ReplayStats()
    try:
        progress(f"pool: join replay: {at} requests over {MEMBERS} members from etcd")
        for _ in range(MEMBERS):
            pool.add()
        pool.wait_members()
        for member in pool.members:
            clients.append(Client(member.socket_target, token=pool.token, timeout_s=CALL_TIMEOUT_S))
        for index in range(at):
            _request(clients[index % MEMBERS], NS, trace, index, block_bytes, before)
        old = list(pool.members)
        joined = pool.add()
        pool.wait_members()
        handoff_s = _handed_off(old)
        progress(f"pool: join replay: handed on in {handoff_s:.1f} s; {len(trace) - at} more")
        clients.append(Client(joined.socket_target, token=pool.token, timeout_s=CALL_TIMEOUT_S))
        for index in range(at, len(trace)):
            stats = right_after if index < at + window else later
            _request(clients[index % (MEMBERS + 1)], NS, trace, index, block_bytes, stats)
        handed_on = sum(m.metric("kvd_cluster_rebalanced_total") for m in old)
        histories = joined.metric("kvd_cluster_histories_taken_total")
        errors = sum(m.metric("kvd_cluster_forward_errors_total") for m in pool.members)
        addresses = [m.address for m in pool.members]
    finally:
        for client in clients:
            client.close()
        pool.stop()
    after = ReplayStats()
    for part in (right_after, later):
        after.merge(part)
    return {
        "requests": len(trace),
        "join_at": at,
        "window": window,
        "capacity_blocks_per_member": per_member,
        "handoff_s": handoff_s,
        "handed_on": handed_on,
        "histories_taken": histories,
        "forward_errors": errors,
        "before": before.figures(),
        "right_after": right_after.figures(),
        "after": after.figures(),
        "simulated": _simulated(trace, addresses, per_member, at, window),
    }


def _handed_off(old: list[Member]) -> float:
    """Seconds from the join until the old members' hand-off went quiet."""
    started = time.perf_counter()
    last, still_since = -1.0, started
    while True:
        handed = sum(m.metric("kvd_cluster_rebalanced_total") for m in old)
        queued = sum(m.metric("kvd_cluster_forward_queue") for m in old)
        now = time.perf_counter()
        if handed != last or queued:
            last, still_since = handed, now
        elif handed and now - still_since >= HANDOFF_QUIET_S:
            return still_since - started
        if now - started > JOIN_WAIT_S:
            raise RuntimeError(f"pool join replay: the hand-off went on past {JOIN_WAIT_S:g} s")
        time.sleep(0.05)


def _simulated(
    trace: Trace, addresses: list[str], per_member: int, at: int, window: int
) -> dict[str, dict[str, float]]:
    """The simulator's hit ratios after the join: right after it and all,
    the join as the daemon made it, without histories, and without it."""
    four, fifth = addresses[:MEMBERS], addresses[MEMBERS]
    offsets = trace.offsets
    refs = {"right_after": int(offsets[at + window] - offsets[at]),
            "after": int(offsets[-1] - offsets[at])}  # fmt: skip
    cases: dict[str, dict[str, Any]] = {
        "join": {"join": (at, fifth)},
        "join_without_histories": {"join": (at, fifth), "histories": False},
        "no_join": {},
    }
    simulated: dict[str, dict[str, float]] = {}
    for name, options in cases.items():
        ratios = {}
        for span, replayed in (("right_after", head(trace, at + window)), ("after", trace)):
            result = simulate_pool(
                replayed, DEFAULT_POLICY, four, per_member, counted_from=at, **options
            )
            ratios[span] = result.block_hits / refs[span] if refs[span] else 0.0
        simulated[name] = ratios
    return simulated
