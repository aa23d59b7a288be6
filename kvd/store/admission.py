"""Which puts reach L2: the ``l2_admission`` setting.

``all`` (the default) writes every put behind it. ``twice`` writes a value
only once a second request has referenced it, as Dynamo KVBM does for its
disk tier: a block used once and never again costs no SSD write. A
reference is a lookup that finds the value in L1, a get of it, or a put of
its key again. A put of a key put here lately (``Sightings``: held back
then, and evicted since) is the second reference at once.

Durable puts are written whatever the rule (a durable put of a key held
back writes it then: ``Store.make_durable``); a pool member's copies of
values other members own are written by neither rule. A value held back is
evicted like a value already on L2, and is then gone: L1 held its only copy
(counted as ``l2_never_written``). docs/eviction-workloads.md ("Two tiers") has what
the rule saves and costs on each workload, in the simulator and through
the daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvd.config.settings import L2_ADMISSIONS
from kvd.store.index import Entry, StoreCounters

# Keys a ``twice`` store remembers having put (two generations of half as
# many): at most ~70 MiB of hashes (68 MiB measured full), and more than
# the 182,790 distinct blocks of the conversation trace, so its replay
# forgets none.
SIGHTINGS_MAX = 1 << 20


class Sightings:
    """Keys put lately, at most ``capacity``: two generations of their
    hashes, the older dropped whole when the newer is full, so a key is
    remembered for at least ``capacity // 2`` puts of other keys."""

    __slots__ = ("_half", "_new", "_old")

    def __init__(self, capacity: int = SIGHTINGS_MAX) -> None:
        self._half = max(1, capacity // 2)
        self._new: set[int] = set()
        self._old: set[int] = set()

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def seen(self, ns_id: int, key: bytes) -> bool:
        """Whether the key was put lately; it is remembered from now either way."""
        mark = hash((ns_id, key))
        if mark in self._new or mark in self._old:
            return True
        if len(self._new) >= self._half:
            self._old, self._new = self._new, set()
        self._new.add(mark)
        return False


class Admission:
    """The rule for one store with an L2; ``enqueue`` queues a value for write-back."""

    def __init__(
        self,
        rule: str,
        enqueue: Callable[[Entry], None],
        counters: StoreCounters,
        capacity: int = SIGHTINGS_MAX,
    ) -> None:
        if rule not in L2_ADMISSIONS:
            raise ValueError(f"l2_admission {rule!r}: one of {', '.join(L2_ADMISSIONS)}")
        self._enqueue = enqueue
        self._counters = counters
        self._sightings = Sightings(capacity) if rule == "twice" else None

    @property
    def holds_back(self) -> bool:
        return self._sightings is not None

    def at_put(self, entry: Entry) -> None:
        """A put just linked into L1: queue it for L2, or hold it back
        until a second reference."""
        sightings = self._sightings
        if sightings is not None and not sightings.seen(entry.ns.id, entry.key):
            entry.held_back = True
            self._counters.l2_held_back += 1
            return
        entry.dirty = True
        self._enqueue(entry)

    def admit_now(self, entry: Entry | None) -> None:
        """A durable put of a stored value: one held back is its writer's to
        append now (dirty, not queued)."""
        if entry is not None and entry.held_back:
            self._admit(entry)

    def referenced(self, entries: Sequence[Entry]) -> None:
        """Values a request referenced (hits, a put again): the ones held
        back go to write-back now."""
        for entry in entries:
            if entry.held_back and entry.linked:
                self._admit(entry)
                self._enqueue(entry)

    def _admit(self, entry: Entry) -> None:
        """A held-back value is one to write now."""
        entry.held_back = False
        entry.dirty = True
        self._counters.l2_admitted += 1
