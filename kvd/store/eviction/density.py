"""The ``density`` eviction policy: each block kept for a retention learned
per class of block reference, from how long such references wait for the
block's next reference (hit density per class, as in LHD, applied as
deadlines).

Where ``hazard`` learns per conversation turn (a turn is reused when a later
chain continues it), ``density`` learns per block: a block is reused when
any later lookup's chain holds it, whoever asks. A document re-read by many
questions, a tool prompt under every agent step, a conversation's next turn
and a one-shot batch request are the same kind of event to it, so no
workload needs a model of its own.

A reference is one key of a looked-up chain. Its class is
``gap x count x length``, plus one class for a chain's last block:

* gap: lookups since the block's previous reference, none (first seen) |
  <= 16 | <= 64 | <= 256 | <= 1024 | more: a short gap is a popular block;
* count: references of the block so far, this one included, 1 | 2-3 |
  4-7 | 8+;
* length: the chain's blocks, <= 16 | <= 64 | more.

A chain's last block is usually partial (the next turn replaces it), so it
is a class of its own; whether it is re-read is learned like the rest.
Gap and count are remembered while a block is resident and, after it is
evicted, in a ghost of at most 4x the blocks tracked.

What it learns. Each reference of class c at lookup ``t`` waits for the
block's next reference. A ring with a row per lookup and a column per class
counts the references still waiting; at every lookup the rows that reach a
log-spaced age edge enter the next age bin, and a reference that ends its
wait leaves its row and counts a reuse in its bin: a Kaplan-Meier estimate
of the reuse hazard per class and age. Classes share the pooled hazard's
shape and differ by a factor (proportional hazards: one factor per feature
value and a residual per class, each shrunk, as in ``hazard``).

Every 64 lookups it chooses the retentions. Keeping a reference of class c
for R lookups earns ``H_c(R)`` (its chance of reuse within R) and costs
``cost_c(R)`` (expected lookups it stays); R_c maximises
``H_c(R) - lambda * cost_c(R)``, with lambda set by bisection so that the
planned occupancy (references per lookup x mean cost, summed over classes)
fills the blocks tracked, and is capped at 4 mean residences (blocks
tracked / references per lookup). Victims are the earliest deadlines ``t + R_c``
(ties: the oldest access), chain tails first (kvd.store.eviction.chains' contract).

In a pool (``on_lookup``'s ``mine``), a member's blocks of a chain form a
chain of their own: each is linked to the member's block before it, and the
member's last one is not held back as a chain still being put. Linked to
the put's parent (another member's block) every owned block was a root, and
up to 1,024 of them were held back for good; the pool simulator's 4 members
(conversation trace at 5 %) went from 20.66 to 20.87 %, and on documents
at 10 % from 0.966x to 0.976x one daemon of their total L1 (docs/pool.md).

The members of a pool also keep their blocks by one plan. Each plans for
its own quarter of the blocks from its own quarter of the references, and
four plans that differ a little trim a chain's shares at different times:
the first member to drop its block of a chain cuts the chain for all, and
the others' blocks past it are held for nothing. The pool simulator's 4
members (conversation trace at 5 %) hit 21.18 % against one daemon's
23.01 %; with every member's clock moved by every lookup of the pool (a
lookup of no key of a member still counts: ``on_lookup`` of an empty
chain) and one member's plan used by all, 22.90 %. A member adopts
another's plan (``shared_plan``, ``adopt_plan``) while it is fresh, and
plans for itself again when it is not (kvd.cluster.plans).

Without ``on_lookup`` calls the clock never moves, every retention stays 0,
and blocks go in access order: exactly ``lru``. docs/eviction.md has the
measurements behind the features and numbers.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from heapq import heappush
from itertools import compress

import numpy as np
import numpy.typing as npt

from kvd.store.eviction.chains import HEAP_CHECK, HEAP_FACTOR, HEAP_SLACK, ChainPolicy, K, Node
from kvd.store.eviction.density_learn import Consts, State, learn
from kvd.store.eviction.density_plan import choose, proportional_hazards

# Bucket upper edges (inclusive) per feature; past the last edge is one more
# bucket. Gap 0 means "no previous reference". Measured on the tuning set
# (conversation trace at 5 / 10 %, documents at 10 %): gap x new blocks x
# length 22.74 / 29.39 / 48.17 %; gap x count x length (shipped) 23.04 /
# 29.57 / 47.99 %; other edges and a fourth feature moved them < 0.3 points
# (docs/eviction-workloads.md).
_GAP_EDGES = (0, 16, 64, 256, 1024)
_COUNT_EDGES = (1, 3, 7)
_LENGTH_EDGES = (16, 64)
_GAP_BUCKETS = len(_GAP_EDGES) + 1
_COUNT_BUCKETS = len(_COUNT_EDGES) + 1
_LENGTH_BUCKETS = len(_LENGTH_EDGES) + 1
_PRODUCT = _GAP_BUCKETS * _COUNT_BUCKETS * _LENGTH_BUCKETS
_LAST = _PRODUCT  # class of a chain's last block
_CLASSES = _PRODUCT + 1
_COUNT_MAX = 1 << 20
# Age bins in lookups: edges int(1.25^j) below 30 000 (43 edges, as
# ``hazard``'s spacing). The ring keeps one row per lookup, so it must
# outlast the last edge: 32 768 rows x 73 classes x 4 B = 9.4 MiB.
_AGE_EDGES: tuple[int, ...] = tuple(sorted({int(1.25**j) for j in range(60) if 1.25**j < 30_000}))
_BINS = len(_AGE_EDGES)
_RING = 1 << 15
assert _AGE_EDGES[-1] < _RING
# Retentions are recomputed every _REFRESH lookups (a 73 x 43 solve, ~0.09 ms
# hot in C, kvd.store.eviction.density_plan);
# counts are halved every _DECAY lookups. Halving every 1024 / 4096 lookups
# changed the tuning set's hit ratios by < 0.2 points.
_REFRESH = 64
_DECAY = 2048
# Bisection range of log(lambda) and its steps (2^-30 of the range).
_LOG_LAMBDA = (-20.0, 5.0)
_BISECT_STEPS = 30
# Keys announced by lookups and not yet put; oldest dropped past this bound.
_PENDING_MAX = 1 << 16
# A block's history handed to the member a pool's change made its owner
# (``history``, ``expect``): its class, gap and count, the lookups since its
# last reference and those to its deadline (negative: past), in the sender's
# clock. Without it a handed-on block was the new owner's unannounced put,
# due at once: the pool simulator (conversation trace at 5 %, a fifth
# member joining four at request 6,000) hit 17.97 % of the next 1,000
# requests' blocks against 22.30 % without the join; with it, 23.10 %.
_HISTORY = struct.Struct("<IIIIq")
_U32_MAX = (1 << 32) - 1
# Handed-on blocks expected and not yet put; oldest dropped past this bound.
_HANDED_MAX = 1 << 16
# Chains being put whose latest block is protected until its child arrives.
_FILLING_MAX = 1024
_ACCESS_MASK = (1 << 64) - 1
# Ghost size per block tracked. 1x / 4x / 16x: documents at 10 % 48.23 /
# 48.22 / 48.03 %, the conversation trace at 5 % 21.45 / 22.16 / 22.13 %
# (an early variant, measured with the ghost's fields swapped).
_GHOST_FACTOR = 4
# No retention beyond this many mean residences (blocks tracked / references
# per lookup). The plan treats blocks as independent, and a class whose
# long-age hazard is overestimated (agents' blocks under a shared tool
# prompt: 0.98 reused, mostly within 16 lookups, then paused agents) got
# 1 262 lookups and crowded out active chains: agents at 5 %: uncapped
# 83.24 %, cap 1 / 2 / 4 / 8: 88.00 / 88.01 / 88.13 / 88.36 % (lru 87.97);
# the conversation trace at 5 %: 23.05 / 20.86 / 22.22 / 23.01 / 23.05 %.
_RESIDENCE_CAP = 4.0
_RETENTION_MAX = _AGE_EDGES[-1]
# A plan shared with the members of a pool: the blocks its member tracked,
# then a retention per class. Adopted, it is used for this many lookups (the
# holder plans every _REFRESH); past that this policy's own plan is used
# again. Measured in the pool simulator (conversation trace at 5 %, 4
# members): asked for every 16 / 64 / 256 / 1,024 lookups, 22.90 / 22.81 /
# 22.62 / 21.92 % (kvd.cluster.plans).
_PLAN = struct.Struct(f"<Q{_CLASSES}I")
_PLAN_FRESH = 4 * _REFRESH
# A plan is adopted only from a member tracking at most this factor more or
# fewer blocks: the plan fills the blocks its member tracks, and a member of
# another size plans for itself.
_PLAN_SIZE_RATIO = 1.25

_EDGES = np.array(_AGE_EDGES, dtype=np.float64)
_WIDTHS = np.diff(np.concatenate([[0.0], _EDGES]))
_RETENTIONS = np.concatenate([[0.0], _EDGES])  # choice 0 keeps nothing
_EDGE_TICKS = np.array(_AGE_EDGES[:-1], dtype=np.int64)
# Edges below each lookup number, up to the last edge (after it: all).
_EDGES_CROSSED = tuple(bisect_left(_AGE_EDGES[:-1], now) for now in range(_AGE_EDGES[-2] + 1))
_IDS = np.arange(_CLASSES)
_ZERO_ROW = array("i", [0]) * _CLASSES
# A lookup's per-key bisections as tables (an index ~25 ns, a bisect_left
# call ~60 ns), flat int32 arrays that the native ``learn`` reads too: a
# count's bucket (up to the last count edge; _COUNT_TOP past it), the age
# bin of a wait up to _AGE_LAST, and a gap's bucket (up to the last gap
# edge; _GAP_TOP past it) times _COUNT_BUCKETS.
_COUNT_BUCKET = array("i", [bisect_left(_COUNT_EDGES, c) for c in range(_COUNT_EDGES[-1] + 1)])
_COUNT_TOP = len(_COUNT_EDGES)
_COUNT_BUCKET_LEN = len(_COUNT_BUCKET)
_RING_MASK = _RING - 1
_AGE_LAST = _AGE_EDGES[-1]
_AGE_BIN = array("i", [bisect_left(_AGE_EDGES, gap) for gap in range(_AGE_LAST + 1)])
_GAP_PART = array(
    "i", [bisect_left(_GAP_EDGES, gap) * _COUNT_BUCKETS for gap in range(_GAP_EDGES[-1] + 1)]
)
_GAP_TOP = len(_GAP_EDGES) * _COUNT_BUCKETS
_GAP_PART_LAST = _GAP_EDGES[-1]
_FEATURES: tuple[npt.NDArray[np.int64], ...] = (
    np.where(_IDS < _PRODUCT, _IDS // (_COUNT_BUCKETS * _LENGTH_BUCKETS), 0),
    np.where(_IDS < _PRODUCT, (_IDS // _LENGTH_BUCKETS) % _COUNT_BUCKETS, 0),
    np.where(_IDS < _PRODUCT, _IDS % _LENGTH_BUCKETS, 0),
    (_IDS == _LAST).astype(np.int64),
)

# What is remembered of a block's last reference: (class, gap, tick, count,
# deadline).
_Reference = tuple[int, int, int, int, int]


def reference_class(gap: int, count: int, chain_blocks: int, last: bool) -> int:
    """Class id of a block reference (0 .. _CLASSES - 1); gap 0: first seen."""
    if last:
        return _LAST
    gap_bucket = bisect_left(_GAP_EDGES, gap)
    count_bucket = bisect_left(_COUNT_EDGES, count)
    length_bucket = bisect_left(_LENGTH_EDGES, chain_blocks)
    return (gap_bucket * _COUNT_BUCKETS + count_bucket) * _LENGTH_BUCKETS + length_bucket


# The class of a block put without a lookup announcing it.
_UNANNOUNCED = reference_class(0, 1, 2, False)


class _DensityNode(Node[K]):
    __slots__ = ("count", "due", "gap", "klass", "tick")

    def __init__(self, parent: K | None) -> None:
        # Node's fields set here, not by super().__init__: one call less on
        # every put (~0.1 us).
        self.parent = parent
        self.hits = 0
        self.priority = 0.0
        self.seq = 0
        self.klass = 0
        self.gap = 0
        self.count = 0
        self.tick = -1  # lookup of the last reference; -1: never looked up
        self.due = 0  # deadline, in lookups


# What ``learn`` reads and writes of a node, and its constants.
_Entry = tuple[float, int, K]  # a heap entry: priority, push, key
_NODE_FIELDS = tuple(
    getattr(_DensityNode, field)
    for field in ("klass", "gap", "tick", "count", "due", "priority", "seq")
)
_CONSTS = Consts(
    _CLASSES, _BINS, _RING_MASK, _AGE_LAST, _COUNT_MAX, _COUNT_BUCKET_LEN, _COUNT_TOP,
    _GAP_PART_LAST, _GAP_TOP, _LENGTH_BUCKETS, _LAST, HEAP_CHECK,
)  # fmt: skip


class DensityPolicy(ChainPolicy[K]):
    """Deadline = last reference + retention of its class (see module doc)."""

    name = "density"
    # A lookup moving a deadline later leaves the block's heap entry in place
    # (kvd.store.eviction.density_learn); priorities end in an access number
    # of their own, so they never tie and the victims stay the same.
    lazy_raise = True

    def __init__(self) -> None:
        super().__init__()
        self._now = 0  # lookups seen
        self._accesses = 0  # orders equal deadlines, oldest access first
        self._retention = [0] * _CLASSES
        self._own_plan: list[int] | None = None  # this policy's last plan
        self._own_plan_due = False  # a plan was skipped while another member's was kept
        self._adopted_at = -1  # lookup at which another member's plan was adopted
        self._pending: dict[K, _Reference] = {}
        self._handed: dict[K, _Reference] = {}  # expect()ed, by key
        # A pool member's announced blocks: the member's previous block of the
        # chain (the parent to link it to) and whether it is the member's
        # last one there (see on_lookup).
        self._shares: dict[K, tuple[K | None, bool]] = {}
        self._share_ends = False  # the block being inserted ends its share
        self._filling: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, _Reference] = OrderedDict()
        # Per-key updates go to flat arrays (``learn``: in C, or an array
        # index ~40 ns against ~200 ns for a numpy scalar update); a numpy
        # view of ``reused`` does the per-refresh vector work.
        self._ring_tick = array("q", [-1]) * _RING
        self._ring_flat = array("i", [0]) * (_RING * _CLASSES)
        self._reused_flat = array("d", [0.0]) * (_CLASSES * _BINS)
        self._reused = np.frombuffer(self._reused_flat, dtype=np.float64).reshape(_CLASSES, _BINS)
        self._entered = np.zeros((_CLASSES, _BINS))  # waiting references that reached bin j
        self._lookups = 0.0  # decayed lookups
        # Survival per class and age bin at the last plan (reuse_chance).
        self._survival: npt.NDArray[np.float64] | None = None

    # -- what tests and operators may read ------------------------------------

    def retention(self, klass: int) -> int:
        """Current retention of a class, in lookups."""
        return self._retention[klass]

    @property
    def ghost_len(self) -> int:
        return len(self._ghost)

    @property
    def pending_len(self) -> int:
        return len(self._pending)

    def reuse_chance(self, key: K, within_lookups: int = _RETENTION_MAX) -> float:
        """The chance that ``key`` is referenced again within the next
        ``within_lookups`` lookups (at most the last age edge, ~28,700),
        given its class and that it has waited since its last reference:
        ``(S(age) - S(age + within)) / S(age)`` of its class's survival
        curve. 1.0 for a key not tracked, never looked up, or before the
        first plan (nothing learned yet)."""
        node = self._nodes.get(key)
        survival = self._survival
        if not isinstance(node, _DensityNode) or node.tick < 0 or survival is None:
            return 1.0
        row = survival[node.klass]
        age = self._now - node.tick
        reached = bisect_left(_AGE_EDGES, age)
        alive = float(row[reached - 1]) if reached else 1.0
        if alive <= 0.0:
            return 0.0
        until = min(bisect_left(_AGE_EDGES, age + max(within_lookups, 1)), _BINS - 1)
        return max(0.0, alive - float(row[until])) / alive

    def reuse_share(self, klass: int) -> float:
        """Reuses / references of a class (decayed); for tests and tuning."""
        entered = float(self._entered[klass, 0])
        return float(self._reused[klass].sum()) / entered if entered else 0.0

    # -- a pool's one plan -----------------------------------------------------

    def shared_plan(self) -> bytes | None:
        """This policy's own plan for the other members of a pool to adopt;
        None before its first. A member that keeps another's plan makes
        its own only when asked (a holder that left leaves its successor
        asked)."""
        if self._own_plan_due:
            self._plan()
        if self._own_plan is None:
            return None
        return _PLAN.pack(len(self._nodes), *self._own_plan)

    def adopt_plan(self, plan: bytes) -> bool:
        """Keep blocks by another member's plan (its ``shared_plan``) until
        it is _PLAN_FRESH lookups old. False, and nothing changes, for bytes
        that are no plan of this policy or the plan of a member of another
        size (_PLAN_SIZE_RATIO)."""
        if len(plan) != _PLAN.size:
            return False
        tracked, *retention = _PLAN.unpack(plan)
        if max(retention) > _RETENTION_MAX:
            return False
        mine = len(self._nodes)
        if tracked > _PLAN_SIZE_RATIO * mine or mine > _PLAN_SIZE_RATIO * tracked:
            return False
        self._retention = retention
        self._adopted_at = self._now
        return True

    @property
    def plan_adopted(self) -> bool:
        """Whether blocks are kept by another member's plan now."""
        return self._adopted_at >= 0 and self._now - self._adopted_at <= _PLAN_FRESH

    # -- blocks handed to another member -----------------------------------------

    def history(self, key: K) -> bytes | None:
        """The key's last reference (``_HISTORY``), relative to this clock;
        None for a key not resident or never looked up."""
        node = self._nodes.get(key)
        if not isinstance(node, _DensityNode) or node.tick < 0:
            return None
        now, most = self._now, _U32_MAX  # a gap or age past it: as long ago as can be said
        gap, age = min(node.gap, most), min(now - node.tick, most)
        return _HISTORY.pack(node.klass, gap, age, node.count, node.due - now)

    def expect(self, key: K, history: bytes) -> bool:
        """The key's next insert is a block handed on with another member's
        ``history``: it keeps that reference's class, count and deadline
        (moved to this clock; a reference from before this policy's first
        lookup counts as made at lookup 0), as if it had been made here. Its
        wait joins this policy's learning at its age, as a reference
        entering the risk sets late (left-truncated). False for bytes that
        are no history of this policy's, or a key resident already."""
        if len(history) != _HISTORY.size or key in self._nodes:
            return False
        klass, gap, age, count, remaining = _HISTORY.unpack(history)
        if klass >= _CLASSES or not 1 <= count <= _COUNT_MAX or remaining > _RETENTION_MAX:
            return False
        now = self._now
        handed = self._handed
        handed[key] = (klass, gap, max(0, now - age), count, max(0, now + remaining))
        while len(handed) > _HANDED_MAX:
            del handed[next(iter(handed))]
        return True

    def _join_ring(self, klass: int, tick: int) -> None:
        """A handed-on reference of ``klass`` made at ``tick`` waits here
        from now on: in its ring row, and entered in its age bin now."""
        age = self._now - tick
        slot = tick & _RING_MASK
        if age > _AGE_LAST or self._ring_tick[slot] != tick:
            return  # older than the ring: its reuse is not learned either
        self._ring_flat[slot * _CLASSES + klass] += 1
        self._entered[klass, bisect_right(_AGE_EDGES, age, 0, _BINS - 1)] += 1.0

    # -- EvictionPolicy -------------------------------------------------------

    def on_lookup(self, keys: Sequence[K], hits: int, mine: Sequence[bool] | None = None) -> None:
        self._now += 1
        now = self._now
        n = len(keys)
        # This lookup's row of the ring, counted in place.
        slot = now & (_RING - 1)
        row_start = slot * _CLASSES
        ring = self._ring_flat
        ring[row_start : row_start + _CLASSES] = _ZERO_ROW
        self._ring_tick[slot] = now
        length_bucket = bisect_left(_LENGTH_EDGES, n)  # one per chain
        # A member's share of a chain is a chain of its own: each block it
        # will be put is linked to the member's block before it (the put
        # names the chain's previous block, another member's, which would
        # leave every block a root here), and its last block is not "being
        # put" (the rest of the chain goes to other members, so nothing here
        # would ever end it).
        shares: dict[K, tuple[K | None, bool]] | None = None
        share_last = -1
        if mine is not None and 0 < sum(mine) < n:
            shares = self._shares
            share_last = max(compress(range(n), mine))
        pending = self._pending
        # The row is closed by learn: every lookup writes its row and the
        # ring outlasts the edges, so the rows born at now - edge exist for
        # every edge below now.
        crossing = _EDGES_CROSSED[now] if now < len(_EDGES_CROSSED) else len(_EDGE_TICKS)
        seq, accesses = learn(
            keys, mine, self._nodes, _DensityNode, _NODE_FIELDS, self._ghost.pop, pending,
            shares, self._children, self._leaf_heap, self._inner_heap, heappush, self._rebuilt,
            ring, self._ring_tick, self._reused_flat, _AGE_BIN, _GAP_PART, _COUNT_BUCKET,
            self._retention, self._entered, _EDGE_TICKS, _CONSTS,
            State(now, row_start, length_bucket, now + _RETENTION_MAX, self._seq,
                  self._accesses, HEAP_FACTOR * len(self._nodes) + HEAP_SLACK, share_last,
                  crossing),
        )  # fmt: skip
        self._seq, self._accesses = seq, accesses
        while len(pending) > _PENDING_MAX:
            del pending[next(iter(pending))]
        while shares is not None and len(shares) > _PENDING_MAX:
            del shares[next(iter(shares))]
        self._lookups += 1.0
        if now % _DECAY == 0:
            self._decay()
        if now % _REFRESH == 0:
            self._refresh()

    def _rebuilt(self, seq: int) -> tuple[list[_Entry[K]], list[_Entry[K]]]:
        """The heaps rebuilt in the middle of a lookup's learning (``learn``
        passed their bound at push ``seq``)."""
        self._seq = seq
        self._rebuild()
        return self._leaf_heap, self._inner_heap

    def touch(self, key: K) -> None:
        node = self._nodes.get(key)
        if isinstance(node, _DensityNode) and node.tick >= 0:
            # A hit of a looked-up block: its lookup set its deadline and
            # access order already; another heap entry per hit (the Get
            # after the Lookup) would only be stale (38 % of all pushes on
            # the conversation trace).
            return
        super().touch(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        """``touch`` of each key, its test inlined: a lookup's hits are
        touched before its chain is learned, almost all of them looked up
        before (0.05 against 0.12 ms for 1,000 keys)."""
        nodes, touch = self._nodes, ChainPolicy.touch
        for key in keys:
            node = nodes.get(key)
            if not isinstance(node, _DensityNode) or node.tick < 0:
                touch(self, key)

    def insert(self, key: K, parent: K | None) -> None:
        share = self._shares.pop(key, None)
        if share is None:
            super().insert(key, parent)
            return
        parent, self._share_ends = share
        try:
            super().insert(key, parent)
        finally:
            self._share_ends = False

    def _new_node(self, parent: K | None) -> Node[K]:
        return _DensityNode(parent)

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
        assert isinstance(node, _DensityNode)
        announced = self._pending.pop(key, None)
        handed = self._handed.pop(key, None) if self._handed else None
        if announced is not None:  # a lookup here is newer than one it was handed with
            node.klass, node.gap, node.tick, node.count, node.due = announced
        elif handed is not None:  # out of _filling: no put continues its chain here
            node.klass, node.gap, node.tick, node.count, node.due = handed
            self._join_ring(node.klass, node.tick)
        else:
            node.klass, node.count = _UNANNOUNCED, 1
            node.due = self._now + self._retention[_UNANNOUNCED]
        filling = self._filling
        if node.parent is not None:
            filling.pop(node.parent, None)  # the parent's chain went on
        if announced is not None and node.klass != _LAST and not self._share_ends:
            filling[key] = None
            if len(filling) > _FILLING_MAX:
                filling.popitem(last=False)
        self._accesses = accesses = self._accesses + 1
        return (node.due << 64) | accesses

    def _priority_on_touch(self, node: Node[K]) -> float:
        assert isinstance(node, _DensityNode)
        if node.tick < 0:  # never looked up: due from now (LRU without lookups)
            node.due = self._now + self._retention[node.klass]
        return self._priority(node.due)

    def _on_remove(self, key: K, node: Node[K], evicted: bool) -> None:
        assert isinstance(node, _DensityNode)
        self._filling.pop(key, None)
        if evicted and node.tick >= 0:
            self._ghost[key] = (node.klass, node.gap, node.tick, node.count, node.due)
            while len(self._ghost) > _GHOST_FACTOR * len(self._nodes) + HEAP_SLACK:
                self._ghost.popitem(last=False)

    def victim(self, skip: Callable[[K], int]) -> K | None:
        return self._victim_after_filling(self._filling, skip)

    # -- learning -------------------------------------------------------------

    def _priority(self, due: int) -> int:
        """Heap priority: the deadline in lookups, then the access order (an
        int, so without lookups this is exactly LRU)."""
        self._accesses += 1
        return (due << 64) | self._accesses

    def _decay(self) -> None:
        self._entered *= 0.5
        self._reused *= 0.5  # a view: halves the flat array in place
        self._lookups *= 0.5

    def _refresh(self) -> None:
        """Every _REFRESH lookups: a new plan, unless blocks are kept by
        another member's: then this one's would go unused, and the members
        of a pool, whose clocks move together, all planned at one lookup."""
        if self.plan_adopted:
            self._own_plan_due = True
            return
        plan = self._plan()
        if plan is not None:
            self._retention = plan

    def _plan(self) -> list[int] | None:
        """This policy's own plan (``_own_plan``) from its counts now; None
        when there is nothing to plan from yet."""
        self._own_plan_due = False
        if not self._nodes or self._lookups <= 0.0:
            return None
        hazard = proportional_hazards(self._entered, self._reused, _FEATURES)
        plan, self._survival = choose(
            hazard, self._entered, _WIDTHS, _RETENTIONS, self._lookups, float(len(self._nodes)),
            _LOG_LAMBDA, _BISECT_STEPS, _RESIDENCE_CAP,
        )  # fmt: skip
        self._own_plan = plan
        return plan
