"""``kvd bench pool``'s replays with a change of members
(``kvd.tools.bench.pool``), members from a real etcd, request i through
member i mod N of the members then (as the hit-ratio replay sends it):

- **join** (``run``): the trace's first half through four members, then a
  fifth joins; once the old members have handed it the values it owns
  (``kvd.cluster.rebalance``: their hand-off counters and forward queues
  still for ``HANDOFF_QUIET_S``), the second half through the five;
- **leave** (``run_leave``): the first half through five members, then the
  fifth, started with ``pool_leave_handoff_ms``, stops (SIGTERM: it hands
  what it owns to the others, then leaves); once the others' walks have
  gone quiet (they keep the copies they got as their own), the second half
  through the four.

Reported: the block hit ratio of the first ``WINDOW`` requests after the
change and of all of them, beside the pool simulator's for the same
members, capacities and change (``kvd.tools.replay.pool_sim``): as the
daemon makes it (values handed on with their history in the old owner's
eviction policy); without the histories (as before PEER_HISTORY); a
leave without the hand-off; and without the change. The simulator hands
the values on between two requests, the daemon while the replay waits
for it, so their decisions differ in timing only (which values each
member walks first among them). Every block read is checked. The members
run on loopback, as the join's; without the etcd binary the case is
skipped and says so.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.cluster.rebalance import SETTLE_S
from kvd.store.eviction.policy import DEFAULT_POLICY
from kvd.tools.bench.etcd import etcd_binary
from kvd.tools.bench.pool_join import (
    JOIN_WAIT_S,
    LEAVE_HANDOFF_MS,
    MEMBERS,
    EtcdMembers,
    handoff_line,
)
from kvd.tools.bench.pool_nodes import Member
from kvd.tools.replay.pool_sim import simulate_pool
from kvd.tools.replay.report import head
from kvd.tools.replay.run import ReplayStats, _request, capacity_of, dram_bytes_for
from kvd.tools.replay.trace import Trace

NS = "replay"  # the simulator's namespace: the same owners
WINDOW = 1000  # requests right after the change, reported apart
# A hand-off is done once the members' counters and forward queues have
# been still this long.
HANDOFF_QUIET_S = 1.0
CALL_TIMEOUT_S = 30.0
# What the members count as they hand values on or keep copies as their own.
HANDOFF_COUNTERS = ("kvd_cluster_rebalanced_total", "kvd_cluster_rebalance_adopted_total")

Progress = Callable[[str], None]


class _Replay:
    """The trace through a pool from etcd, its members' clients in order."""

    def __init__(
        self, root: Path, trace: Trace, capacity_fraction: float, block_bytes: int, name: str
    ) -> None:
        unique = len(set(trace.blocks.tolist()))
        dram = dram_bytes_for(max(1, int(unique * capacity_fraction) // MEMBERS), block_bytes)
        self.per_member = capacity_of(dram, block_bytes)
        self.trace, self.block_bytes = trace, block_bytes
        self.at = len(trace) // 2
        self.window = min(WINDOW, len(trace) - self.at)
        workdir = Path(tempfile.mkdtemp(prefix=f"{name}-replay-", dir=root))
        self.pool = EtcdMembers(workdir, str(dram), max_value=str(max(block_bytes, 1024)))
        self.clients: dict[str, Client] = {}
        self.before, self.right_after, self.later = ReplayStats(), ReplayStats(), ReplayStats()

    def add(self, *extra: str) -> Member:
        member = self.pool.add(*extra)
        self.clients[member.address] = Client(
            member.socket_target, token=self.pool.token, timeout_s=CALL_TIMEOUT_S
        )
        return member

    def first_half(self, *more: tuple[str, ...]) -> list[Member]:
        """``MEMBERS`` members, then one more per ``more`` (its flags); the
        trace's first half through them. The members, in order."""
        for _ in range(MEMBERS):
            self.add()
        for extra in more:
            self.add(*extra)
        self.pool.wait_members()
        self.requests(0, self.at)
        return list(self.pool.members)

    def stop(self, member: Member) -> None:
        self.pool.members.remove(member)
        self.clients.pop(member.address).close()
        member.stop()

    def requests(self, first: int, end: int) -> None:
        """Requests [first, end) through the members now."""
        clients = [self.clients[m.address] for m in self.pool.members]
        for index in range(first, end):
            if index < self.at:
                stats = self.before
            else:
                stats = self.right_after if index < self.at + self.window else self.later
            _request(clients[index % len(clients)], NS, self.trace, index, self.block_bytes, stats)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.pool.stop()

    def figures(self, addresses: list[str], cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
        after = ReplayStats()
        for part in (self.right_after, self.later):
            after.merge(part)
        return {
            "requests": len(self.trace),
            "change_at": self.at,
            "window": self.window,
            "capacity_blocks_per_member": self.per_member,
            "before": self.before.figures(),
            "right_after": self.right_after.figures(),
            "after": after.figures(),
            "simulated": self._simulated(addresses, cases),
        }

    def _simulated(
        self, members: list[str], cases: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, float]]:
        """The simulator's hit ratios after the change, right after it and
        all, per case (``simulate_pool``'s options)."""
        trace, at = self.trace, self.at
        offsets = trace.offsets
        refs = {"right_after": int(offsets[at + self.window] - offsets[at]),
                "after": int(offsets[-1] - offsets[at])}  # fmt: skip
        simulated: dict[str, dict[str, float]] = {}
        for name, options in cases.items():
            ratios = {}
            for span, replayed in (("right_after", head(trace, at + self.window)),
                                   ("after", trace)):  # fmt: skip
                result = simulate_pool(
                    replayed, DEFAULT_POLICY, members, self.per_member, counted_from=at, **options
                )
                ratios[span] = result.block_hits / refs[span] if refs[span] else 0.0
            simulated[name] = ratios
        return simulated


def run(
    root: Path, trace: Trace, capacity_fraction: float, block_bytes: int, progress: Progress
) -> dict[str, Any]:
    """The replay with a fifth member joining halfway (module doc)."""
    skipped = _skipped(trace)
    if skipped:
        return skipped
    replay = _Replay(root, trace, capacity_fraction, block_bytes, "join")
    pool = replay.pool
    try:
        progress(f"pool: join replay: {replay.at} requests over {MEMBERS} members from etcd")
        old = replay.first_half()
        joined = replay.add()
        pool.wait_members()
        handoff_s = _handed_off(old)
        progress(f"pool: join replay: handed on in {handoff_s:.1f} s; the rest over five")
        replay.requests(replay.at, len(trace))
        handed_on = sum(m.metric("kvd_cluster_rebalanced_total") for m in old)
        histories = joined.metric("kvd_cluster_histories_taken_total")
        errors = sum(m.metric("kvd_cluster_forward_errors_total") for m in pool.members)
        addresses = [m.address for m in pool.members]
    finally:
        replay.close()
    four, fifth, at = addresses[:MEMBERS], addresses[MEMBERS], replay.at
    cases: dict[str, dict[str, Any]] = {
        "join": {"join": (at, fifth)},
        "join_without_histories": {"join": (at, fifth), "histories": False},
        "no_join": {},
    }
    return {
        **replay.figures(four, cases),
        "join_at": at,
        "handoff_s": handoff_s,
        "handed_on": handed_on,
        "histories_taken": histories,
        "forward_errors": errors,
    }


def run_leave(
    root: Path, trace: Trace, capacity_fraction: float, block_bytes: int, progress: Progress
) -> dict[str, Any]:
    """The replay with the fifth of five members leaving halfway (module doc)."""
    skipped = _skipped(trace)
    if skipped:
        return skipped
    replay = _Replay(root, trace, capacity_fraction, block_bytes, "leave")
    pool = replay.pool
    try:
        progress(f"pool: leave replay: {replay.at} requests over {MEMBERS + 1} members")
        members = replay.first_half(("--pool-leave-handoff-ms", str(LEAVE_HANDOFF_MS)))
        leaving, addresses = members[-1], [m.address for m in members]
        started = time.perf_counter()
        replay.stop(leaving)
        stop_s = time.perf_counter() - started
        pool.wait_members()
        handoff_s = _handed_off(pool.members)
        progress(f"pool: leave replay: stopped in {stop_s:.1f} s; the rest over four")
        replay.requests(replay.at, len(trace))
        said = handoff_line(leaving)
        adopted = sum(m.metric("kvd_cluster_rebalance_adopted_total") for m in pool.members)
        histories = sum(m.metric("kvd_cluster_histories_taken_total") for m in pool.members)
    finally:
        replay.close()
    fifth, at = addresses[MEMBERS], replay.at
    cases: dict[str, dict[str, Any]] = {
        "leave": {"leave": (at, fifth)},
        "leave_without_histories": {"leave": (at, fifth), "histories": False},
        "leave_without_hand_off": {"leave": (at, fifth), "leave_hand_off": False},
        "no_leave": {},
    }
    return {
        **replay.figures(addresses, cases),
        "leave_at": at,
        "stop_s": stop_s,
        "quiet_after_s": handoff_s,
        "hand_off_log": said,
        "adopted": adopted,
        "histories_taken": histories,
    }


def _skipped(trace: Trace) -> dict[str, Any]:
    """Why the replay cannot run here; empty where it can."""
    if etcd_binary() is None:
        return {"skipped": "no etcd binary (apt-get install etcd-server)"}
    if len(trace) < 2:
        return {"skipped": f"a trace of {len(trace)} requests"}
    return {}


def _handed_off(members: list[Member]) -> float:
    """Seconds until the members' hand-off went quiet: ``HANDOFF_COUNTERS``
    and forward queues still for ``HANDOFF_QUIET_S``, once their walks have
    begun (``SETTLE_S`` after they saw the change)."""
    started = time.perf_counter()
    last, still_since = -1.0, started
    while True:
        counted = sum(m.metric(name) for m in members for name in HANDOFF_COUNTERS)
        queued = sum(m.metric("kvd_cluster_forward_queue") for m in members)
        now = time.perf_counter()
        if counted != last or queued:
            last, still_since = counted, now
        elif now - started >= SETTLE_S + HANDOFF_QUIET_S and now - still_since >= HANDOFF_QUIET_S:
            return still_since - started
        if now - started > JOIN_WAIT_S:
            raise RuntimeError(f"pool replay: the hand-off went on past {JOIN_WAIT_S:g} s")
        time.sleep(0.05)
