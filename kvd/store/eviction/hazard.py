"""The ``hazard`` eviction policy: each block kept for a retention learned per
class of conversation turn, from how long turns of that class wait for their
next turn.

A chain lookup is one turn of a conversation. The policy puts the turn in a
class (continuation depth x new blocks x chain length, as ``pred`` does) and
gives every block of the chain, hit or about to be put, the deadline
``now + R[class]``, or keeps the later deadline it already had (a hit never
shortens what an earlier turn planned). ``now`` counts lookups (a logical
clock: replays run at any speed and give the same victims). Victims are the
earliest deadlines, chain tails first (kvd.store.eviction.chains' contract).
A chain's last block is partial, the next turn re-reads everything but it, so its retention is 0.

What it learns. Each lookup records its turn in a bounded history under the
chain's last full key. A later lookup whose chain contains that key is the
conversation's next turn: its depth is one more, its new blocks are counted
from there (even when the earlier turn was evicted), and the earlier turn's
class learns a reuse at that age (in lookups). Per class and per log-spaced
age bin, the policy counts the block weight that reached the bin and the
weight reused in it: a Kaplan-Meier estimate of the reuse hazard, so turns
that are still waiting count only for the ages they reached. Classes share
the hazard's shape (the pooled estimate) and differ by a factor
(proportional hazards): one factor per feature value, times a factor of the
class's own, each shrunk towards the level above it. The shape needs many
samples at long ages; the factors need few, and a rare class borrows from
classes that share its features.

Every 64 lookups it chooses the retentions. Keeping a turn of class c for R
lookups earns ``H_c(R)`` (the share of it reused within R) and costs
``cost_c(R)`` (expected block-lookups it stays). R_c maximises
``H_c(R) - lambda * cost_c(R)``; lambda is set by bisection so that the
planned occupancy (block weight per lookup x mean cost) fills the blocks
tracked. With a hazard that falls with age this is the best fixed retention
per class (hit density: keep a turn while its reuse rate per slot is above
lambda). docs/eviction.md has the measurements behind each number.

The very same chain looked up again (same length and last key: a retry, or
an engine asking again for a request still waiting) is a reuse of its turn
but not a deeper turn, or polling would make every conversation look deep.

Without ``on_lookup`` calls the clock never moves, every retention stays 0,
and blocks go in access order: exactly ``lru``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvd.store.eviction.chains import ChainPolicy, K, Node

# Turn classes: continuation depth (0..3) x new blocks (1 | 2-3 | 4-10 | more)
# x chain length (<=8 | <=32 | <=64 | more); on the conversation trace their
# reuse rates span 0.1-0.8.
_DEPTH_MAX = 3
_CLASSES = (_DEPTH_MAX + 1) * 4 * 4
_LAST = -1  # a chain's last, partial block: retention 0
assert _CLASSES <= 256  # class ids live in a bytearray
# Age bins in lookups: edges int(1.25^j) below 60 000 (46, the last 56 051).
# Measured at 5 / 10 % capacity: factor 1.4 -> 22.40/29.42, 1.25 ->
# 22.74/29.63, 1.15 -> 22.88/29.65 % (within noise, for 30 % more edges).
_AGE_EDGES: tuple[int, ...] = tuple(sorted({int(1.25**j) for j in range(50) if 1.25**j < 60_000}))
_BINS = len(_AGE_EDGES)
# Turns remembered for their next turn and their ages: one per lookup, so a
# ring of this many lookups holds every turn younger than the last edge.
_RING = 1 << 16
assert _AGE_EDGES[-1] < _RING
# Retentions are recomputed every _REFRESH lookups (a 64 x 46 array solve,
# ~1 ms); counts are halved every _DECAY lookups. Measured at 5 / 10 %
# capacity: decay 1024 -> 22.60/29.63, 2048 -> 22.74/29.63, 4096 ->
# 22.59/29.46 %; refresh 32 -> 22.61/29.57, 128 -> 22.69/29.60 %.
_REFRESH = 64
_DECAY = 2048
# Prior weight (blocks, about one long chain) of each hazard factor: a
# class's own factor is pulled towards its features' product, a feature's
# towards 1 (the pooled hazard). For the class factor, at 5 / 10 % capacity:
# 5 -> 22.81/29.48, 20 -> 22.74/29.63, 80 -> 22.30/29.70 %; the feature
# factors' prior changes hit ratios by < 0.05 point between 5 and 80.
_PRIOR_WEIGHT = 20.0
# Bisection range of log(lambda) and its steps (2^-30 of the range).
_LOG_LAMBDA = (-20.0, 5.0)
_BISECT_STEPS = 30
# Keys announced by lookups and not yet put; oldest dropped past this bound.
_PENDING_MAX = 1 << 16
_ACCESS_MASK = (1 << 64) - 1  # a priority's low bits: the access order
# Chains being put whose latest block is protected until its child arrives
# (as in ``pred``): one per chain in flight.
_FILLING_MAX = 1024

_EDGES = np.array(_AGE_EDGES, dtype=np.float64)
_WIDTHS = np.diff(np.concatenate([[0.0], _EDGES]))
_RETENTIONS = np.concatenate([[0.0], _EDGES])  # choice 0 keeps nothing
# Each class's value of each feature: depth, new-blocks bucket, length bucket.
_CLASS_IDS = np.arange(_CLASSES)
_FEATURES = (_CLASS_IDS // 16, (_CLASS_IDS // 4) % 4, _CLASS_IDS % 4)
# Rounds of fitting the feature factors one after another (1 round: 29.55 %
# at 10 % capacity, 4: 29.63 %).
_FEATURE_ROUNDS = 4


def turn_class(depth: int, new_blocks: int, chain_blocks: int) -> int:
    """Class id of a lookup turn (0 .. 63)."""
    new_bucket = 0 if new_blocks <= 1 else 1 if new_blocks <= 3 else 2 if new_blocks <= 10 else 3
    length_bucket = (
        0 if chain_blocks <= 8 else 1 if chain_blocks <= 32 else 2 if chain_blocks <= 64 else 3
    )
    return (min(depth, _DEPTH_MAX) * 4 + new_bucket) * 4 + length_bucket


class _Turn:
    """A remembered lookup: its class, depth, clock, chain length and last key."""

    __slots__ = ("blocks", "depth", "klass", "last", "tick")

    def __init__(self, klass: int, depth: int, tick: int, blocks: int, last: object) -> None:
        self.klass = klass
        self.depth = depth
        self.tick = tick
        self.blocks = blocks
        self.last = last

    @property
    def weight(self) -> int:
        """Blocks a next turn re-reads: all but the last, partial one."""
        return self.blocks - 1


class _HazardNode(Node[K]):
    __slots__ = ("depth", "klass")

    def __init__(self, parent: K | None) -> None:
        super().__init__(parent, 0)
        self.klass = _LAST
        self.depth = 0


class HazardPolicy(ChainPolicy[K]):
    """Deadline = access + retention of the turn's class (see module doc)."""

    name = "hazard"

    def __init__(self) -> None:
        super().__init__()
        self._now = 0  # lookups seen
        self._accesses = 0  # orders equal deadlines, oldest access first
        self._retention = [0] * _CLASSES
        # key -> (class, depth) for keys announced by a lookup, not yet put.
        self._pending: dict[K, tuple[int, int]] = {}
        self._filling: OrderedDict[K, None] = OrderedDict()
        # Last full key of a turn -> the turn, oldest first.
        self._turns: OrderedDict[K, _Turn] = OrderedDict()
        # Ring of turns by tick, for counting who reaches each age edge.
        self._ring_tick = array("q", [-1]) * _RING
        self._ring_class = bytearray(_RING)
        self._ring_weight = array("q", [0]) * _RING
        self._entered = np.zeros((_CLASSES, _BINS))  # weight that entered bin j
        self._reused = np.zeros((_CLASSES, _BINS))  # weight reused in bin j
        self._weight = np.zeros(_CLASSES)  # weight of turns per class
        self._weight_per_lookup = [0.0, 0.0]  # decayed (weight, lookups)

    # -- what tests and operators may read ------------------------------------

    def retention(self, klass: int) -> int:
        """Current retention of a class, in lookups."""
        return self._retention[klass]

    @property
    def turns_len(self) -> int:
        return len(self._turns)

    @property
    def pending_len(self) -> int:
        return len(self._pending)

    def reuse_share(self, klass: int) -> float:
        """Weight reused / weight of turns seen, for a class (decayed)."""
        weight = float(self._weight[klass])
        return float(self._reused[klass].sum()) / weight if weight else 0.0

    # -- EvictionPolicy -------------------------------------------------------

    def on_lookup(self, keys: Sequence[K], hits: int, mine: Sequence[bool] | None = None) -> None:
        self._now += 1
        now = self._now
        n = len(keys)
        if n == 0:
            return
        depth = 0
        known = hits
        repeat: _Turn | None = None
        for position in range(n - 1, 0, -1):
            earlier = self._turns.pop(keys[position], None)
            if earlier is None:
                continue
            # This chain continues an earlier turn: that turn was reused.
            self._end_turn(earlier, now - earlier.tick)
            if position == n - 2 and earlier.blocks == n and earlier.last == keys[n - 1]:
                # The very same chain again (a retry, or one request looked up
                # twice): a reuse, but no deeper in the conversation. A next
                # turn that still fits the last block changes that block's key.
                repeat = earlier
            else:
                depth = earlier.depth + 1
                known = max(known, position + 1)
            break
        else:
            if hits >= 2:  # beyond a shared head, resident but not remembered
                tail = self._nodes.get(keys[hits - 1])
                depth = tail.depth + 1 if isinstance(tail, _HazardNode) else 1
        if repeat is not None:
            depth, klass = repeat.depth, repeat.klass
        else:
            klass = turn_class(depth, n - known, n)
        for position, key in enumerate(keys[:hits]):
            node = self._nodes.get(key) if mine is None or mine[position] else None
            if isinstance(node, _HazardNode):
                node.klass = klass
                node.depth = depth
                node.priority = self._extended(node)
                self._push(key, node)
        for position in range(hits, n):
            if mine is None or mine[position]:
                self._pending[keys[position]] = (_LAST if position == n - 1 else klass, depth)
        while len(self._pending) > _PENDING_MAX:
            del self._pending[next(iter(self._pending))]
        if n >= 2:
            self._start_turn(keys, klass, depth)
        self._count_ages()
        if now % _DECAY == 0:
            self._decay()
        if now % _REFRESH == 0:
            self._refresh()

    def _new_node(self, parent: K | None) -> Node[K]:
        return _HazardNode(parent)

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
        assert isinstance(node, _HazardNode)
        announced = self._pending.pop(key, None)
        klass, depth = announced or (turn_class(0, 2, 2), 0)
        node.klass = klass
        node.depth = depth
        if node.parent is not None:
            self._filling.pop(node.parent, None)  # the parent's chain went on
        if announced is not None and klass != _LAST:
            self._filling[key] = None
            while len(self._filling) > _FILLING_MAX:
                self._filling.popitem(last=False)
        return self._deadline(klass)

    def _priority_on_touch(self, node: Node[K]) -> float:
        assert isinstance(node, _HazardNode)
        return self._extended(node)

    def _on_remove(self, key: K, node: Node[K], evicted: bool) -> None:
        self._filling.pop(key, None)

    def victim(self, skip: Callable[[K], int]) -> K | None:
        return self._victim_after_filling(self._filling, skip)

    # -- learning -------------------------------------------------------------

    def _deadline(self, klass: int) -> int:
        """Heap priority: the deadline in lookups, then the access order (an
        int, so a block that becomes a leaf again keeps its place; without
        lookups this is exactly LRU)."""
        self._accesses += 1
        retention = 0 if klass == _LAST else self._retention[klass]
        return ((self._now + retention) << 64) | self._accesses

    def _extended(self, node: _HazardNode[K]) -> int:
        """A hit block's new priority: its class's deadline from now, but
        never earlier than the deadline it already had (an earlier turn that
        promised to keep it longer still counts); the access order is new."""
        fresh = self._deadline(node.klass)
        kept = int(node.priority) >> 64
        if kept <= fresh >> 64:
            return fresh
        return (kept << 64) | (fresh & _ACCESS_MASK)

    def _start_turn(self, keys: Sequence[K], klass: int, depth: int) -> None:
        now = self._now
        key = keys[-2]  # the last full block: the next turn re-reads it
        stale = self._turns.pop(key, None)
        if stale is not None:
            self._end_turn(stale, None)
        turn = _Turn(klass, depth, now, len(keys), keys[-1])
        self._turns[key] = turn
        weight = turn.weight
        slot = now & (_RING - 1)
        self._ring_tick[slot] = now
        self._ring_class[slot] = klass
        self._ring_weight[slot] = weight
        self._weight[klass] += weight
        self._entered[klass, 0] += weight
        self._weight_per_lookup[0] += weight
        # Turns older than the last edge can teach nothing more.
        turns = self._turns
        while turns:
            oldest_key = next(iter(turns))
            oldest = turns[oldest_key]
            if now - oldest.tick < _AGE_EDGES[-1] and len(turns) <= _RING:
                break
            del turns[oldest_key]
            self._end_turn(oldest, None)

    def _end_turn(self, turn: _Turn, age: int | None) -> None:
        """The turn was continued at ``age`` lookups, or is forgotten (None)."""
        slot = turn.tick & (_RING - 1)
        if self._ring_tick[slot] != turn.tick:
            return  # already out of the ring
        self._ring_tick[slot] = -1  # leaves the set at risk
        if age is not None and age <= _AGE_EDGES[-1]:
            self._reused[turn.klass, bisect_left(_AGE_EDGES, age)] += turn.weight

    def _count_ages(self) -> None:
        """Turns still waiting that reach an age edge now enter the next bin."""
        now = self._now
        ring_tick, ring_class, ring_weight = self._ring_tick, self._ring_class, self._ring_weight
        entered = self._entered
        for j in range(_BINS - 1):
            born = now - _AGE_EDGES[j]
            if born <= 0:
                break
            slot = born & (_RING - 1)
            if ring_tick[slot] == born:
                entered[ring_class[slot], j + 1] += ring_weight[slot]
        self._weight_per_lookup[1] += 1.0

    def _decay(self) -> None:
        self._entered *= 0.5
        self._reused *= 0.5
        self._weight *= 0.5
        self._weight_per_lookup = [v * 0.5 for v in self._weight_per_lookup]

    def _refresh(self) -> None:
        total = float(self._weight.sum())
        if total <= 0.0 or not self._nodes:
            return
        hazard = _class_hazards(self._entered, self._reused)
        survival = np.cumprod(1.0 - hazard, axis=1)
        before = np.concatenate([np.ones((_CLASSES, 1)), survival[:, :-1]], axis=1)
        zeros = np.zeros((_CLASSES, 1))
        gain = np.concatenate([zeros, 1.0 - survival], axis=1)
        cost = np.concatenate([zeros, np.cumsum(before * _WIDTHS, axis=1)], axis=1)
        weight, lookups = self._weight_per_lookup
        per_lookup = weight / lookups if lookups else 0.0
        # Occupancy planned per unit of cost: weight per lookup x class share.
        scale = per_lookup * self._weight / total
        rows = np.arange(_CLASSES)
        target = float(len(self._nodes))
        low, high = _LOG_LAMBDA
        for _ in range(_BISECT_STEPS):
            middle = (low + high) / 2.0
            choice = np.argmax(gain - np.exp(middle) * cost, axis=1)
            if float((scale * cost[rows, choice]).sum()) > target:
                low = middle
            else:
                high = middle
        choice = np.argmax(gain - np.exp(high) * cost, axis=1)
        self._retention = [int(r) for r in _RETENTIONS[choice]]


def _class_hazards(
    entered: npt.NDArray[np.float64], reused: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Reuse hazard per class and age bin: the pooled hazard times a class
    factor. The factor is the product of one factor per feature (depth, new
    blocks, length; fitted to observed / expected reuses, a few rounds), times
    the class's own observed / expected reuses under that product. Each ratio
    has _PRIOR_WEIGHT on both sides, so a class with little data follows its
    features, and a feature with little data the pooled hazard."""
    pooled_entered = entered.sum(axis=0)
    pooled = np.divide(
        reused.sum(axis=0),
        pooled_entered,
        out=np.zeros(_BINS),
        where=pooled_entered > 0.0,
    )
    expected = (entered * pooled).sum(axis=1)
    observed = reused.sum(axis=1)
    factor = np.ones(_CLASSES)
    for _ in range(_FEATURE_ROUNDS):
        for feature in _FEATURES:
            for value in range(int(feature.max()) + 1):
                members = feature == value
                ratio = (float(observed[members].sum()) + _PRIOR_WEIGHT) / (
                    float((expected[members] * factor[members]).sum()) + _PRIOR_WEIGHT
                )
                factor[members] *= ratio
    featured = factor * expected
    factor *= (observed + _PRIOR_WEIGHT) / (featured + _PRIOR_WEIGHT)
    hazard: npt.NDArray[np.float64] = np.clip(factor[:, None] * pooled[None, :], 0.0, 1.0)
    return hazard
