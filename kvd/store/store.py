"""The store: namespaces, the index, leases and placement between L1 and L2.

Every state change happens on the event loop thread that owns the store, so
nothing here locks. Bytes never pass through this module: a put gets a
``PutTicket`` whose ``views`` are pool pages to fill, a get gets a ``Reader``
whose ``views`` are pool pages to send. Both pin their pages: a ticket's
pages are invisible until ``publish`` links them (a writer that dies half-way
leaves nothing behind), and a reader's entry cannot be evicted or freed until
the reader closes (a delete while reading unlinks the key at once and frees
the pages after the last reader).

Placement: a put lands in L1 and is queued for L2 (``kvd.store.writeback``;
with ``l2_admission = twice`` only once referenced again:
``kvd.store.admission``); a durable put returns once its record is on L2 and
synced. L1 evicts only entries already on L2 or held back from it (``dirty``
ones wait, unless L2 is failing: then they are dropped and counted). A get
that misses L1 but hits L2 reads the record into fresh pool pages
(promotion), verifying its checksum; concurrent gets of one key share one
read.

A put whose bytes are still arriving (a stream) reserves pages as they
come instead (``kvd.store.uploads``): nothing is evicted for bytes not yet sent.

The store composes the parts below it (``entries``: L1's index and
eviction; ``chains``: lookups and exists; ``placement``, ``writeback``,
``uploads``, ``leases``), handing each
the callables it needs; none of them imports this module.

Keys are write-once: a second put of a key with the same checksum is a no-op,
with a different one it is ``AlreadyExists``. Two puts of one key may run at
once; the first to finish publishes, the second compares checksums.

This module imports neither grpc nor metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2 import L2Record, L2Tier
from kvd.store import deletes
from kvd.store.admission import Admission
from kvd.store.chains import ChainLookups
from kvd.store.entries import Entries
from kvd.store.eviction.policy import EvictionPolicy, make_policy
from kvd.store.index import (
    TIER_L1,
    TIER_L2,
    Entry,
    Namespace,
    PutResult,
    PutTicket,
    Reader,
    StoreCounters,
    StoreLimits,
    check_key,
    check_keys,
    check_put,
)
from kvd.store.learning import DeferredPolicy
from kvd.store.leases import LeaseTable, pin_leased, unpin_leased
from kvd.store.placement import Placement
from kvd.store.prefetch import Prefetcher
from kvd.store.shares import ChainShares
from kvd.store.uploads import Uploads
from kvd.store.writeback import WriteBack
from kvd.util import crashpoints
from kvd.wire.errors import (
    AlreadyExists,
    DataLoss,
    Unavailable,
)
from kvd.wire.lookup import LookupResult


class Store:
    def __init__(
        self,
        pool: Pool,
        limits: StoreLimits,
        policy: EvictionPolicy[Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        l2: L2Tier | None = None,
    ) -> None:
        self.pool = pool
        self.limits = limits
        # Not `policy or ...`: a policy holding nothing has len() 0, so it is falsy.
        self.policy: EvictionPolicy[Any] = policy if policy is not None else make_policy("lru")
        self.counters = StoreCounters()
        self._clock = clock
        self.leases = LeaseTable(
            self.limits.max_leases, clock, partial(pin_leased, l2), partial(unpin_leased, l2)
        )
        # Every policy call goes through this: lookups teach it after answering.
        self.learning: DeferredPolicy[Any] = DeferredPolicy(self.policy)
        self.entries = Entries(
            pool,
            self.learning,
            self.counters,
            limits.namespace_l1_quota_bytes,
            keep_dirty=lambda: self.writeback is not None and self.writeback.healthy,
            on_drop_dirty=self._dropped_unwritten,
            expire_leases=self.leases.expire,
            wait_write_back=self._write_back_progress,
        )
        alloc_now = self.entries.alloc_now
        self.uploads = Uploads(pool, limits.uploads_max_bytes, self.entries.quota_room, alloc_now)
        self.l2 = l2
        # What this member learns of the chains other members of a pool look up.
        self.shares = ChainShares(self.entries, self.learning, l2, limits)
        self.chains = ChainLookups(
            self.entries, l2, self.learning, self.leases, limits, self._prefetch
        )
        self.writeback: WriteBack | None = None
        self.admission: Admission | None = None
        # ``Admission.referenced`` where puts wait for a second reference, else None.
        self._referenced: Callable[[Sequence[Entry]], None] | None = None
        self.placement: Placement | None = None
        self.prefetcher: Prefetcher | None = None
        # The pool's hooks (kvd.cluster.router): a miss asks the owner; a put goes to it.
        self.on_miss: Callable[[str, bytes], Awaitable[Reader | None]] | None = None
        self.on_put: Callable[[Entry], None] | None = None
        # Whether a key is another member's (its copy here is a guest: Entries).
        self.guest_of: Callable[[str, bytes], bool] | None = None
        if l2 is not None:
            self.writeback = WriteBack(
                l2, pool, self.entries.pin, self.entries.unpin,
                limits.namespace_l2_quota_bytes, clock, self.entries.cleaned,
                self.entries.l2_failing,
            )  # fmt: skip
            self.admission = Admission(limits.l2_admission, self.writeback.enqueue, self.counters)
            if self.admission.holds_back:
                self._referenced = self.chains.referenced = self.admission.referenced
            self.placement = Placement(
                l2, pool, self.entries, self.counters, self._readers, self._miss,
                self.writeback.reinsert,
            )  # fmt: skip
            l2.on_drop = self.placement.on_l2_drop

    def start(self) -> None:
        """Start background work (write-back, L2 prefetch); call on the event loop."""
        self.learning.schedule = asyncio.get_running_loop().call_soon
        if self.writeback is not None:
            self.writeback.start()
            self.prefetcher = Prefetcher()

    async def close(self, flush_s: float = 0.0) -> int:
        """Stop background work after flushing write-back for up to ``flush_s``; values left."""
        left = 0
        if self.prefetcher is not None:
            await self.prefetcher.close()
        if self.writeback is not None:
            left = await self.writeback.flush(flush_s) if flush_s > 0 else 0
            await self.writeback.close()
        return left

    # ---- namespaces ------------------------------------------------------------
    @property
    def entry_count(self) -> int:
        return self.entries.count

    @property
    def upload_bytes(self) -> int:
        """Pool bytes held by puts whose bytes are still arriving."""
        return self.uploads.held_bytes

    def namespaces(self) -> list[Namespace]:
        return list(self.entries.by_name.values())

    def _l1(self, ns_name: str, key: bytes) -> Entry | None:
        return self.entries.get(ns_name, key)

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
        while (begun := self.begin_put_now(ns_name, key, size, meta, parent, checksum)) is None:
            await self.entries.wait_room(size, ns_name)
        return begun

    def begin_put_now(
        self,
        ns_name: str,
        key: bytes,
        size: int,
        meta: bytes = b"",
        parent: bytes | None = None,
        checksum: int | None = None,
    ) -> PutTicket | PutResult | None:
        """``begin_put`` without waiting: None where room needs write-back first."""
        existed = self._check_put(ns_name, key, size, meta, parent, checksum)
        if existed is not None:
            return existed
        if not self.entries.quota_room(ns_name, size):
            return None
        runs = self.entries.alloc_now(size)
        if runs is None:
            return None
        return PutTicket(
            ns_name, key, size, meta, parent or None, checksum, runs, self.pool.views(runs, size)
        )

    def _check_put(
        self,
        ns_name: str,
        key: bytes,
        size: int,
        meta: bytes,
        parent: bytes | None,
        checksum: int | None,
    ) -> PutResult | None:
        """Validate a put; its answer when the key already holds these bytes."""
        check_put(ns_name, key, parent, meta, size, self.limits.max_value_bytes, self.pool)
        if checksum is not None:
            stored = self.chains.stored(ns_name, key)
            if stored is not None:
                return self._same_or_conflict(stored, checksum)
        return None

    def _same_or_conflict(self, stored: Entry | L2Record, checksum: int) -> PutResult:
        """The answer to a put of a key already stored (in L1, else on L2)."""
        if stored.checksum != checksum:
            self.counters.put_conflicts += 1
            raise AlreadyExists("key is stored with different content (keys are write-once)")
        self.counters.put_existed += 1
        if self._referenced is not None and isinstance(stored, Entry):
            self._referenced((stored,))  # a put again is a reference
        return PutResult(existed=True, checksum=checksum)

    def finish_put(self, ticket: PutTicket, checksum: int, *, queue: bool = True) -> PutResult:
        """Link a filled ticket into L1; ``checksum`` is what the bytes received hash to.

        With an L2 the entry is dirty and, with ``queue``, queued for write-back.
        """
        assert not ticket.done, "ticket finished twice"
        assert ticket.covered_bytes == ticket.size or not ticket.upload, "upload not complete"
        ticket.done = True
        self.uploads.ended(ticket)
        if ticket.checksum is not None and ticket.checksum != checksum:
            self.pool.free(ticket.runs)
            raise DataLoss(
                f"value hashes to {checksum:#018x}, the put said {ticket.checksum:#018x}"
            )
        stored = self.chains.stored(ticket.ns_name, ticket.key)
        if stored is not None:
            self.pool.free(ticket.runs)
            return self._same_or_conflict(stored, checksum)
        ns = self.entries.namespace(ticket.ns_name)
        entry = Entry(
            ns, ticket.key, ticket.size, checksum, ticket.meta, ticket.runs, ticket.parent
        )
        entry.guest = self.guest_of is not None and self.guest_of(ns.name, entry.key)
        self.entries.link(entry)
        self.counters.puts += 1
        self.counters.bytes_in += entry.size
        # A guest is its owner's to keep on disk: only a durable put writes one here.
        if self.admission is not None and not (entry.guest and queue):
            if queue:
                self.admission.at_put(entry)  # dirty and queued, or held back
            else:
                entry.dirty = True  # a durable put: its writer appends it
        if self.on_put is not None:
            self.on_put(entry)
        return PutResult(existed=False, checksum=checksum)

    async def publish(self, ticket: PutTicket, checksum: int, durable: bool = False) -> PutResult:
        """Publish a filled ticket; with ``durable``, return once the value is on L2.

        Every transport (gRPC, shared memory, bulk TCP) ends its puts here. A
        durable put that cannot reach L2 fails and leaves nothing visible.
        """
        if durable and self.writeback is None:
            self.abort_put(ticket)
            raise Unavailable("durable put: this daemon has no L2 tier (ssd_path)")
        if not durable:
            return self.publish_now(ticket, checksum)
        result = self.finish_put(ticket, checksum, queue=False)
        assert self.writeback is not None
        entry = self._l1(ticket.ns_name, ticket.key)  # None: the key is only on L2
        try:
            await self.writeback.make_durable(entry)
        except BaseException:
            if entry is not None and not result.existed:
                assert self.placement is not None
                await self.placement.withdraw(entry)
            raise
        crashpoints.hit("after_publish")
        return result

    async def make_durable(self, ns_name: str, key: bytes) -> None:
        """``publish``'s durability for a key ``begin_put`` found stored: on L2, synced."""
        if self.writeback is None or self.admission is None:
            raise Unavailable("durable put: this daemon has no L2 tier (ssd_path)")
        entry = self._l1(ns_name, key)  # None: the key is only on L2
        self.admission.admit_now(entry)
        await self.writeback.make_durable(entry)

    def publish_now(self, ticket: PutTicket, checksum: int) -> PutResult:
        """``publish`` of a put that is not durable: it needs no waiting."""
        result = self.finish_put(ticket, checksum)
        crashpoints.hit("after_publish")
        return result

    def abort_put(self, ticket: PutTicket) -> None:
        """Give a ticket's pages back (idempotent; safe after finish_put)."""
        if not ticket.done:
            ticket.done = True
            self.uploads.ended(ticket)
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
            if durable:
                await self.make_durable(ns_name, key)
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

    # ---- uploads ---------------------------------------------------------------
    def begin_upload(
        self,
        ns_name: str,
        key: bytes,
        size: int,
        meta: bytes = b"",
        parent: bytes | None = None,
        checksum: int | None = None,
    ) -> PutTicket | PutResult:
        """A put whose bytes are yet to arrive (``kvd.store.uploads``): checked,
        holding no page yet (``grow_put`` adds them), or the answer when the key
        holds these bytes."""
        existed = self._check_put(ns_name, key, size, meta, parent, checksum)
        if existed is not None:
            return existed
        return PutTicket(ns_name, key, size, meta, parent or None, checksum, [], [], upload=True)

    def grow_put_now(self, ticket: PutTicket, nbytes: int) -> list[memoryview] | None:
        """Views of the ticket's pages for its next ``nbytes`` (bytes that have
        arrived); None where room needs write-back first."""
        return self.uploads.grow_now(ticket, nbytes)

    async def grow_put(self, ticket: PutTicket, nbytes: int) -> list[memoryview]:
        """``grow_put_now``, waiting for write-back to make room; ResourceExhausted
        when it cannot."""
        while (views := self.uploads.grow_now(ticket, nbytes)) is None:
            await self.entries.wait_room(nbytes, ticket.ns_name)
        return views

    # ---- room in L1 ------------------------------------------------------------
    async def _write_back_progress(self) -> bool:
        """Wait until write-back unpinned some values; False when it cannot."""
        wb = self.writeback
        return wb is not None and wb.can_make_progress() and await wb.wait_progress()

    def _dropped_unwritten(self) -> None:
        if self.writeback is not None:
            self.writeback.dropped_unwritten += 1

    def evict(self, ns_name: str, key: bytes) -> bool:
        """Drop a value from L1 now if it is safe on L2 and not pinned (cold reads, tests)."""
        entry = self._l1(ns_name, key)
        return entry is not None and self.entries.drop_clean(entry)

    # ---- get -------------------------------------------------------------------
    def open(self, ns_name: str, key: bytes, views: bool = True) -> Reader | None:
        """Pin an L1 value for reading, or None when it is not in L1; ``views=False``:
        no views of its pages (a reader of the mapped pool reads ``entry.runs``)."""
        check_key(key)
        entry = self._l1(ns_name, key)
        return None if entry is None else self._reader(entry, TIER_L1, views)

    def hold(self, ns_name: str, key: bytes) -> Reader | None:
        """Pin an L1 value without serving it (no hit counted, the policy not
        told), or None when it is not in L1: a pool keeps a value it fetched
        for a get until the get opens it."""
        entry = self._l1(ns_name, key)
        return None if entry is None else self._pin(entry, TIER_L1, False)

    def l1_size(self, ns_name: str, key: bytes) -> int | None:
        """The size of a value in L1, or None; touches nothing (a get asks
        it to choose how to copy before it opens the value)."""
        entry = self._l1(ns_name, key)
        return None if entry is None else entry.size

    def peek(self, ns_name: str, key: bytes) -> Reader | None:
        """Pin an L1 value for the daemon's own use: no hit counted, no
        recency given to the eviction policy (handing a put to its owner)."""
        entry = self._l1(ns_name, key)
        return None if entry is None else self._pin(entry, TIER_L1)

    async def fetch(self, ns_name: str, key: bytes) -> Reader | None:
        """Pin a value wherever it is stored (L1, or L2 read into L1); None on a miss.

        Every transport's get starts here. A value held nowhere here goes to
        ``on_miss`` (the pool asks the key's owner) before it is a miss.
        """
        while True:
            reader = self.open(ns_name, key)
            if reader is not None:
                return reader
            record = self.l2.lookup(ns_name, key) if self.l2 is not None else None
            if record is None:
                remote = await self.on_miss(ns_name, key) if self.on_miss is not None else None
                if remote is None:
                    self._miss(ns_name)
                return remote
            assert self.placement is not None
            pending = self.placement.promotions.get((ns_name, key))
            if pending is None:
                break
            # Another get is reading this record: share its read, then look
            # again (its value may already have left L1 by the time we run).
            await asyncio.shield(pending)
        entry = await self.placement.promote(record)
        if entry is None:
            self._miss(ns_name)
            return None
        return self._reader(entry, TIER_L2)

    async def fetch_many(self, ns_name: str, keys: Sequence[bytes]) -> dict[int, Reader | None]:
        """``fetch`` for the keys of a batched get whose values are only on L2,
        read together (``Placement.promote_many``); by index into ``keys``, a
        pinned reader or None for a miss. Indices left out go through ``fetch``."""
        if self.placement is None:
            return {}
        return await self.placement.promote_many(ns_name, keys)

    def l2_only(self, ns_name: str, key: bytes) -> L2Record | None:
        """The L2 record of a value that is not in L1 and not being read into
        it, for ``read_l2_into`` (``Placement.l2_only``)."""
        check_key(key)
        return None if self.placement is None else self.placement.l2_only(ns_name, key)

    async def read_l2_into(self, record: L2Record, dst: memoryview) -> bool:
        """Read an L2-only value straight into ``dst``, checked against its
        checksum; False when the read failed (``Placement.read_l2_into``)."""
        assert self.placement is not None
        return await self.placement.read_l2_into(record, dst)

    def touched(self, ns_name: str, keys: Sequence[bytes]) -> tuple[int, int]:
        """Count gets a client served itself out of L1 (the pool's
        directory) as hits, and give them to the eviction policy as a get
        would: the hits and their bytes. A key no longer in L1 counts nothing."""
        found = [e for e in map(partial(self._l1, ns_name), keys) if e is not None]
        self._hits(found)
        return len(found), sum(entry.size for entry in found)

    def _reader(self, entry: Entry, tier: int, views: bool = True) -> Reader:
        self._hit(entry)
        return self._pin(entry, tier, views)

    def _readers(
        self, served: Sequence[tuple[Entry, bool | list[memoryview]]], tier: int
    ) -> list[Reader]:
        """``_reader`` of each entry, with its views (as ``_pin`` takes them)."""
        self._hits([entry for entry, _ in served])
        pin = self._pin
        return [pin(entry, tier, views) for entry, views in served]

    def _hit(self, entry: Entry) -> None:
        self._hits((entry,))

    def _hits(self, entries: Sequence[Entry]) -> None:
        """Gets served: counted, and the policy's recency (one call)."""
        counters = self.counters
        for entry in entries:
            entry.ns.hits += 1
            counters.bytes_out += entry.size
        counters.hits += len(entries)
        self.learning.touch_many([(entry.ns.id, entry.key) for entry in entries])
        if self._referenced is not None:
            self._referenced(entries)

    def _pin(self, entry: Entry, tier: int, views: bool | list[memoryview] = True) -> Reader:
        """A reader of ``entry``, with views of its pages (True), none (False),
        or the views given (``entry.size`` bytes of its pages)."""
        self.entries.pin(entry)
        pages = self.pool.views(entry.runs, entry.size) if views is True else views or []
        return Reader(self.entries.unpin, entry, pages, tier)

    def _miss(self, ns_name: str) -> None:
        self.counters.misses += 1
        ns = self.entries.by_name.get(ns_name)
        if ns is not None:
            ns.misses += 1

    # ---- index queries (kvd.store.chains) ----------------------------------------
    def exists(self, ns_name: str, keys: Sequence[bytes]) -> list[bool]:
        return self.chains.exists(ns_name, keys)

    def lookup(
        self,
        ns_name: str,
        keys: Sequence[bytes],
        lease_ms: int = 0,
        mine: Sequence[bool] | None = None,
    ) -> LookupResult:
        """Longest stored prefix of a chain; with ``lease_ms`` its values are
        pinned. ``mine``: in a pool, which keys this member owns (the policy
        learns only of those: ``EvictionPolicy.on_lookup``)."""
        return self.chains.lookup(ns_name, keys, lease_ms, mine)

    def _prefetch(self, records: list[L2Record]) -> None:
        """Read a lookup's L2 hits into L1 ahead of their gets."""
        if self.prefetcher is not None and self.placement is not None:
            prefetch = self.placement.prefetch
            self.prefetcher.schedule([partial(prefetch, record) for record in records])

    # ---- leases ----------------------------------------------------------------
    def lease_more(
        self, ns_name: str, keys: Sequence[bytes], lease_ms: int, lease_id: int = 0
    ) -> int:
        """Pin the values of ``keys`` held here (others are skipped) under
        ``lease_id``, or under a new lease of ``lease_ms`` where it is 0 or
        has ended; the lease's id (``lease_id`` when nothing was pinned). A
        pool's lookup leases so the keys it holds past its local prefix."""
        return self.chains.lease_more(ns_name, keys, lease_ms, lease_id)

    def release(self, lease_id: int, ns_name: str | None = None) -> bool:
        """Drop a lease; False when it expired, was released, or is another namespace's."""
        if ns_name is not None and self.leases.namespace_of(lease_id) != ns_name:
            return False
        return self.leases.release(lease_id)

    @property
    def active_leases(self) -> int:
        self.leases.expire()
        return len(self.leases)

    # ---- delete (kvd.store.deletes) ----------------------------------------------
    async def delete(self, ns_name: str, keys: Sequence[bytes]) -> int:
        check_keys(keys, self.limits.max_lookup_keys)
        return await deletes.delete_keys(self.entries, self.l2, ns_name, keys)

    async def delete_namespace(self, ns_name: str) -> int:
        return await deletes.delete_namespace(self.entries, self.l2, ns_name)

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Plain integers only: the metrics thread calls this while the loop runs."""
        values = {
            **dataclasses.asdict(self.counters),  # hits, misses, puts, evictions, ...
            "pool_bytes": self.pool.capacity_bytes,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_free_bytes": self.pool.free_bytes,
            "upload_bytes": self.upload_bytes,
            "page_bytes": PAGE_BYTES,
            "entries": self.entry_count,
            "guests": len(self.entries.guests),
            "namespaces": len(self.entries.by_name),
            "leases_active": len(self.leases),
            "leases_granted": self.leases.granted,
            "leases_expired": self.leases.expired,
            "l2_prefetches": self.prefetcher.started if self.prefetcher is not None else 0,
        }
        if self.l2 is not None and self.writeback is not None:
            values.update(self.l2.stats())
            values.update(self.writeback.stats())
        return values
