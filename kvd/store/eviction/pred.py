"""``pred``: retention proportional to a reuse probability learned per class
of the lookup that preceded a put, over the chain tree
(``kvd.store.eviction.chains``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvd.store.eviction.chains import HEAP_SLACK, ChainPolicy, K, Node

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


class _PredNode(Node[K]):
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


class PredPolicy(ChainPolicy[K]):
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
        # 2 * len(self) + HEAP_SLACK: a chain that comes back credits its class.
        self._ghost: OrderedDict[K, int] = OrderedDict()

    def reuse_rate(self, klass: int) -> float:
        return self._reuses[klass] / self._trials[klass]

    @property
    def ghost_len(self) -> int:
        return len(self._ghost)

    def _new_node(self, parent: K | None) -> Node[K]:
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

    def on_lookup(self, keys: Sequence[K], hits: int, mine: Sequence[bool] | None = None) -> None:
        depth = 0
        if hits:
            tail = self._nodes.get(keys[hits - 1])
            depth = tail.depth + 1 if isinstance(tail, _PredNode) else 1
        klass = _lookup_class(depth, len(keys) - hits, len(keys))
        for position, key in enumerate(keys[:hits]):
            node = self._nodes.get(key) if mine is None or mine[position] else None
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
            if mine is None or mine[position]:
                self._pending[keys[position]] = (klass, depth, position == last)
        while len(self._pending) > _PENDING_MAX:
            del self._pending[next(iter(self._pending))]

    def _priority_on_insert(self, key: K, node: Node[K]) -> float:
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

    def _priority_on_touch(self, node: Node[K]) -> float:
        assert isinstance(node, _PredNode)
        return self._priority(self.reuse_rate(node.klass))

    def _on_remove(self, key: K, node: Node[K], evicted: bool) -> None:
        assert isinstance(node, _PredNode)
        self._filling.pop(key, None)
        if evicted and node.open:
            self._ghost[key] = node.klass
            self._ghost.move_to_end(key)
            while len(self._ghost) > 2 * len(self._nodes) + HEAP_SLACK:
                self._ghost.popitem(last=False)

    def victim(self, skip: Callable[[K], int]) -> K | None:
        return self._victim_after_filling(self._filling, skip)
