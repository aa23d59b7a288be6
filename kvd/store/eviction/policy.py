"""Eviction policies of the store: which resident block goes next.

The store tells a policy what happens to blocks (``insert`` when a block
becomes resident, ``touch`` on a hit, ``remove`` when it leaves) and asks it
for the next ``victim``. Policies know nothing of bytes, tiers or the server;
keys are opaque hashables (the store uses ``(namespace id, key)`` tuples).

Prefix awareness. Keys come in chains: a block is useful only while every
ancestor of its chain is resident, because a lookup stops at the first miss.
Every policy here therefore keeps a *chain tree*: ``insert(key, parent)``
links a block to its parent, and a block is a **leaf** when no tracked block
names it as parent. ``victim`` returns

1. the lowest-priority leaf ``k`` with ``skip(k)`` false, else
2. the lowest-priority non-leaf ``k`` with ``skip(k)`` false (only when every
   leaf is pinned: evicting an interior block then strands its descendants,
   but refusing would stall the store while unpinned space exists), else
3. ``None``.

So a chain is eaten tail first, and a block never goes while a descendant of
it is evictable. Links are kept by key, so a child inserted before its parent
(or whose parent was evicted and came back) is adopted when the parent is
inserted. Priorities differ per policy:

* ``lru`` -- last access time; leaves in LRU order, as RadixAttention does.
* ``gdf`` -- GreedyDual-Frequency: priority ``L + 1 + 0.5 * min(hits, 8)``,
  where ``L`` rises to the priority of each evicted block (deletes do not
  raise it), so a block that was hit survives longer than a new one of the
  same age, and hot blocks that stop being hit still age out. Hit counts of
  evicted blocks are remembered in a bounded ghost table (at most
  ``len(self) + 1024`` entries, oldest dropped first), so a chain that comes
  back after eviction gets its history back. See docs/eviction.md for the
  measurements behind it.
* ``pred`` -- retention proportional to a reuse probability learned per
  class of lookup (below).
* ``hazard`` (kvd/store/eviction/hazard.py) -- a deadline per block: the lookup
  clock plus a retention learned per class of conversation turn from how
  long such turns wait for their next turn.
* ``s3fifo`` (kvd/store/eviction/s3fifo.py) -- S3-FIFO's small, main and ghost
  queues, leaves first within each: the scan-resistant baseline.
* ``density`` (the default, kvd/store/eviction/density.py) -- a deadline per
  block: its last reference plus a retention learned per class of block
  reference (gap since the previous reference x references so far x chain
  length) from how long such references wait for the next one.

Cost: ``insert``/``touch``/``remove`` are O(log n) (one heap push) and
``victim`` is O(log n) amortised plus O(p log n) for p pinned keys it steps
over. Stale heap entries are dropped lazily and the heaps are rebuilt when
they hold more than twice the live entries plus 1024, so memory stays
O(tracked blocks).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)

POLICIES: tuple[str, ...] = ("lru", "gdf", "pred", "hazard", "s3fifo", "density")
DEFAULT_POLICY = "density"  # the config row eviction_policy's default (a test checks)

# Heaps are rebuilt when they hold more than 2x live entries + this slack:
# rebuilds then cost O(n) at most once per n stale pushes (amortised O(1)).
_HEAP_SLACK = 1024
# Priority bonus per remembered hit, in units of one eviction's worth of
# ageing. Measured on the conversation trace (block hits at 5 / 10 / 20 %
# capacity): 0.25 -> 20.6/28.9/34.3, 0.5 -> 20.9/28.7/34.1,
# 1 -> 20.6/28.4/33.6, 2 -> 20.2/27.9/32.9 %.
_HIT_WEIGHT = 0.5
# Hit counts saturate here: beyond ~8 hits a block is "hot" and further hits
# only need to refresh it, not to pin it for ever (measured: caps 4..16 give
# the same hit ratio within 0.1 point on the conversation trace).
_FREQ_MAX = 8


class UnknownPolicyError(ValueError):
    """Raised by make_policy for a name not in POLICIES."""


class EvictionPolicy(Protocol[K]):
    """What the store needs from a policy (see the module docstring)."""

    name: str

    def insert(self, key: K, parent: K | None) -> None: ...

    def touch(self, key: K) -> None: ...

    def remove(self, key: K) -> None: ...

    def victim(self, skip: Callable[[K], bool]) -> K | None: ...

    def on_lookup(self, keys: Sequence[K], hits: int) -> None: ...

    def __len__(self) -> int: ...


class _Node(Generic[K]):
    """One tracked block: its parent key, hit count and current heap entry."""

    __slots__ = ("hits", "parent", "priority", "seq")

    def __init__(self, parent: K | None, hits: int) -> None:
        self.parent = parent
        self.hits = hits
        self.priority = 0.0
        self.seq = 0


class _ChainPolicy(Generic[K]):
    """Leaves-first victim selection over a priority; subclasses set priority.

    Two min-heaps of ``(priority, seq, key)``: one for leaves, one for
    interior blocks. ``seq`` increases with every push, so it breaks ties
    oldest first and keys are never compared. An entry is live only if the
    key is tracked and its node still carries that ``seq``; every priority or
    leaf/interior change pushes a fresh entry and leaves the old one stale.
    """

    name = "chain"

    def __init__(self) -> None:
        self._nodes: dict[K, _Node[K]] = {}
        self._offered: K | None = None  # last key victim() returned
        # Tracked children per parent key, whether or not the parent itself is
        # tracked (that is what lets a re-inserted parent adopt its children).
        self._children: dict[K, int] = {}
        self._leaf_heap: list[tuple[float, int, K]] = []
        self._inner_heap: list[tuple[float, int, K]] = []
        self._seq = 0

    # -- subclass hooks -------------------------------------------------------

    def _new_node(self, parent: K | None) -> _Node[K]:
        return _Node(parent, 0)

    def _priority_on_insert(self, key: K, node: _Node[K]) -> float:
        raise NotImplementedError

    def _priority_on_touch(self, node: _Node[K]) -> float:
        raise NotImplementedError

    def _on_remove(self, key: K, node: _Node[K], evicted: bool) -> None:
        """Called from remove() with the node that leaves; evicted: it was
        the key victim() offered last (not a delete)."""

    # -- EvictionPolicy -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def insert(self, key: K, parent: K | None) -> None:
        node = self._nodes.get(key)
        if node is not None:
            # Already resident (a repeated put): count it as an access.
            self.touch(key)
            return
        node = self._new_node(parent)
        self._nodes[key] = node
        if parent is not None and parent != key:
            count = self._children.get(parent, 0)
            self._children[parent] = count + 1
            parent_node = self._nodes.get(parent)
            if count == 0 and parent_node is not None:
                self._push(parent, parent_node)  # parent stops being a leaf
        node.priority = self._priority_on_insert(key, node)
        self._push(key, node)

    def touch(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        node.hits = min(node.hits + 1, _FREQ_MAX)
        node.priority = self._priority_on_touch(node)
        self._push(key, node)

    def remove(self, key: K) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        evicted = key == self._offered
        if evicted:
            self._offered = None
        self._on_remove(key, node, evicted)
        parent = node.parent
        if parent is not None and parent != key:
            count = self._children[parent] - 1
            if count:
                self._children[parent] = count
            else:
                del self._children[parent]
                parent_node = self._nodes.get(parent)
                if parent_node is not None:
                    self._push(parent, parent_node)  # parent became a leaf
        if not self._nodes:
            self._leaf_heap.clear()
            self._inner_heap.clear()

    def on_lookup(self, keys: Sequence[K], hits: int) -> None:
        """A lookup of the chain ``keys`` found its first ``hits`` resident
        (already touched); the rest are about to be put. Only ``pred`` uses it."""

    def victim(self, skip: Callable[[K], bool]) -> K | None:
        for heap in (self._leaf_heap, self._inner_heap):
            key = self._first_unskipped(heap, skip)
            if key is not None:
                self._offered = key
                return key
        return None

    def _victim_after_filling(self, filling: Container[K], skip: Callable[[K], bool]) -> K | None:
        """``victim``, but a leaf whose chain is still being put (in
        ``filling``) goes only after every other leaf, and before any
        interior block (that would strand it anyway)."""
        if not filling:
            return _ChainPolicy.victim(self, skip)
        key = self._first_unskipped(self._leaf_heap, lambda k: k in filling or skip(k))
        if key is None:
            return _ChainPolicy.victim(self, skip)
        self._offered = key
        return key

    # -- internals ------------------------------------------------------------

    def _is_leaf(self, key: K) -> bool:
        return key not in self._children

    def _push(self, key: K, node: _Node[K]) -> None:
        self._seq += 1
        node.seq = self._seq
        heap = self._leaf_heap if self._is_leaf(key) else self._inner_heap
        heapq.heappush(heap, (node.priority, self._seq, key))
        if len(self._leaf_heap) + len(self._inner_heap) > 2 * len(self._nodes) + _HEAP_SLACK:
            self._rebuild()

    def _rebuild(self) -> None:
        leaves: list[tuple[float, int, K]] = []
        inner: list[tuple[float, int, K]] = []
        for key, node in self._nodes.items():
            (leaves if self._is_leaf(key) else inner).append((node.priority, node.seq, key))
        heapq.heapify(leaves)
        heapq.heapify(inner)
        self._leaf_heap = leaves
        self._inner_heap = inner

    def _first_unskipped(
        self, heap: list[tuple[float, int, K]], skip: Callable[[K], bool]
    ) -> K | None:
        stepped_over: list[tuple[float, int, K]] = []
        found: K | None = None
        while heap:
            entry = heap[0]
            node = self._nodes.get(entry[2])
            if node is None or node.seq != entry[1]:
                heapq.heappop(heap)  # stale
                continue
            if skip(entry[2]):
                stepped_over.append(heapq.heappop(heap))
                continue
            found = entry[2]
            break
        for entry in stepped_over:
            heapq.heappush(heap, entry)
        return found


class LruPolicy(_ChainPolicy[K]):
    """Prefix-aware LRU: the least recently used leaf goes first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0

    def _tick(self) -> float:
        self._clock += 1
        return float(self._clock)

    def _priority_on_insert(self, key: K, node: _Node[K]) -> float:
        return self._tick()

    def _priority_on_touch(self, node: _Node[K]) -> float:
        return self._tick()


class GdfPolicy(_ChainPolicy[K]):
    """GreedyDual-Frequency over the chain tree, with a bounded ghost table."""

    name = "gdf"

    def __init__(self) -> None:
        super().__init__()
        self._inflation = 0.0  # GreedyDual's L: priority of the last eviction
        # Ghost: hit counts of blocks that left, oldest first, at most
        # len(self) + _HEAP_SLACK entries (one cache's worth of history).
        self._ghost: OrderedDict[K, int] = OrderedDict()

    @property
    def ghost_len(self) -> int:
        return len(self._ghost)

    def _priority_on_insert(self, key: K, node: _Node[K]) -> float:
        node.hits = self._ghost.pop(key, 0)
        return self._inflation + 1.0 + _HIT_WEIGHT * node.hits

    def _priority_on_touch(self, node: _Node[K]) -> float:
        return self._inflation + 1.0 + _HIT_WEIGHT * node.hits

    def _on_remove(self, key: K, node: _Node[K], evicted: bool) -> None:
        if evicted:
            self._inflation = max(self._inflation, node.priority)
        if evicted and node.hits:
            self._ghost[key] = node.hits
            self._ghost.move_to_end(key)
            while len(self._ghost) > len(self._nodes) + _HEAP_SLACK:
                self._ghost.popitem(last=False)


# -- pred: reuse predicted from the lookup that preceded the put -------------

# Classes of a lookup: continuation depth (0..3) x new blocks (1 | 2-3 | 4-10 |
# more) x chain length (<=8 | <=32 | <=64 | more), plus one class for the last
# key of a chain. On the conversation trace the learned reuse rates of these
# classes span 0.17-0.73, and the last key's is 0.011 (a chain's last block is
# partial: the next turn re-reads everything but it).
_DEPTH_MAX = 3
_CLASSES = (_DEPTH_MAX + 1) * 4 * 4
_LAST = _CLASSES  # class id of a chain's last key
# A shared head (this many tracked children or more) is kept like a block
# whose reuse is certain: its fate is every conversation's under it.
_SHARED_CHILDREN = 2
# Retention horizon per unit of predicted reuse probability, in tracked
# blocks: priority = inserts so far + _HORIZON * len(policy) * p. Measured on
# the conversation trace (block hits at 5 / 10 % capacity): 2 -> 20.9/28.7,
# 4 -> 21.4/29.1, 6 -> 21.3/28.9, 8 -> 20.9/28.6 %; p, sqrt(p) and log(p) as
# the retention's shape: p was best.
_HORIZON = 4.0
# Prior of every class: 3 reuses in 10 trials (the trace's overall reuse rate
# is ~0.3); learned counts are halved every _DECAY_INSERTS inserts so rates
# follow a changing workload (64k inserts: a few cache turnovers at 1 GiB of
# 2 MiB blocks).
_PRIOR_TRIALS = 10.0
_PRIOR_REUSES = 3.0
_DECAY_INSERTS = 1 << 16
# Keys announced by lookups and not yet put; oldest dropped past this bound.
_PENDING_MAX = 1 << 16
# Chains being put whose latest block is protected until its child arrives;
# one per chain in flight, so this bounds concurrent chained puts tracked.
_FILLING_MAX = 1024


class _PredNode(_Node[K]):
    __slots__ = ("depth", "klass", "open")

    def __init__(self, parent: K | None) -> None:
        super().__init__(parent, 0)
        self.klass = 0
        self.depth = 0
        self.open = False  # a reuse of this block would still be credited


def _lookup_class(depth: int, new_blocks: int, chain_blocks: int) -> int:
    new_bucket = 0 if new_blocks <= 1 else 1 if new_blocks <= 3 else 2 if new_blocks <= 10 else 3
    length_bucket = (
        0 if chain_blocks <= 8 else 1 if chain_blocks <= 32 else 2 if chain_blocks <= 64 else 3
    )
    return (min(depth, _DEPTH_MAX) * 4 + new_bucket) * 4 + length_bucket


class PredPolicy(_ChainPolicy[K]):
    """Retention proportional to a reuse probability learned per lookup class."""

    name = "pred"

    def __init__(self) -> None:
        super().__init__()
        self._inserts = 0
        self._trials = [_PRIOR_TRIALS] * (_CLASSES + 1)
        self._reuses = [_PRIOR_REUSES] * (_CLASSES + 1)
        # key -> (class, depth, last key of its chain), from on_lookup.
        self._pending: dict[K, tuple[int, int, bool]] = {}
        self._filling: OrderedDict[K, None] = OrderedDict()
        # Classes of evicted blocks whose trial was open, oldest first, at most
        # 2 * len(self) + _HEAP_SLACK: a chain that comes back credits its class.
        self._ghost: OrderedDict[K, int] = OrderedDict()

    def reuse_rate(self, klass: int) -> float:
        return self._reuses[klass] / self._trials[klass]

    @property
    def ghost_len(self) -> int:
        return len(self._ghost)

    def _new_node(self, parent: K | None) -> _Node[K]:
        return _PredNode(parent)

    def _priority(self, p: float) -> float:
        return self._inserts + _HORIZON * len(self._nodes) * p

    def _open_trial(self, node: _PredNode[K], klass: int) -> None:
        node.klass = klass
        node.open = True
        self._trials[klass] += 1.0

    def _credit(self, node: _PredNode[K]) -> None:
        if node.open:
            node.open = False
            self._reuses[node.klass] += 1.0

    def on_lookup(self, keys: Sequence[K], hits: int) -> None:
        depth = 0
        if hits:
            tail = self._nodes.get(keys[hits - 1])
            depth = tail.depth + 1 if isinstance(tail, _PredNode) else 1
        klass = _lookup_class(depth, len(keys) - hits, len(keys))
        for key in keys[:hits]:
            node = self._nodes.get(key)
            if not isinstance(node, _PredNode):
                continue
            if self._children.get(key, 0) >= _SHARED_CHILDREN:
                node.priority = self._priority(1.0)
            else:
                # A hit block shares the fate of the request that hit it: the
                # next turn of this conversation re-reads all of it.
                self._credit(node)
                self._open_trial(node, klass)
                node.priority = self._priority(self.reuse_rate(klass))
            self._push(key, node)
        last = len(keys) - 1
        for position in range(hits, len(keys)):
            self._pending[keys[position]] = (klass, depth, position == last)
        while len(self._pending) > _PENDING_MAX:
            del self._pending[next(iter(self._pending))]

    def _priority_on_insert(self, key: K, node: _Node[K]) -> float:
        assert isinstance(node, _PredNode)
        self._inserts += 1
        if self._inserts % _DECAY_INSERTS == 0:
            self._trials = [t / 2 for t in self._trials]
            self._reuses = [r / 2 for r in self._reuses]
        ghost_class = self._ghost.pop(key, None)
        if ghost_class is not None:
            self._reuses[ghost_class] += 1.0
        announced = self._pending.pop(key, None)
        klass, depth, last = announced or (_lookup_class(0, 2, 2), 0, False)
        node.depth = depth
        self._open_trial(node, _LAST if last else klass)
        if node.parent is not None:
            self._filling.pop(node.parent, None)  # the parent's chain went on
        if announced is not None and not last:
            self._filling[key] = None
            while len(self._filling) > _FILLING_MAX:
                self._filling.popitem(last=False)
        return self._priority(self.reuse_rate(node.klass))

    def _priority_on_touch(self, node: _Node[K]) -> float:
        assert isinstance(node, _PredNode)
        return self._priority(self.reuse_rate(node.klass))

    def _on_remove(self, key: K, node: _Node[K], evicted: bool) -> None:
        assert isinstance(node, _PredNode)
        self._filling.pop(key, None)
        if evicted and node.open:
            self._ghost[key] = node.klass
            self._ghost.move_to_end(key)
            while len(self._ghost) > 2 * len(self._nodes) + _HEAP_SLACK:
                self._ghost.popitem(last=False)

    def victim(self, skip: Callable[[K], bool]) -> K | None:
        return self._victim_after_filling(self._filling, skip)


def make_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by its configuration name (one of POLICIES); keys may be
    any hashable, one kind per policy instance."""
    if name == "lru":
        return LruPolicy()
    if name == "gdf":
        return GdfPolicy()
    if name == "pred":
        return PredPolicy()
    if name == "hazard":
        from kvd.store.eviction.hazard import HazardPolicy  # it builds on _ChainPolicy

        return HazardPolicy()
    if name == "s3fifo":
        from kvd.store.eviction.s3fifo import S3FifoPolicy

        return S3FifoPolicy()
    if name == "density":
        from kvd.store.eviction.density import DensityPolicy

        return DensityPolicy()
    raise UnknownPolicyError(f"unknown eviction policy {name!r}; expected one of {POLICIES}")
