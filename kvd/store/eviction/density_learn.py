"""What the ``density`` policy learns from one chain lookup, key by key
(``DensityPolicy.on_lookup`` calls ``learn`` once per lookup).

For each key of the chain (of this member's share, ``mine``): the wait of
its previous reference ends (out of its ring row, a reuse counted in its
age bin), the reference gets its class, the class is counted in this
lookup's ring row, and the key's deadline is set: now + the class's
retention, a chain's last block never past the block before it (victims
are leaves first, and it is worth nothing without it). A tracked block's
node takes the new fields, and a fresh heap entry where its deadline moved
earlier; a later one leaves the entry for the victim search to push again
(``ChainPolicy``'s lazy raise: most lookups move deadlines later, and a
push a key was most of the learning's cost). A block not yet put is
remembered in ``pending`` (and, in a pool, its share's parent in
``shares``). Then the lookup's ring row is closed: its references enter the
first age bin, and the rows that reach an age edge now enter the next.

Two implementations of one contract: ``learn_python`` below, and
``kvd.io._uring.density_learn`` (native/kvd_density.c), which reads and
writes the nodes' slots and the flat arrays directly: ~1 µs a key in
Python, the policy's largest cost per lookup. ``learn`` is the native one
where it is built (``LEARNING``, in the daemon's start-up line); a test
runs both on the same lookups and compares every field, heap entry and
counter.

Arguments, in order (the native function takes the same):

* ``keys``, ``mine`` (None, or which keys are this member's);
* ``nodes`` (key -> node), ``node_type`` (the policy's node class; other
  values count as untracked), ``fields`` (its slot descriptors: class, gap,
  tick, count, due, priority, seq);
* ``ghost_pop`` (the ghost's ``pop``), ``pending``, ``shares`` (or None),
  ``children``, the leaf and inner heaps, ``heappush``, ``rebuild`` (called
  with the push counter when the heaps outgrow their bound; returns the
  rebuilt heaps);
* the flat arrays ``ring`` (int32), ``ring_tick`` (int64), ``reused``
  (float64), the tables ``age_bin``, ``gap_part``, ``count_bucket`` (int32),
  ``retention`` per class;
* ``entered`` (float64, a row per class and a column per age bin: the
  references that reached each bin) and ``edge_ticks`` (the age edges,
  int64), for closing the lookup's ring row;
* ``consts`` (``Consts``) and ``state`` (``State``).

Returns the push counter and the access counter after the lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress
from typing import Any, NamedTuple

import numpy as np

from kvd.io.backend import native_density_learn


class Consts(NamedTuple):
    classes: int
    bins: int
    ring_mask: int
    age_last: int
    count_max: int
    count_bucket_len: int
    count_top: int
    gap_part_last: int
    gap_top: int
    length_buckets: int
    last_class: int
    heap_check: int


class State(NamedTuple):
    now: int
    row_start: int  # this lookup's row in the ring (its first index)
    length_bucket: int
    bound: int  # the deadline a chain's first block may not pass
    seq: int
    accesses: int
    heap_bound: int
    share_last: int  # position of this member's last key of the chain; -1: none
    crossing: int  # age edges the rows born that many lookups ago reach now


def learn_python(
    keys: Sequence[Any], mine: Sequence[bool] | None,
    nodes: dict[Any, Any], node_type: type[Any], fields: tuple[Any, ...],
    ghost_pop: Callable[[Any, None], Any], pending: dict[Any, Any],
    shares: dict[Any, Any] | None, children: dict[Any, int],
    leaf_heap: list[Any], inner_heap: list[Any],
    heappush: Callable[[list[Any], Any], None],
    rebuild: Callable[[int], tuple[list[Any], list[Any]]],
    ring: Any, ring_tick: Any, reused: Any, age_bin: Any, gap_part: Any, count_bucket: Any,
    retention: Sequence[int], entered: Any, edge_ticks: Any, consts: Consts, state: State,
) -> tuple[int, int]:  # fmt: skip
    """``learn``, in Python (the module docstring has the contract)."""
    (classes, bins, ring_mask, age_last, count_max, count_bucket_len, count_top,
     gap_part_last, gap_top, length_buckets, last_class, heap_check) = consts  # fmt: skip
    now, row_start, length_bucket, bound, seq, accesses, heap_bound, share_last, crossing = state
    # compress skips the others' keys in C: half the cost of a test per
    # position, for a member owning a quarter of the chain.
    owned = enumerate(keys) if mine is None else compress(enumerate(keys), mine)
    last = len(keys) - 1
    share_parent = None
    for position, key in owned:
        node = nodes.get(key)
        if isinstance(node, node_type):
            before, gap, tick, count = node.klass, node.gap, node.tick, node.count
        else:
            remembered = ghost_pop(key, None) or pending.get(key)
            if remembered is None:
                before, gap, tick, count = 0, 0, -1, 0
            else:
                before, gap, tick, count = remembered[:4]
        # The wait of the reference (before, tick) ends now: out of its ring
        # row, a reuse in its age bin; gap is the wait (0 when never looked
        # up, the previous gap for a second reference this lookup).
        if tick < 0:
            gap = 0
        elif tick != now:
            gap = now - tick
            slot = tick & ring_mask
            if ring_tick[slot] == tick and gap <= age_last:
                ring[slot * classes + before] -= 1
                reused[before * bins + age_bin[gap]] += 1.0
        count = count + 1 if count < count_max else count_max
        if position == last:
            klass = last_class
        else:
            bucket = count_bucket[count] if count < count_bucket_len else count_top
            part = gap_part[gap] if gap <= gap_part_last else gap_top
            klass = (part + bucket) * length_buckets + length_bucket
        ring[row_start + klass] += 1
        due = now + retention[klass]
        if klass == last_class and due > bound:
            due = bound
        bound = due
        if isinstance(node, node_type):
            # Access numbers only grow: the priority is later unless the due is earlier.
            later = due >= node.due
            node.klass, node.gap, node.tick, node.count = klass, gap, now, count
            node.due = due
            accesses += 1
            node.priority = priority = (due << 64) | accesses
            if not later:  # later: the entry stays (ChainPolicy's lazy raise)
                seq += 1
                node.seq = seq
                heappush(inner_heap if key in children else leaf_heap, (priority, seq, key))
                if not seq % heap_check and len(leaf_heap) + len(inner_heap) > heap_bound:
                    leaf_heap, inner_heap = rebuild(seq)
        else:
            pending[key] = (klass, gap, now, count, due)
            if shares is not None:
                shares[key] = (share_parent, position == share_last)
        share_parent = key
    # The row is closed: its references entered the first age bin, and the
    # rows born an age edge ago enter the next bin with the references still
    # waiting in them.
    rows = np.frombuffer(ring, dtype=np.int32).reshape(-1, classes)
    entered[:, 0] += rows[row_start // classes]
    if crossing:
        slots = (now - edge_ticks[:crossing]) & ring_mask
        entered[:, 1 : crossing + 1] += rows[slots].T
    return seq, accesses


Learn = Callable[..., tuple[int, int]]
_native = native_density_learn()
learn: Learn = _native if _native is not None else learn_python
# Which one: the daemon's start-up line says it ("eviction_learning").
LEARNING = "native" if _native is not None else "python (kvd.io._uring is not built)"
