"""The chain tree every eviction policy here builds on (``ChainPolicy``):
leaves-first victim selection over a priority that each policy sets.

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
inserted.

Cost: ``insert``/``touch``/``remove`` are O(log n) (one heap push) and
``victim`` is O(log n) amortised plus O(p log n) for p pinned keys it steps
over. Stale heap entries are dropped lazily and the heaps are rebuilt when
they hold more than four times the live entries plus 1024, so memory stays
O(tracked blocks).

Policies subclass ``ChainPolicy`` (``kvd.store.eviction.lru``, ``pred``,
``hazard``, ``s3fifo``, ``density``); the table that picks one by name is
``kvd.store.eviction.policy``, above them all.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# Heaps are rebuilt when they hold more than HEAP_FACTOR x the live entries
# + HEAP_SLACK: a rebuild then costs O(n) at most once per (HEAP_FACTOR - 1)
# x n stale pushes (amortised O(1)). At factor 2 rebuilds were 4 % of
# ``density``'s profiled time on the conversation trace at 5 % (12 % before
# they were list comprehensions); 4 makes them a third as frequent, for at
# most 4 entries per block (a 3-tuple each, ~80 B).
HEAP_FACTOR = 4
HEAP_SLACK = 1024
# The bound is checked every HEAP_CHECK pushes (three len() calls a push
# were ~3 % of a policy's CPU), so it can be passed by that many entries.
HEAP_CHECK = 64


def heap_entries_max(live: int) -> int:
    """The most heap entries a policy holds with ``live`` blocks tracked."""
    return HEAP_FACTOR * live + HEAP_SLACK + HEAP_CHECK


# A victim search's ``skip`` verdict besides True/False: the key cannot go
# now and is held out of the search (``ChainPolicy._parked``) until the
# caller ``unpark``s it; a dirty value waiting for write-back is one. A
# pinned key merely skipped is stepped over on every search, and a backlog
# of thousands of them made every eviction (every put into a full L1) walk
# them all.
PARK = 2

# Hit counts saturate here: beyond ~8 hits a block is "hot" and further hits
# only need to refresh it, not to pin it for ever (measured: caps 4..16 give
# the same hit ratio within 0.1 point on the conversation trace).
_FREQ_MAX = 8


class Node(Generic[K]):
    """One tracked block: its parent key, hit count and current heap entry."""

    __slots__ = ("hits", "parent", "priority", "seq")

    def __init__(self, parent: K | None, hits: int) -> None:
        self.parent = parent
        self.hits = hits
        self.priority = 0.0
        self.seq = 0


class ChainPolicy(Generic[K]):
    """Leaves-first victim selection over a priority; subclasses set priority.

    Two min-heaps of ``(priority, seq, key)``: one for leaves, one for
    interior blocks. ``seq`` increases with every push, so it breaks ties
    oldest first and keys are never compared. An entry is live only if the
    key is tracked and its node still carries that ``seq``; every priority or
    leaf/interior change pushes a fresh entry and leaves the old one stale.

    With ``lazy_raise`` a subclass may also raise a node's priority without
    a push: its live entry then holds a lower priority than the node, and
    the victim search pushes it again, at the node's priority, when it
    reaches it. The victims are the same where priorities never tie
    (``density``'s end in an access number of their own).
    """

    name = "chain"
    lazy_raise = False

    def __init__(self) -> None:
        self._nodes: dict[K, Node[K]] = {}
        self._offered: K | None = None  # last key victim() returned
        # Tracked children per parent key, whether or not the parent itself is
        # tracked (that is what lets a re-inserted parent adopt its children).
        self._children: dict[K, int] = {}
        self._leaf_heap: list[tuple[float, int, K]] = []
        self._inner_heap: list[tuple[float, int, K]] = []
        self._seq = 0
        # Heap entries a search was told to PARK, by key, with the heap they
        # came from: back in it on ``unpark`` (stale by then if the key was
        # pushed again meanwhile; searches drop stale entries).
        self._parked: dict[K, tuple[list[tuple[float, int, K]], tuple[float, int, K]]] = {}

    # -- subclass hooks -------------------------------------------------------

    def _new_node(self, parent: K | None) -> Node[K]:
        return Node(parent, 0)

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
        raise NotImplementedError

    def _priority_on_touch(self, node: Node[K]) -> float:
        raise NotImplementedError

    def _on_remove(self, key: K, node: Node[K], evicted: bool) -> None:
        """Called from remove() with the node that leaves; evicted: it was
        the key victim() offered last (not a delete)."""

    def _became_inner(self, key: K, node: Node[K]) -> None:
        """A leaf got its first child. Its heap entry stays in the leaf heap
        and moves to the inner heap when a victim search meets it
        (``_first_leaf``): that saves a push on every put of a chain (30 %
        of all pushes: 705,009 -> 492,421 for ``density`` on the
        conversation trace at 5 %). A subclass with heaps of its own pushes
        here."""

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
            if count == 0:
                parent_node = self._nodes.get(parent)
                if parent_node is not None:
                    self._became_inner(parent, parent_node)
        node.priority = self._priority_on_insert(key, node)
        self._push(key, node)

    def touch(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        node.hits = min(node.hits + 1, _FREQ_MAX)
        node.priority = self._priority_on_touch(node)
        self._push(key, node)

    def touch_many(self, keys: Iterable[K]) -> None:
        touch = self.touch
        for key in keys:
            touch(key)

    def remove(self, key: K) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        self._parked.pop(key, None)
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

    def unpark(self, key: K) -> None:
        """A key a search parked may go again (its value was written to L2)."""
        parked = self._parked.pop(key, None)
        if parked is not None:
            heapq.heappush(*parked)

    def unpark_all(self) -> None:
        """Every parked key may go again (L2 is failing: dirty values may be dropped)."""
        for heap, entry in self._parked.values():
            heapq.heappush(heap, entry)
        self._parked.clear()

    def on_lookup(self, keys: Sequence[K], hits: int, mine: Sequence[bool] | None = None) -> None:
        """A lookup of the chain ``keys`` found its first ``hits`` resident
        (already touched); the rest are about to be put. With ``mine``, only
        the keys where it is true are this policy's (a pool member's share).
        The lookup-driven policies override it."""

    def shared_plan(self) -> bytes | None:
        """What this policy learned, for the other members of a pool to
        keep blocks by (``adopt_plan``); None: nothing to share. The
        lookup-driven policies override it."""
        return None

    def adopt_plan(self, plan: bytes) -> bool:
        """Keep blocks by another member's ``shared_plan``; False where this
        policy cannot (it has no plan, or the bytes are no plan of its)."""
        return False

    def history(self, key: K) -> bytes | None:
        """What this policy knows of a resident key's references, for the
        member of a pool the block is handed to (``expect`` there); None:
        nothing worth carrying. The lookup-driven policies override it."""
        return None

    def expect(self, key: K, history: bytes) -> bool:
        """The next ``insert`` of ``key`` is a block another member handed
        on, with its ``history`` there; False, and nothing changes, where
        this policy keeps no history or the bytes are none of its."""
        return False

    def victim(self, skip: Callable[[K], int]) -> K | None:
        key = self._first_leaf(skip)
        if key is None:
            # Every leaf is skipped, and _first_leaf moved every interior
            # entry it met to the inner heap.
            key = self._first_unskipped(self._inner_heap, skip)
        if key is not None:
            self._offered = key
        return key

    def _victim_after_filling(self, filling: Container[K], skip: Callable[[K], int]) -> K | None:
        """``victim``, but a leaf whose chain is still being put (in
        ``filling``) goes only after every other leaf, and before any
        interior block (that would strand it anyway)."""
        if not filling:
            return ChainPolicy.victim(self, skip)
        key = self._first_leaf(lambda k: k in filling or skip(k))
        if key is None:
            return ChainPolicy.victim(self, skip)
        self._offered = key
        return key

    # -- internals ------------------------------------------------------------

    def _is_leaf(self, key: K) -> bool:
        return key not in self._children

    def _push(self, key: K, node: Node[K]) -> None:
        self._seq = seq = self._seq + 1
        node.seq = seq
        heap = self._inner_heap if key in self._children else self._leaf_heap
        heapq.heappush(heap, (node.priority, seq, key))
        if not seq % HEAP_CHECK and (
            len(self._leaf_heap) + len(self._inner_heap)
            > HEAP_FACTOR * len(self._nodes) + HEAP_SLACK
        ):
            self._rebuild()

    def _rebuild(self) -> None:
        nodes, children = self._nodes, self._children
        leaves = [(n.priority, n.seq, k) for k, n in nodes.items() if k not in children]
        inner = [(n.priority, n.seq, k) for k, n in nodes.items() if k in children]
        heapq.heapify(leaves)
        heapq.heapify(inner)
        self._leaf_heap = leaves
        self._inner_heap = inner
        self._parked.clear()  # their keys are in the new heaps

    def _first_leaf(self, skip: Callable[[K], int]) -> K | None:
        """``_first_unskipped`` over the leaf heap; a live entry of a block
        that is no longer a leaf (``_became_inner``) moves to the inner heap."""
        return self._first_unskipped(self._leaf_heap, skip, leaves=True)

    def _first_unskipped(
        self, heap: list[tuple[float, int, K]], skip: Callable[[K], int], leaves: bool = False
    ) -> K | None:
        nodes, children = self._nodes, self._children
        stepped_over: list[tuple[float, int, K]] = []
        found: K | None = None
        while heap:
            entry = heap[0]
            key = entry[2]
            node = nodes.get(key)
            if node is None or node.seq != entry[1]:
                heapq.heappop(heap)  # stale
            elif self.lazy_raise and entry[0] != node.priority:  # raised since pushed
                heapq.heapreplace(heap, (node.priority, entry[1], key))
            elif leaves and key in children:
                heapq.heappush(self._inner_heap, heapq.heappop(heap))
            elif verdict := skip(key):
                if verdict == PARK:
                    self._parked[key] = (heap, heapq.heappop(heap))
                else:
                    stepped_over.append(heapq.heappop(heap))
            else:
                found = key
                break
        for entry in stepped_over:
            heapq.heappush(heap, entry)
        return found
