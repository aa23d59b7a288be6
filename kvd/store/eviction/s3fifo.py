"""The ``s3fifo`` eviction policy: S3-FIFO (Yang et al., SOSP '23) over the
chain tree, the scan-resistant baseline the default policy is compared with.

Three queues: a small FIFO that new blocks enter (10 % of the tracked
blocks), a main FIFO, and a ghost of keys evicted from the small queue
(as many keys as the main queue holds). A hit raises a block's frequency
(at most 3). When the small queue is over its share, its oldest block goes:
to the main queue if it was hit while there, else out (its key into the
ghost). Otherwise the main queue's oldest block goes, unless it was hit
since it last came round: then its frequency drops by one and it goes to
the back. A block whose key is in the ghost enters the main queue at once.

Prefix awareness as in kvd.store.eviction.chains: within each queue leaves go before
interior blocks, so a chain is eaten tail first. FIFO order is a sequence
number given on entering (or going round) a queue.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from kvd.store.eviction.chains import ChainPolicy, K, Node

# Small queue share of the tracked blocks: S3-FIFO's 10 %.
_SMALL_SHARE = 0.1
# Frequency saturates at 3, as in S3-FIFO (two bits).
_FREQ_CAP = 3
# Moves inside one victim() call are bounded by the blocks tracked; this
# bounds one call's loop further (each round moves or evicts one block).
_ROUNDS_MAX = 1 << 20


class _FifoNode(Node[K]):
    __slots__ = ("main",)

    def __init__(self, parent: K | None) -> None:
        super().__init__(parent, 0)
        self.main = False


class S3FifoPolicy(ChainPolicy[K]):
    """S3-FIFO, leaves first within each queue (see the module docstring)."""

    name = "s3fifo"

    def __init__(self) -> None:
        super().__init__()
        self._order = 0
        self._small = 0  # blocks in the small queue
        self._ghost: OrderedDict[K, None] = OrderedDict()
        # (leaf heap, interior heap) per queue; the base class's pair is unused.
        self._small_heaps: tuple[list[tuple[float, int, K]], list[tuple[float, int, K]]] = ([], [])
        self._main_heaps: tuple[list[tuple[float, int, K]], list[tuple[float, int, K]]] = ([], [])

    @property
    def small_len(self) -> int:
        return self._small

    @property
    def ghost_len(self) -> int:
        return len(self._ghost)

    def _new_node(self, parent: K | None) -> Node[K]:
        return _FifoNode(parent)

    def _tick(self) -> float:
        self._order += 1
        return float(self._order)

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
        assert isinstance(node, _FifoNode)
        if key in self._ghost:
            del self._ghost[key]
            node.main = True
        else:
            self._small += 1
        return self._tick()

    def _priority_on_touch(self, node: Node[K]) -> float:
        node.hits = min(node.hits, _FREQ_CAP)
        return node.priority  # a hit does not move a block in its FIFO

    def touch(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is not None:
            node.hits = min(node.hits + 1, _FREQ_CAP)

    def _on_remove(self, key: K, node: Node[K], evicted: bool) -> None:
        assert isinstance(node, _FifoNode)
        if not node.main:
            self._small -= 1
            if evicted:
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._nodes) - self._small, 1):
                    self._ghost.popitem(last=False)

    def _became_inner(self, key: K, node: Node[K]) -> None:
        self._push(key, node)  # its own queues have no lazy move

    def _push(self, key: K, node: Node[K]) -> None:
        assert isinstance(node, _FifoNode)
        self._seq += 1
        node.seq = self._seq
        heaps = self._main_heaps if node.main else self._small_heaps
        heap = heaps[0] if self._is_leaf(key) else heaps[1]
        heapq.heappush(heap, (node.priority, self._seq, key))
        live = 2 * len(self._nodes) + 1024
        if sum(len(h) for h in (*self._small_heaps, *self._main_heaps)) > live:
            self._rebuild_queues()

    def _rebuild_queues(self) -> None:
        heaps: tuple[list[tuple[float, int, K]], ...] = ([], [], [], [])
        for key, node in self._nodes.items():
            assert isinstance(node, _FifoNode)
            index = 2 * node.main + (not self._is_leaf(key))
            heaps[index].append((node.priority, node.seq, key))
        for heap in heaps:
            heapq.heapify(heap)
        self._small_heaps = (heaps[0], heaps[1])
        self._main_heaps = (heaps[2], heaps[3])
        self._parked.clear()  # their keys are in the new heaps

    def _oldest(
        self, heaps: tuple[list[tuple[float, int, K]], list[tuple[float, int, K]]],
        skip: Callable[[K], int],
    ) -> K | None:  # fmt: skip
        for heap in heaps:
            key = self._first_unskipped(heap, skip)
            if key is not None:
                return key
        return None

    def victim(self, skip: Callable[[K], int]) -> K | None:
        for _ in range(_ROUNDS_MAX):
            from_small = self._small > _SMALL_SHARE * len(self._nodes)
            key = self._oldest(self._small_heaps if from_small else self._main_heaps, skip)
            if key is None:
                key = self._oldest(self._main_heaps if from_small else self._small_heaps, skip)
            if key is None:
                return None
            node = self._nodes[key]
            assert isinstance(node, _FifoNode)
            if node.hits > 0:
                if node.main:
                    node.hits -= 1  # goes round once more
                else:
                    node.main = True  # hit in the small queue: promoted
                    node.hits = 0
                    self._small -= 1
                node.priority = self._tick()
                self._push(key, node)
                continue
            self._offered = key
            return key
        raise AssertionError("s3fifo victim() did not converge")
