"""Two priorities over the chain tree (``kvd.store.eviction.chains``):
``lru``, the least recently used leaf first (as RadixAttention does), and
``gdf``, GreedyDual-Frequency with a bounded ghost table of hit counts
(docs/eviction.md)."""

from __future__ import annotations

from collections import OrderedDict

from kvd.store.eviction.chains import HEAP_SLACK, ChainPolicy, K, Node

# Priority bonus per remembered hit, in units of one eviction's worth of
# ageing. Measured on the conversation trace (block hits at 5 / 10 / 20 %
# capacity): 0.25 -> 20.6/28.9/34.3, 0.5 -> 20.9/28.7/34.1,
# 1 -> 20.6/28.4/33.6, 2 -> 20.2/27.9/32.9 %.
_HIT_WEIGHT = 0.5


class LruPolicy(ChainPolicy[K]):
    """Prefix-aware LRU: the least recently used leaf goes first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0

    def _tick(self) -> float:
        self._clock += 1
        return float(self._clock)

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
        return self._tick()

    def _priority_on_touch(self, node: Node[K]) -> float:
        return self._tick()


class GdfPolicy(ChainPolicy[K]):
    """GreedyDual-Frequency over the chain tree, with a bounded ghost table."""

    name = "gdf"

    def __init__(self) -> None:
        super().__init__()
        self._inflation = 0.0  # GreedyDual's L: priority of the last eviction
        # Ghost: hit counts of blocks that left, oldest first, at most
        # len(self) + HEAP_SLACK entries (one cache's worth of history).
        self._ghost: OrderedDict[K, int] = OrderedDict()

    @property
    def ghost_len(self) -> int:
        return len(self._ghost)

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
        node.hits = self._ghost.pop(key, 0)
        return self._inflation + 1.0 + _HIT_WEIGHT * node.hits

    def _priority_on_touch(self, node: Node[K]) -> float:
        return self._inflation + 1.0 + _HIT_WEIGHT * node.hits

    def _on_remove(self, key: K, node: Node[K], evicted: bool) -> None:
        if evicted:
            self._inflation = max(self._inflation, node.priority)
        if evicted and node.hits:
            self._ghost[key] = node.hits
            self._ghost.move_to_end(key)
            while len(self._ghost) > len(self._nodes) + HEAP_SLACK:
                self._ghost.popitem(last=False)
