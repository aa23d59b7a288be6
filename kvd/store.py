"""The store: namespaces, the index, leases and L1 placement.

Every state change happens on the event loop thread that owns the store, so
nothing here locks. Bytes never pass through this module: a put gets a
``PutTicket`` whose ``views`` are pool pages to fill, a get gets a ``Reader``
whose ``views`` are pool pages to send. Both pin their pages: a ticket's
pages are invisible until ``finish_put`` publishes them (a writer that dies
half-way leaves nothing behind), and a reader's entry cannot be evicted or
freed until the reader closes (a delete while reading unlinks the key at once
and frees the pages after the last reader).

Keys are write-once: a second put of a key with the same checksum is a no-op,
with a different one it is ``AlreadyExists``. Two puts of one key may run at
once; the first to finish publishes, the second compares checksums.

Eviction asks the policy (``kvd.eviction``) for a victim, skipping entries
that are being read or are under a lease from ``lookup``.

This module imports neither grpc nor metrics.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import AlreadyExists, DataLoss, InvalidArgument, ResourceExhausted
from kvd.eviction import EvictionPolicy, make_policy
from kvd.pool import PAGE_BYTES, Pool, PoolFull, Run, pages_for

KEY_BYTES_MAX = 64
META_BYTES_MAX = 4096
NAMESPACE_BYTES_MAX = 256
# Bounds the index's per-namespace structures; a namespace is one model
# layout of one tenant, so thousands is already a large fleet.
NAMESPACES_MAX = 65536

PolicyKey = tuple[int, bytes]


@dataclass(frozen=True)
class StoreLimits:
    max_value_bytes: int = 256 << 20
    max_lookup_keys: int = 4096
    lease_ms_max: int = 60_000
    max_leases: int = 65536


@dataclass(eq=False, slots=True)
class Entry:
    """One stored value."""

    ns: Namespace
    key: bytes
    size: int
    checksum: int
    meta: bytes
    runs: list[Run]
    parent: bytes | None
    readers: int = 0
    leases: int = 0
    linked: bool = True  # False once deleted/evicted from the index


@dataclass(eq=False, slots=True)
class Namespace:
    id: int
    name: str
    entries: dict[bytes, Entry] = field(default_factory=dict)
    bytes_stored: int = 0
    hits: int = 0
    misses: int = 0


@dataclass(eq=False, slots=True)
class PutTicket:
    """Pages reserved for a put in progress; invisible until published."""

    ns_name: str
    key: bytes
    size: int
    meta: bytes
    parent: bytes | None
    checksum: int | None
    runs: list[Run]
    views: list[memoryview]
    done: bool = False


@dataclass(eq=False, slots=True)
class Reader:
    """A pinned entry being read; ``close()`` unpins it (idempotent)."""

    store: Store
    entry: Entry
    views: list[memoryview]
    closed: bool = False

    @property
    def size(self) -> int:
        return self.entry.size

    @property
    def checksum(self) -> int:
        return self.entry.checksum

    @property
    def meta(self) -> bytes:
        return self.entry.meta

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.store._unpin(self.entry)


@dataclass(frozen=True, slots=True)
class PutResult:
    existed: bool
    checksum: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_len: int
    l1_hits: int
    l2_hits: int
    lease_id: int
    lease_ms: int


@dataclass(eq=False, slots=True)
class _Lease:
    entries: list[Entry]
    expires_at: float
    active: bool = True


@dataclass
class StoreCounters:
    """Plain integers the metrics collector reads at scrape time."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_existed: int = 0
    put_conflicts: int = 0
    evictions: int = 0
    eviction_failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    leases_granted: int = 0
    leases_expired: int = 0


def check_namespace(name: str) -> None:
    if not name:
        raise InvalidArgument("namespace is empty")
    if len(name.encode()) > NAMESPACE_BYTES_MAX:
        raise InvalidArgument(f"namespace longer than {NAMESPACE_BYTES_MAX} bytes")
    if not name.isprintable():
        raise InvalidArgument("namespace has non-printable characters")


def check_key(key: bytes) -> None:
    if not key:
        raise InvalidArgument("key is empty")
    if len(key) > KEY_BYTES_MAX:
        raise InvalidArgument(f"key of {len(key)} bytes is longer than {KEY_BYTES_MAX}")


class Store:
    def __init__(
        self,
        pool: Pool,
        limits: StoreLimits | None = None,
        policy: EvictionPolicy[Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.limits = limits or StoreLimits()
        self.policy: EvictionPolicy[Any] = policy or make_policy("lru")
        self.counters = StoreCounters()
        self._clock = clock
        self._namespaces: dict[str, Namespace] = {}
        self._ns_by_id: dict[int, Namespace] = {}
        self._ns_ids = itertools.count(1)
        self._leases: dict[int, _Lease] = {}
        self._lease_expiry: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self.entry_count = 0

    # ---- namespaces ------------------------------------------------------------
    def _namespace(self, name: str, create: bool) -> Namespace | None:
        ns = self._namespaces.get(name)
        if ns is None and create:
            check_namespace(name)
            if len(self._namespaces) >= NAMESPACES_MAX:
                raise ResourceExhausted(f"more than {NAMESPACES_MAX} namespaces")
            ns = Namespace(next(self._ns_ids), name)
            self._namespaces[name] = ns
            self._ns_by_id[ns.id] = ns
        return ns

    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    # ---- put -------------------------------------------------------------------
    async def begin_put(
        self,
        ns_name: str,
        key: bytes,
        size: int,
        meta: bytes = b"",
        parent: bytes | None = None,
        checksum: int | None = None,
    ) -> PutTicket | PutResult:
        """Reserve pages for a value, or answer at once when the key is stored.

        Returns a ``PutResult(existed=True)`` when the key already holds a value
        with the given checksum; raises ``AlreadyExists`` when it holds another.
        """
        check_namespace(ns_name)
        check_key(key)
        if parent is not None and len(parent) > KEY_BYTES_MAX:
            raise InvalidArgument(f"parent key longer than {KEY_BYTES_MAX} bytes")
        if len(meta) > META_BYTES_MAX:
            raise InvalidArgument(f"meta of {len(meta)} bytes is over {META_BYTES_MAX}")
        if size < 0 or size > self.limits.max_value_bytes:
            raise InvalidArgument(
                f"value of {size} bytes is over max_value_bytes={self.limits.max_value_bytes}"
            )
        if pages_for(size) > self.pool.page_count:
            raise InvalidArgument(
                f"value of {size} bytes is larger than the pool ({self.pool.capacity_bytes} bytes)"
            )
        ns = self._namespaces.get(ns_name)
        if ns is not None and checksum is not None:
            existing = ns.entries.get(key)
            if existing is not None:
                return self._same_or_conflict(existing, checksum)
        runs = await self._alloc(size)
        return PutTicket(
            ns_name, key, size, meta, parent or None, checksum, runs, self.pool.views(runs, size)
        )

    def _same_or_conflict(self, existing: Entry, checksum: int) -> PutResult:
        if existing.checksum != checksum:
            self.counters.put_conflicts += 1
            raise AlreadyExists("key is stored with different content (keys are write-once)")
        self.counters.put_existed += 1
        return PutResult(existed=True, checksum=checksum)

    def finish_put(self, ticket: PutTicket, checksum: int) -> PutResult:
        """Publish a filled ticket; ``checksum`` is what the bytes received hash to."""
        assert not ticket.done, "ticket finished twice"
        ticket.done = True
        if ticket.checksum is not None and ticket.checksum != checksum:
            self.pool.free(ticket.runs)
            raise DataLoss(
                f"value hashes to {checksum:#018x}, the put said {ticket.checksum:#018x}"
            )
        ns = self._namespace(ticket.ns_name, create=True)
        assert ns is not None
        existing = ns.entries.get(ticket.key)
        if existing is not None:
            self.pool.free(ticket.runs)
            return self._same_or_conflict(existing, checksum)
        entry = Entry(
            ns, ticket.key, ticket.size, checksum, ticket.meta, ticket.runs, ticket.parent
        )
        ns.entries[ticket.key] = entry
        ns.bytes_stored += entry.size
        self.entry_count += 1
        self.counters.puts += 1
        self.counters.bytes_in += entry.size
        parent_pk = (ns.id, ticket.parent) if ticket.parent else None
        self.policy.insert((ns.id, ticket.key), parent_pk)
        return PutResult(existed=False, checksum=checksum)

    async def publish(self, ticket: PutTicket, checksum: int, durable: bool = False) -> PutResult:
        """Publish a filled ticket; with ``durable``, return once the value is on L2.

        Every transport (gRPC, shared memory, bulk TCP) ends its puts here.
        """
        return self.finish_put(ticket, checksum)

    def abort_put(self, ticket: PutTicket) -> None:
        """Give a ticket's pages back (idempotent; safe after finish_put)."""
        if not ticket.done:
            ticket.done = True
            self.pool.free(ticket.runs)

    async def put(
        self,
        ns_name: str,
        key: bytes,
        value: bytes | memoryview,
        meta: bytes = b"",
        parent: bytes | None = None,
        checksum: int | None = None,
        *,
        hasher: Callable[[bytes | memoryview], int],
        durable: bool = False,
    ) -> PutResult:
        """Whole-value put (batches, tests): reserve, copy, publish."""
        value = memoryview(value).cast("B")
        ticket = await self.begin_put(ns_name, key, len(value), meta, parent, checksum)
        if isinstance(ticket, PutResult):
            return ticket
        try:
            offset = 0
            for view in ticket.views:
                view[:] = value[offset : offset + len(view)]
                offset += len(view)
        except BaseException:
            self.abort_put(ticket)
            raise
        return await self.publish(ticket, hasher(value), durable)

    async def _alloc(self, size: int) -> list[Run]:
        self._expire_leases()
        need = pages_for(size)
        while self.pool.free_pages < need:
            if not self._evict_one():
                self.counters.eviction_failures += 1
                raise ResourceExhausted(
                    f"pool full: {need} pages needed, {self.pool.free_pages} free, "
                    "the rest pinned by readers or leases"
                )
        try:
            return self.pool.alloc(size)
        except PoolFull as exc:  # cannot happen after the loop above
            raise AssertionError(str(exc)) from exc

    # ---- eviction --------------------------------------------------------------
    def _pinned(self, pk: PolicyKey) -> bool:
        entry = self._entry_by_pk(pk)
        return entry is None or entry.readers > 0 or entry.leases > 0

    def _entry_by_pk(self, pk: PolicyKey) -> Entry | None:
        ns = self._ns_by_id.get(pk[0])
        return None if ns is None else ns.entries.get(pk[1])

    def _evict_one(self) -> bool:
        pk = self.policy.victim(self._pinned)
        if pk is None:
            return False
        entry = self._entry_by_pk(pk)
        assert entry is not None and entry.readers == 0 and entry.leases == 0, pk
        self._unlink(entry)
        self.counters.evictions += 1
        return True

    def _unlink(self, entry: Entry) -> None:
        """Remove from the index; free the pages unless a reader still holds them."""
        ns = entry.ns
        del ns.entries[entry.key]
        ns.bytes_stored -= entry.size
        self.entry_count -= 1
        entry.linked = False
        self.policy.remove((ns.id, entry.key))
        if entry.readers == 0:
            self.pool.free(entry.runs)
            entry.runs = []

    # ---- get -------------------------------------------------------------------
    def open(self, ns_name: str, key: bytes) -> Reader | None:
        """Pin a stored value for reading, or None on a miss."""
        check_key(key)
        ns = self._namespaces.get(ns_name)
        entry = None if ns is None else ns.entries.get(key)
        if entry is None:
            self.counters.misses += 1
            if ns is not None:
                ns.misses += 1
            return None
        assert ns is not None
        ns.hits += 1
        self.counters.hits += 1
        self.counters.bytes_out += entry.size
        entry.readers += 1
        self.policy.touch((ns.id, key))
        return Reader(self, entry, self.pool.views(entry.runs, entry.size))

    async def fetch(self, ns_name: str, key: bytes) -> Reader | None:
        """Pin a value wherever it is stored (L1, or L2 read back into L1); None on a miss.

        Every transport's get starts here.
        """
        return self.open(ns_name, key)

    def _unpin(self, entry: Entry) -> None:
        entry.readers -= 1
        assert entry.readers >= 0, "reader closed twice"
        if entry.readers == 0 and not entry.linked and entry.runs:
            self.pool.free(entry.runs)
            entry.runs = []

    # ---- index queries ---------------------------------------------------------
    def exists(self, ns_name: str, keys: Sequence[bytes]) -> list[bool]:
        self._check_keys(keys)
        ns = self._namespaces.get(ns_name)
        if ns is None:
            return [False] * len(keys)
        return [key in ns.entries for key in keys]

    def lookup(self, ns_name: str, keys: Sequence[bytes], lease_ms: int = 0) -> LookupResult:
        """Longest stored prefix of a chain; with ``lease_ms`` its entries are pinned."""
        if not keys:
            raise InvalidArgument("lookup of no keys")
        self._check_keys(keys)
        if lease_ms < 0 or lease_ms > self.limits.lease_ms_max:
            raise InvalidArgument(
                f"lease_ms={lease_ms} is over lease_ms_max={self.limits.lease_ms_max}"
            )
        ns = self._namespaces.get(ns_name)
        hits: list[Entry] = []
        if ns is not None:
            for key in keys:
                entry = ns.entries.get(key)
                if entry is None:
                    break
                hits.append(entry)
        for entry in hits:
            self.policy.touch((entry.ns.id, entry.key))
        lease_id = 0
        if lease_ms and hits:
            lease_id = self._grant_lease(hits, lease_ms)
        return LookupResult(len(hits), len(hits), 0, lease_id, lease_ms if lease_id else 0)

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        if len(keys) > self.limits.max_lookup_keys:
            raise InvalidArgument(
                f"{len(keys)} keys in one call, max_lookup_keys={self.limits.max_lookup_keys}"
            )
        for key in keys:
            check_key(key)

    # ---- leases ----------------------------------------------------------------
    def _grant_lease(self, entries: list[Entry], lease_ms: int) -> int:
        self._expire_leases()
        if len(self._leases) >= self.limits.max_leases:
            raise ResourceExhausted(f"max_leases={self.limits.max_leases} leases are active")
        lease_id = next(self._lease_ids)
        expires_at = self._clock() + lease_ms / 1000
        for entry in entries:
            entry.leases += 1
        self._leases[lease_id] = _Lease(entries, expires_at)
        heapq.heappush(self._lease_expiry, (expires_at, lease_id))
        self.counters.leases_granted += 1
        return lease_id

    def release(self, lease_id: int) -> bool:
        """Drop a lease; False when it already expired or was released."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end_lease(lease)
        return True

    def _end_lease(self, lease: _Lease) -> None:
        assert lease.active
        lease.active = False
        for entry in lease.entries:
            entry.leases -= 1
            assert entry.leases >= 0

    def _expire_leases(self) -> None:
        now = self._clock()
        heap = self._lease_expiry
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._end_lease(lease)
                self.counters.leases_expired += 1
        # Released leases leave stale heap rows; rebuild once they dominate.
        if len(heap) > 2 * len(self._leases) + 1024:
            self._lease_expiry = [(lease.expires_at, lid) for lid, lease in self._leases.items()]
            heapq.heapify(self._lease_expiry)

    @property
    def active_leases(self) -> int:
        self._expire_leases()
        return len(self._leases)

    def lease_namespace(self, lease_id: int) -> str | None:
        lease = self._leases.get(lease_id)
        if lease is None or not lease.entries:
            return None
        return lease.entries[0].ns.name

    # ---- delete ----------------------------------------------------------------
    def delete(self, ns_name: str, keys: Sequence[bytes]) -> int:
        self._check_keys(keys)
        ns = self._namespaces.get(ns_name)
        if ns is None:
            return 0
        deleted = 0
        for key in keys:
            entry = ns.entries.get(key)
            if entry is not None:
                self._unlink(entry)
                deleted += 1
        return deleted

    def delete_namespace(self, ns_name: str) -> int:
        ns = self._namespaces.get(ns_name)
        if ns is None:
            return 0
        entries = list(ns.entries.values())
        for entry in entries:
            self._unlink(entry)
        return len(entries)

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Plain integers only: the metrics thread calls this while the loop runs."""
        c = self.counters
        return {
            "pool_bytes": self.pool.capacity_bytes,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_free_bytes": self.pool.free_bytes,
            "page_bytes": PAGE_BYTES,
            "entries": self.entry_count,
            "namespaces": len(self._namespaces),
            "leases_active": len(self._leases),
            "hits": c.hits,
            "misses": c.misses,
            "puts": c.puts,
            "put_existed": c.put_existed,
            "put_conflicts": c.put_conflicts,
            "evictions": c.evictions,
            "eviction_failures": c.eviction_failures,
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "leases_granted": c.leases_granted,
            "leases_expired": c.leases_expired,
        }
