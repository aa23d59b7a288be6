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

Cost: ``insert``/``touch``/``remove`` are O(log n) (one heap push) and
``victim`` is O(log n) amortised plus O(p log n) for p pinned keys it steps
over. Stale heap entries are dropped lazily and the heaps are rebuilt when
they hold more than twice the live entries plus 1024, so memory stays
O(tracked blocks).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)

POLICIES: tuple[str, ...] = ("lru", "gdf")

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
        node = _Node(parent, 0)
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

    def victim(self, skip: Callable[[K], bool]) -> K | None:
        for heap in (self._leaf_heap, self._inner_heap):
            key = self._first_unskipped(heap, skip)
            if key is not None:
                self._offered = key
                return key
        return None

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


def make_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by its configuration name (one of POLICIES); keys may be
    any hashable, one kind per policy instance."""
    if name == "lru":
        return LruPolicy()
    if name == "gdf":
        return GdfPolicy()
    raise UnknownPolicyError(f"unknown eviction policy {name!r}; expected one of {POLICIES}")
