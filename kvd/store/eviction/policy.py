"""Eviction policies of the store: which resident block goes next.

The store tells a policy what happens to blocks (``insert`` when a block
becomes resident, ``touch`` on a hit, ``remove`` when it leaves) and asks it
for the next ``victim``. Policies know nothing of bytes, tiers or the server;
keys are opaque hashables (the store uses ``(namespace id, key)`` tuples).

How keys chain and how a victim is picked: ``kvd.store.eviction.chains``.
This module is the table from a policy's configuration name to its
implementation (``POLICIES``, ``make_policy``); the implementations never
import it. Priorities differ per policy:

* ``lru`` (kvd/store/eviction/lru.py, with ``gdf``) -- last access time;
  leaves in LRU order, as RadixAttention does.
* ``gdf`` -- GreedyDual-Frequency: priority ``L + 1 + 0.5 * min(hits, 8)``,
  where ``L`` rises to the priority of each evicted block (deletes do not
  raise it), so a block that was hit survives longer than a new one of the
  same age, and hot blocks that stop being hit still age out. Hit counts of
  evicted blocks are remembered in a bounded ghost table (at most
  ``len(self) + 1024`` entries, oldest dropped first), so a chain that comes
  back after eviction gets its history back. See docs/eviction.md for the
  measurements behind it.
* ``pred`` (kvd/store/eviction/pred.py) -- retention proportional to a
  reuse probability learned per class of lookup.
* ``hazard`` (kvd/store/eviction/hazard.py) -- a deadline per block: the lookup
  clock plus a retention learned per class of conversation turn from how
  long such turns wait for their next turn.
* ``s3fifo`` (kvd/store/eviction/s3fifo.py) -- S3-FIFO's small, main and ghost
  queues, leaves first within each: the scan-resistant baseline.
``on_lookup``'s ``mine`` is for a member of a pool: the chain is the whole
chain an engine looked up, but this member holds only the keys it owns
(``mine[i]`` true); the policy learns from the chain as a whole (its length,
each key's position) and keeps state only for its own keys, so the members
of a pool together learn what one daemon would. A lookup of none of a
member's keys reaches it as ``on_lookup`` of an empty chain: its clock
moves with every lookup of the pool. ``shared_plan`` and ``adopt_plan``
let the members keep blocks by one plan (``density`` has one; the others
share nothing). ``history`` and ``expect`` carry what a policy knows of a
block's references to the member it is handed to after the pool's members
changed (``density``'s class, gap, age, count and deadline; the others
carry nothing).

* ``density`` (the default, kvd/store/eviction/density.py) -- a deadline per
  block: its last reference plus a retention learned per class of block
  reference (gap since the previous reference x references so far x chain
  length) from how long such references wait for the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvd.store.eviction.chains import ChainPolicy, K
from kvd.store.eviction.density import DensityPolicy
from kvd.store.eviction.hazard import HazardPolicy
from kvd.store.eviction.lru import GdfPolicy, LruPolicy
from kvd.store.eviction.pred import PredPolicy
from kvd.store.eviction.s3fifo import S3FifoPolicy

# A policy's configuration name -> its class (the eviction_policy setting's choices).
_IMPLEMENTATIONS: dict[str, type[ChainPolicy[Any]]] = {
    "lru": LruPolicy,
    "gdf": GdfPolicy,
    "pred": PredPolicy,
    "hazard": HazardPolicy,
    "s3fifo": S3FifoPolicy,
    "density": DensityPolicy,
}
POLICIES: tuple[str, ...] = tuple(_IMPLEMENTATIONS)
DEFAULT_POLICY = "density"  # the config row eviction_policy's default (a test checks)


class UnknownPolicyError(ValueError):
    """Raised by make_policy for a name not in POLICIES."""


class EvictionPolicy(Protocol[K]):
    """What the store needs from a policy (see the module docstring)."""

    name: str

    def insert(self, key: K, parent: K | None) -> None: ...

    def touch(self, key: K) -> None: ...

    def touch_many(self, keys: Iterable[K]) -> None:
        """``touch`` of each key, in order."""

    def remove(self, key: K) -> None: ...

    def victim(self, skip: Callable[[K], int]) -> K | None: ...

    def unpark(self, key: K) -> None:
        """A key a victim search parked (``skip`` said ``PARK``) may go again."""

    def unpark_all(self) -> None:
        """Every parked key may go again."""

    def on_lookup(
        self, keys: Sequence[K], hits: int, mine: Sequence[bool] | None = None
    ) -> None: ...

    def shared_plan(self) -> bytes | None: ...

    def adopt_plan(self, plan: bytes) -> bool: ...

    def history(self, key: K) -> bytes | None:
        """A resident key's references, for the member it is handed to."""

    def expect(self, key: K, history: bytes) -> bool:
        """The next insert of ``key`` takes another member's ``history``."""

    def __len__(self) -> int: ...


def make_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by its configuration name (one of POLICIES); keys may be
    any hashable, one kind per policy instance."""
    implementation = _IMPLEMENTATIONS.get(name)
    if implementation is None:
        raise UnknownPolicyError(f"unknown eviction policy {name!r}; expected one of {POLICIES}")
    return implementation()
