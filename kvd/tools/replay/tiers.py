"""Two-tier replay: an L1 eviction policy in front of an L2 with FIFO reclaim,
and an optional L2 admission rule, simulated on a trace.

The model follows the daemon's placement (DESIGN.md): a put lands in L1 and
is written to L2 behind it; L1 evicts by its policy (``kvd.store.eviction.policy``); a
lookup's prefix runs over both tiers (a block counts if either holds it,
and the prefix stops at the first block neither holds); an L2 hit is read
into L1 (promotion) and served. L2 reclaims space oldest write first; with
``reinsert`` a reclaimed block still in L1 is written again, which counts
as a write: the daemon's rule (its reclaim queues such a value for a
rewrite, ``kvd.store.placement.on_l2_drop``; the rewrite credit that caps
the daemon's rewrites at half the bytes written is not modelled, and a
round of blocks all still in L1 drops the oldest anyway). A block read
from L2 and evicted from L1 since is not written again: that would take
reading it back. Whole-segment reclaim (255 blocks at a time in ``kvd
bench replay --l2-ratio``'s daemon) moved no figure by more than 0.4 of a
point on the conversation trace and ``documents`` at 1 % and 10 x, so
blocks go one at a time here.

Admission (``admit``):

* ``all`` -- every block put is written to L2 (the daemon today);
* ``twice`` -- a block is written to L2 only once it has been referenced by
  two requests (Dynamo KVBM's rule for its disk tier): a block seen once
  and never again is never written. A block not written when L1 evicts it
  is lost.
* ``evict`` -- every block is written when L1 evicts it (write-back), not
  when it is put: a block that leaves L1 only at the end, or comes back
  from L2 and is still there, costs no write.
* ``expect`` -- written when L1 evicts it, and only if the L1 policy
  expects it back: ``density``'s ``reuse_chance`` (its class's chance of
  another reference within L2's residence -- L2's size over its writes per
  lookup so far -- given the time it has waited) at least ``EXPECT_MIN``.
  Policies without it write every evicted block.

Per request, as in ``kvd.tools.replay.sim``: the policy hears the lookup
(``on_lookup`` with the leading L1 hits), the promoted L2 hits and the
missed blocks are inserted into L1 in chain order, the hits pinned while
the request is served (as the replay's lease pins them in the daemon).
Reported: combined block hit ratio, the L1 share of the hits, and the
blocks written to L2 (SSD wear and write bandwidth).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvd.store.eviction.density import DensityPolicy
from kvd.store.eviction.policy import make_policy
from kvd.tools.replay.sim import SimError
from kvd.tools.replay.trace import Trace

ADMISSIONS = ("all", "twice", "evict", "expect")
# ``expect`` writes an evicted block whose chance of coming back within
# L2's residence is at least this: the threshold that saved the most writes
# with at most 2 % of the hits lost in every tuning cell (conversation,
# shared-prompts, documents; L1 1 %, L2 10 / 50 x L1). Writes saved / hits
# lost, worst tuning cell: 0.03: 7.3 % / 2.0 %; 0.05: 7.3 % / 2.9 %; 0.08:
# 7.6 % / 6.1 %; 0.12: 16.2 % / 36.9 % (docs/eviction-workloads.md).
EXPECT_MIN = 0.03


@dataclass(frozen=True)
class TierResult:
    """One two-tier replay."""

    policy: str
    admit: str
    reinsert: bool
    l1_blocks: int
    l2_blocks: int
    block_refs: int
    l1_hits: int
    l2_hits: int
    l2_writes: int  # blocks written to L2, reinsertions included
    l2_reinserts: int
    lost: int  # blocks L1 evicted that L2 did not hold

    @property
    def block_hit_ratio(self) -> float:
        return (self.l1_hits + self.l2_hits) / self.block_refs if self.block_refs else 0.0

    @property
    def l1_share(self) -> float:
        hits = self.l1_hits + self.l2_hits
        return self.l1_hits / hits if hits else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "block_hit_ratio": self.block_hit_ratio,
                "l1_share": self.l1_share}  # fmt: skip


class _L2:
    """Block-level FIFO; with ``reinsert``, a reclaimed block that ``in_l1``
    marks is written again."""

    def __init__(self, capacity_blocks: int, reinsert: bool, in_l1: bytearray) -> None:
        self.capacity_blocks = capacity_blocks
        self.reinsert = reinsert
        self.in_l1 = in_l1
        self.fifo: OrderedDict[int, None] = OrderedDict()  # oldest write first
        self.writes = 0
        self.reinserts = 0

    def __contains__(self, block: int) -> bool:
        return block in self.fifo

    def write(self, block: int) -> None:
        if block in self.fifo or self.capacity_blocks <= 0:
            return
        self.writes += 1
        # Written again at most once each per write: the loop ends within
        # 2 x capacity rounds even when every block is still in L1.
        again = 0
        while len(self.fifo) >= self.capacity_blocks:
            oldest, _ = self.fifo.popitem(last=False)
            if self.reinsert and self.in_l1[oldest] and again < self.capacity_blocks:
                self.fifo[oldest] = None
                self.writes += 1
                self.reinserts += 1
                again += 1
        self.fifo[block] = None


def simulate_tiers(
    trace: Trace, policy_name: str, l1_blocks: int, l2_blocks: int, *,
    admit: str = "all", reinsert: bool = True, expect_min: float = EXPECT_MIN,
) -> TierResult:  # fmt: skip
    """Replay ``trace`` over L1 (``policy_name``, ``l1_blocks``) and L2
    (``l2_blocks``, FIFO reclaim) with an admission rule (module doc)."""
    if admit not in ADMISSIONS:
        raise SimError(f"unknown admission {admit!r}; expected one of {ADMISSIONS}")
    if l1_blocks < 1 or l2_blocks < 0:
        raise SimError(f"tier sizes must be >= 1 and >= 0 blocks, got {l1_blocks}, {l2_blocks}")
    policy = make_policy(policy_name)
    reuse_chance = policy.reuse_chance if isinstance(policy, DensityPolicy) else None
    write_on_evict = admit in ("evict", "expect")
    blocks: list[int] = trace.blocks.tolist()
    offsets: list[int] = trace.offsets.tolist()
    in_l1 = bytearray(trace.n_unique)
    l2 = _L2(l2_blocks, reinsert, in_l1)
    seen = bytearray(trace.n_unique)  # requests that referenced a block, capped at 2
    pinned: set[int] = set()
    stored = l1_hits = l2_hits = lost = 0
    for request in range(len(offsets) - 1):
        chain = blocks[offsets[request] : offsets[request + 1]]
        n = len(chain)
        hits = leading_l1 = 0
        while hits < n and (in_l1[chain[hits]] or chain[hits] in l2):
            key = chain[hits]
            if in_l1[key]:
                l1_hits += 1
                leading_l1 += leading_l1 == hits
                policy.touch(key)
            else:
                l2_hits += 1
            hits += 1
        policy.on_lookup(chain, leading_l1)
        pinned.clear()
        pinned.update(chain[:hits])
        parent: int | None = None
        for position, key in enumerate(chain):
            if seen[key] < 2:
                seen[key] += 1
            if in_l1[key]:
                if position >= hits:
                    policy.touch(key)  # resident past the first miss: its put is an access
                parent = key
                continue
            # An L2 hit is promoted; a miss is put.
            while stored >= l1_blocks:
                victim = policy.victim(pinned.__contains__)
                if victim is None:
                    break
                if write_on_evict and victim not in l2:
                    # L2 keeps a write for about its size / writes per lookup.
                    kept = int(l2_blocks * (request + 1) / max(l2.writes, 1))
                    if (
                        admit == "evict"
                        or reuse_chance is None
                        or (reuse_chance(victim, kept) >= expect_min)
                    ):
                        l2.write(victim)
                policy.remove(victim)
                in_l1[victim] = 0
                stored -= 1
                if victim not in l2:
                    lost += 1
            if stored >= l1_blocks:
                break  # everything else is pinned: the rest is not stored
            policy.insert(key, parent)
            in_l1[key] = 1
            stored += 1
            parent = key
            if position >= hits and admit == "all":
                l2.write(key)
        if admit == "twice":
            for key in chain:
                if seen[key] >= 2 and in_l1[key]:
                    l2.write(key)
    return TierResult(
        policy_name, admit, reinsert, l1_blocks, l2_blocks, trace.n_refs, l1_hits, l2_hits,
        l2.writes, l2.reinserts, lost,
    )  # fmt: skip


def sweep_tiers(
    trace: Trace, policy_name: str, l1_blocks: int, ratios: Sequence[int] = (10, 50)
) -> list[TierResult]:
    """At each L2 / L1 ratio: ``all`` with and without reinsertion, then the
    other admission rules with it."""
    return [
        simulate_tiers(
            trace, policy_name, l1_blocks, ratio * l1_blocks, admit=admit, reinsert=reinsert
        )
        for ratio in ratios
        for admit in ADMISSIONS
        for reinsert in ((True, False) if admit == "all" else (True,))
    ]
