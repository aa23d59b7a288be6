"""Leases from Lookup: the hits of a chain are protected from eviction (L1)
and reclaim (L2) until the lease is released or expires.

A lease is a list of pinned things and an expiry. Expired leases are ended
lazily, whenever the table is consulted (before an eviction, a grant or a
count), through a heap keyed by expiry; released leases leave stale heap
rows that are rebuilt away once they outnumber live leases. The table is
bounded by ``max_leases``: past it a grant is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd.l2 import L2Record, L2Tier
from kvd.store.index import Entry
from kvd.wire.errors import ResourceExhausted

# Stale heap rows tolerated beyond twice the live leases before a rebuild.
_HEAP_SLACK = 1024


@dataclass(eq=False, slots=True)
class Lease:
    pins: list[Any]
    expires_at: float
    namespace: str


class LeaseTable:
    def __init__(
        self,
        max_leases: int,
        clock: Callable[[], float],
        pin: Callable[[list[Any]], None],
        unpin: Callable[[list[Any]], None],
    ) -> None:
        """``pin`` and ``unpin`` take a lease's whole list: one call a lease,
        not one a key (a lease of a 10,000-key chain is one grant)."""
        self.max_leases = max_leases
        self._clock = clock
        self._pin = pin
        self._unpin = unpin
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self.granted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, namespace: str, pins: list[Any], lease_ms: int) -> int:
        self.expire()
        if len(self._leases) >= self.max_leases:
            raise ResourceExhausted(f"max_leases={self.max_leases} leases are active")
        lease_id = next(self._ids)
        expires_at = self._clock() + lease_ms / 1000
        self._pin(pins)
        self._leases[lease_id] = Lease(pins, expires_at, namespace)
        heapq.heappush(self._expiry, (expires_at, lease_id))
        self.granted += 1
        return lease_id

    def extend(self, lease_id: int, pins: list[Any]) -> bool:
        """Pin ``pins`` too, until the lease ends; False, and nothing pinned,
        when it has ended."""
        self.expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._pin(pins)
        lease.pins.extend(pins)
        return True

    def release(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def namespace_of(self, lease_id: int) -> str | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else lease.namespace

    def _end(self, lease: Lease) -> None:
        self._unpin(lease.pins)
        lease.pins = []

    def expire(self) -> None:
        now = self._clock()
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._end(lease)
                self.expired += 1
        if len(heap) > 2 * len(self._leases) + _HEAP_SLACK:
            self._expiry = [(lease.expires_at, lid) for lid, lease in self._leases.items()]
            heapq.heapify(self._expiry)


def pin_leased(l2: L2Tier | None, items: list[Entry | L2Record]) -> None:
    """A lease's pins: an L1 entry is kept from eviction, an L2 record from reclaim."""
    for item in items:
        if isinstance(item, Entry):
            item.leases += 1
        elif l2 is not None:
            l2.pin(item)


def unpin_leased(l2: L2Tier | None, items: list[Entry | L2Record]) -> None:
    """``pin_leased`` undone, when the lease is released or expires."""
    for item in items:
        if isinstance(item, Entry):
            item.leases -= 1
            assert item.leases >= 0
        elif l2 is not None:
            l2.unpin(item)
