"""The shared-memory region ops, under both transports that serve them (the
gRPC ``PutFromRegion``/``GetIntoRegion`` and the shm socket): a batch of
values moved between a region and the pool, in plain values
(``kvd.paths.ops.items``). Per item: pin (a ticket or a reader) on the event
loop, copy on a worker thread, publish or check the checksum back on the loop.
Items fail alone (a per-item status); only a bad region fails the whole call.
A get of a value only on L2 reads it straight into the region when
``shm_l2_direct_min_bytes`` is set and the value is whole 4 KiB blocks of
at least that size (``_l2_direct``); others are promoted into L1 and
copied, the batch's L2 reads in one ``L2Tier.read_many`` call
(``_fetch_batched``: an engine restores a chain with one batch get).
Direct reads are off by default: on the development VM direct reads into
4 KiB shared-memory pages ran at 1.0-1.1 GB/s, reads through L1's huge
pages at 1.2-1.5 GB/s. The shm socket answers a lone op with ``get_now`` or
``put_now`` when it needs no waiting.

Batches under ``INLINE_COPY_BYTES`` copy on the event loop thread: handing a
64 KiB copy (~6 µs) to a thread costs ~50 µs of wake-ups. So do batches up
to ``IDLE_INLINE_COPY_BYTES`` when no other request is in flight, or on a
machine without cores to spare (``kvd.util.cpus``). Larger batches go to
``COPY_THREADS`` workers, one group of items per worker; a value of
``SPLIT_COPY_BYTES`` or more is copied by several workers in slices
(``kvd.paths.shm.jobs``).

Callers are authorized before they get here (a gRPC token, a shm socket
HELLO); a region is named by id and token and checked against the caller.
The store reads and their counts (fetch time by tier, hits, misses, bytes)
are ``ValueOps``' (``kvd.paths.ops.values``), shared with the other gets.
A batch's values already in L1 are pinned without an await each, and
counted once for the batch (one fetch time, hits and bytes added up): per
64 KiB value of a 64-value batch this cut the daemon's work from ~11.7 to
~8.7 µs, copy and checksum included, in process on the development VM.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvd.io.backend import CopyMany
from kvd.l2.format import BLOCK_BYTES
from kvd.paths.auth import Authenticator
from kvd.paths.ops.items import (
    RESOURCE_EXHAUSTED,
    ItemResult,
    RegionBatch,
    RegionItem,
    all_results,
    existed_result,
    item_status,
    late_result,
    miss,
)
from kvd.paths.ops.values import ValueOps
from kvd.paths.shm.jobs import CopyJob, all_done, grouped, hash_job, is_late, run_jobs
from kvd.paths.shm.regions import Caller, Region, RegionRegistry, copy_slices, copy_span
from kvd.store.index import TIER_L1, TIER_L2, PutResult, PutTicket, Reader
from kvd.util.aio import settle
from kvd.util.cpus import OFFLOAD, WORKER_THREADS
from kvd.wire.errors import DataLoss, DeadlineExceeded, KvdError, Unavailable

INLINE_COPY_BYTES = 256 << 10
# When no other request is in flight, batches up to this size copy on the
# loop too: the hand-off to a worker and back cost ~0.19 ms per 4 MiB get
# here (server time 0.41 vs 0.60 ms), and a newly arriving request waits at
# most one such copy (~0.6 ms for 8 MiB).
IDLE_INLINE_COPY_BYTES = 8 << 20
# kvd.util.cpus: two copy threads on a small machine (they saturate its memory
# bandwidth, one numpy copy moving ~12 GB/s), up to 8 on a many-core server,
# which copies for many clients at once.
COPY_THREADS = WORKER_THREADS
# A value this large, in a batch of fewer values than copy threads, is copied
# by several threads at once in slices, then hashed in one pass while it is
# still in cache: one thread copying and hashing it moves ~5 GB/s on a server
# core, so alone it is the batch's bottleneck.
SPLIT_COPY_BYTES = 16 << 20


class RegionOps:
    """The region ops of one daemon, and the state they share with its transports."""

    def __init__(self, values: ValueOps, auth: Authenticator | None = None) -> None:
        self.values = values
        self.store = values.store
        self.limits = values.limits
        self.metrics = values.metrics
        self.inflight = values.inflight
        self.auth = auth  # the transports' (they authorize before calling)
        self.regions: RegionRegistry | None = None
        self.bulk_port = 0
        self.bulk_tls = False  # the bulk port takes TLS only (bulk_tls)
        self.shm_socket = ""
        self.l2_direct_min_bytes = 0  # the shm_l2_direct_min_bytes setting; 0: off
        self.pool_reads = False  # the shm_pool_reads setting (kvd.paths.shm.pool_reads)
        self.pool_pinned_bytes = 0  # L1 bytes pinned for pool reads, all connections
        # The copies' native batch (kvd.io.backend.native_copy_many), set by the
        # daemon at start; None: numpy and xxhash.
        self.copy_many: CopyMany | None = None
        self._copy_pool: ThreadPoolExecutor | None = None

    def enable_fast_paths(
        self, regions: RegionRegistry | None, bulk_port: int, bulk_tls: bool = False
    ) -> None:
        """Called by the daemon at start, once the shm directory and bulk port exist."""
        self.regions = regions
        self.bulk_port = bulk_port
        self.bulk_tls = bulk_tls
        if regions is not None and self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvd-copy")

    def close_fast_paths(self) -> None:
        if self.regions is not None:
            self.regions.close()
            self.regions = None
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None

    def attach_region(self, fd: int, size: int, caller: Caller) -> Region:
        """Attach the memfd ``fd`` a shm socket peer passed (owned from now on)."""
        if self.regions is None:
            os.close(fd)
        return self.registry().attach(fd, size, caller)

    def detach_region(self, region_id: int, token: bytes, caller: Caller) -> None:
        self.registry().detach(region_id, token, caller)

    def registry(self) -> RegionRegistry:
        if self.regions is None:
            raise Unavailable("this daemon has no shared-memory path (shm_dir unusable)")
        return self.regions

    def _copies_on_loop(self, total: int, others: int) -> bool:
        """Whether ``total`` bytes copy on the loop, ``others`` requests in flight."""
        alone = (others == 0 or not OFFLOAD) and total <= IDLE_INLINE_COPY_BYTES
        return total < INLINE_COPY_BYTES or alone or self._copy_pool is None

    async def _copy(self, jobs: list[CopyJob], to_pages: bool) -> None:
        total = sum(len(job.span) for job in jobs)
        pool = self._copy_pool
        if pool is None or self._copies_on_loop(total, self.inflight.requests - 1):
            run_jobs(jobs, to_pages, self.copy_many)
            return
        copies = asyncio.ensure_future(self._copy_on_threads(pool, jobs, to_pages))
        # A cancelled call must not unpin pages that a worker still copies
        # to or from: they could be handed to another value meanwhile.
        await settle([copies])
        copies.result()

    async def _copy_on_threads(
        self, pool: ThreadPoolExecutor, jobs: list[CopyJob], to_pages: bool
    ) -> None:
        # A value under SPLIT_COPY_BYTES stays on one thread: two threads
        # copying halves of one 4 MiB value were slower here than one (12.8
        # vs 18.1 GB/s).
        loop = asyncio.get_running_loop()
        if len(jobs) < COPY_THREADS and max(len(job.span) for job in jobs) >= SPLIT_COPY_BYTES:
            parts = COPY_THREADS // len(jobs)
            await all_done(
                loop.run_in_executor(pool, copy_span, job.views, job.span, lo, hi, to_pages, None)
                for job in jobs
                for lo, hi in copy_slices(len(job.span), parts)
            )
            await all_done(loop.run_in_executor(pool, hash_job, job, to_pages) for job in jobs)
            return
        await all_done(
            loop.run_in_executor(pool, run_jobs, group, to_pages, self.copy_many)
            for group in grouped(jobs, COPY_THREADS)
        )

    def check_batch(self, count: int) -> None:
        self.values.check_batch(count)

    # ---- put -----------------------------------------------------------------------
    async def put_from_region(self, batch: RegionBatch, caller: Caller) -> list[ItemResult]:
        """The batch put itself, once the caller is authorized (gRPC or the shm socket)."""
        self.check_batch(len(batch.items))
        registry = self.registry()
        region = registry.checked(batch.region_id, batch.token, caller)
        if is_late(batch.deadline_ns):
            raise DeadlineExceeded("a region put that arrived past the client's deadline")
        results: list[ItemResult | None] = [None] * len(batch.items)
        tickets: list[PutTicket] = []
        jobs: list[CopyJob] = []
        registry.enter(region)
        try:
            previous: bytes | None = None
            for i, item in enumerate(batch.items):
                parent = item.parent or (previous if batch.chained else None)
                previous = item.key
                try:
                    begun = await self._begin_put(
                        region, batch.namespace, item, parent, i, batch.durable
                    )
                except KvdError as exc:
                    results[i] = item_status(exc)
                    continue
                if isinstance(begun, ItemResult):
                    results[i] = begun
                    continue
                tickets.append(begun[0])
                jobs.append(begun[1])
            await self._copy(jobs, to_pages=True)
            if is_late(batch.deadline_ns):
                # The client stopped waiting while the bytes were copied, and
                # may have put others there since: nothing copied is stored.
                self._refuse_late("shm_put", jobs, results)
            else:
                for job, ticket in zip(jobs, tickets, strict=True):
                    results[job.index] = await self._publish(ticket, job, batch.durable)
        finally:
            for ticket in tickets:
                self.store.abort_put(ticket)
            for job in jobs:
                self.inflight.release(job.held_bytes)
            registry.leave(region)
        return all_results(results)

    async def _begin_put(
        self,
        region: Region,
        ns: str,
        item: RegionItem,
        parent: bytes | None,
        index: int,
        durable: bool,
    ) -> ItemResult | tuple[PutTicket, CopyJob]:
        span = region.span(item.offset, item.length)
        ticket = await self.values.begin_put(
            ns, item.key, item.length, item.meta, parent, item.checksum, durable
        )
        if isinstance(ticket, PutResult):
            return existed_result(ticket.checksum, item)
        try:
            self.inflight.acquire(item.length)
        except KvdError:
            self.store.abort_put(ticket)
            raise
        return ticket, CopyJob(index, span, ticket.views, item.length)

    async def _publish(self, ticket: PutTicket, job: CopyJob, durable: bool) -> ItemResult:
        try:
            result = await self.store.publish(ticket, job.checksum, durable)
        except KvdError as exc:
            return item_status(exc)
        return self._stored(ticket, result)

    def _refuse_late(self, op: str, jobs: list[CopyJob], results: list[ItemResult | None]) -> None:
        what = "a copy out of the region that ended" if op == "shm_put" else "a copy to start"
        for job in jobs:
            results[job.index] = late_result(what)
        self.metrics.refused("DEADLINE_EXCEEDED", op, f"{len(jobs)} copies past the deadline")

    def _stored(self, ticket: PutTicket, result: PutResult) -> ItemResult:
        self.values.received("shm_put", ticket.size)
        return ItemResult(size=ticket.size, checksum=result.checksum, existed=result.existed)

    def put_now(
        self,
        region_id: int,
        token: bytes,
        ns: str,
        item: RegionItem,
        durable: bool,
        caller: Caller,
        deadline_ns: int = 0,
    ) -> ItemResult | None:
        """A one-item ``put_from_region`` that needs no waiting, or None when it
        would (a durable put, a copy for threads, room only after write-back)
        or the item is bad: the batch put then answers. Like ``get_now``."""
        if durable or not self._copies_on_loop(item.length, self.inflight.requests):
            return None
        region = self.registry().checked(region_id, token, caller)
        if not region.holds(item.offset, item.length) or is_late(deadline_ns):
            return None  # the batch put words the error
        try:
            ticket = self.store.begin_put_now(
                ns, item.key, item.length, item.meta, item.parent or None, item.checksum
            )
        except KvdError as exc:
            return item_status(exc)
        if ticket is None or isinstance(ticket, PutResult):
            return None if ticket is None else existed_result(ticket.checksum, item)
        try:
            self.inflight.acquire(item.length)
        except KvdError as exc:
            self.store.abort_put(ticket)
            return item_status(exc)
        job = CopyJob(0, region.span(item.offset, item.length), ticket.views, item.length)
        try:
            run_jobs([job], True, self.copy_many)
            if is_late(deadline_ns):
                results: list[ItemResult | None] = [None]
                self._refuse_late("shm_put", [job], results)
                assert results[0] is not None
                return results[0]
            try:
                result = self.store.publish_now(ticket, job.checksum)
            except KvdError as exc:
                return item_status(exc)
            return self._stored(ticket, result)
        finally:
            self.store.abort_put(ticket)  # nothing, once published
            self.inflight.release(item.length)

    # ---- get -----------------------------------------------------------------------
    async def get_into_region(self, batch: RegionBatch, caller: Caller) -> list[ItemResult]:
        """The batch get itself, once the caller is authorized (gRPC or the shm socket)."""
        self.check_batch(len(batch.items))
        registry = self.registry()
        region = registry.checked(batch.region_id, batch.token, caller)
        if is_late(batch.deadline_ns):
            raise DeadlineExceeded("a region get that arrived past the client's deadline")
        results: list[ItemResult | None] = [None] * len(batch.items)
        readers: list[Reader] = []
        jobs: list[CopyJob] = []
        landed: list[CopyJob] = []  # copied as their values came from their owners
        peeked: set[int] = set()  # their items, and those found too big as they landed
        copy_landed, end_landing = self._copy_landed(
            region, batch, results, readers, landed, peeked
        )
        registry.enter(region)
        try:
            await self.values.fetch_remote_many(
                batch.namespace, (i.key for i in batch.items), copy_landed
            )
            batched = await self._fetch_batched(region, batch.namespace, batch.items)
            readers += [r for r in batched.values() if r is not None]
            start, in_l1 = time.perf_counter(), 0
            for i, item in enumerate(batch.items):
                if i in peeked:  # answered as it landed: its hit, in the batch's order
                    self.store.touched(batch.namespace, (item.key,))
                    continue
                if is_late(batch.deadline_ns):
                    results[i] = late_result("a get that would start")
                    continue
                try:
                    reader = None if i in batched else self._open_now(region, batch.namespace, item)
                    if reader is not None:  # in L1: no await, one fetch time for them all
                        readers.append(reader)
                        in_l1 += 1
                    elif i in batched:
                        reader = batched[i]
                        if reader is None:
                            self.values.missed("shm_get")  # fetch_many counts none
                    else:
                        direct = await self._l2_direct(region, batch.namespace, item)
                        if direct is not None:
                            results[i] = direct
                            continue
                        reader = await self._open(region, batch.namespace, item)
                        if reader is not None:
                            readers.append(reader)
                except KvdError as exc:
                    results[i] = item_status(exc)
                    continue
                if reader is None:  # counted as a miss
                    results[i] = miss()
                    continue
                results[i] = self._admit(i, item, reader, region, jobs)
            if in_l1:
                self.values.fetched("shm_get", "l1", start)
            self._check_copies(landed, results)
            if is_late(batch.deadline_ns):
                self._refuse_late("shm_get", jobs, results)  # none of them copied
            else:
                await self._copy(jobs, to_pages=False)
                self._check_copies(jobs, results)
        finally:
            end_landing()  # a fetch that lands after the batch ended (it failed) is not copied
            for reader in readers:
                reader.close()
            for job in jobs + landed:
                self.inflight.release(job.held_bytes)
            registry.leave(region)
        return all_results(results)

    def _copy_landed(
        self, region: Region, batch: RegionBatch, results: list[ItemResult | None],
        readers: list[Reader], landed: list[CopyJob], peeked: set[int],
    ) -> tuple[Callable[[bytes], None], Callable[[], None]]:  # fmt: skip
        """What a batch get does with each value that arrives from its owner
        while the batch's others are still on their way: copy it into its
        room at once, on the loop, when a copy of its size would run there
        (others wait for the batch's copy); its result, reader and job are
        the batch's, its index in ``peeked``. Its hit is counted, and given
        to the eviction policy, by the batch in its order (``Store.touched``),
        as if it had been opened there: the policy sees what it saw before.
        Copied only once the last value had landed, a batch of 8 values of
        4 MiB spent another 2.2-2.4 ms copying (development VM); copied as
        they land, those copies run while the others arrive.

        Returns the copy (called with each key that landed) and the batch's
        end, past which nothing is copied: a batch that fails while other
        fetches of it are still under way (the fetches go on) has left its
        region, unpinned its readers and answered."""
        places: dict[bytes, list[int]] = {}
        for i, item in enumerate(batch.items):
            places.setdefault(item.key, []).append(i)
        ns = batch.namespace

        def copy(key: bytes) -> None:
            for i in places.get(key, ()):  # none once ended
                if results[i] is not None or is_late(batch.deadline_ns):
                    continue
                size = self.store.l1_size(ns, key)
                others = self.inflight.requests - 1  # the batch is one
                if size is None or not self._copies_on_loop(size, others):
                    continue
                item, start = batch.items[i], time.perf_counter()
                if not region.holds(item.offset, item.length):
                    continue  # the batch's loop words why
                reader = self.store.peek(ns, key)  # the hit is the batch's
                if reader is None:
                    continue
                readers.append(reader)
                peeked.add(i)
                self.values.fetched("shm_get", "l1", start)
                jobs: list[CopyJob] = []
                results[i] = self._admit(i, item, reader, region, jobs)
                run_jobs(jobs, False, self.copy_many)
                landed.extend(jobs)

        return copy, places.clear

    def get_now(
        self,
        region_id: int,
        token: bytes,
        ns: str,
        item: RegionItem,
        caller: Caller,
        deadline_ns: int = 0,
    ) -> ItemResult | None:
        """A one-item ``get_into_region`` that needs no waiting, or None when it
        would (a value not in L1, a copy for threads) or the item is bad.
        Nothing runs between the check and the copy, so the value found is
        the value copied. The shm socket answers a lone get this way."""
        size = self.store.l1_size(ns, item.key)
        others = self.inflight.requests  # this get is not counted
        if size is None or size > item.length or not self._copies_on_loop(size, others):
            return None
        region = self.registry().checked(region_id, token, caller)
        if not region.holds(item.offset, item.length) or is_late(deadline_ns):
            return None  # the batch get words the error
        reader = self.values.open_now("shm_get", ns, item.key)
        assert reader is not None, "l1_size saw it and nothing ran since"
        jobs: list[CopyJob] = []
        try:
            results: list[ItemResult | None] = [self._admit(0, item, reader, region, jobs)]
            run_jobs(jobs, False, self.copy_many)
            self._check_copies(jobs, results)
        finally:
            reader.close()
            for job in jobs:
                self.inflight.release(job.held_bytes)
        assert results[0] is not None
        return results[0]

    def _admit(
        self, index: int, item: RegionItem, reader: Reader, region: Region, jobs: list[CopyJob]
    ) -> ItemResult:
        """The result of a get whose value is pinned, and its copy job when it fits."""
        if reader.size > item.length:
            return ItemResult(
                code=RESOURCE_EXHAUSTED,
                message=f"value of {reader.size} bytes, room for {item.length}",
                size=reader.size,
            )
        try:
            self.inflight.acquire(reader.size)
        except KvdError as exc:
            return item_status(exc)
        jobs.append(
            CopyJob(index, region.span(item.offset, reader.size), reader.views, reader.size)
        )
        return ItemResult(
            size=reader.size, checksum=reader.checksum, meta=reader.meta, tier=TIER_L1
        )

    def _check_copies(self, jobs: list[CopyJob], results: list[ItemResult | None]) -> None:
        """Turn a copied get whose bytes do not match the checksum into
        DATA_LOSS; count the others' hits and bytes, once for the batch."""
        hits = served = 0
        for job in jobs:
            result = results[job.index]
            assert result is not None
            if job.checksum != result.checksum:
                results[job.index] = item_status(
                    DataLoss("value copied into the region does not match its checksum")
                )
                continue
            hits += 1
            served += job.held_bytes
        if hits:
            self.values.served("shm_get", "l1", served, hits=hits)

    async def _l2_direct(self, region: Region, ns: str, item: RegionItem) -> ItemResult | None:
        """Read a value that is only on L2 straight into the region, or None
        when it is not such a value or cannot land there directly: it must
        be whole O_DIRECT blocks (a size of 4 KiB multiples, at a 4 KiB
        aligned offset; the region's mapping is page aligned) and at least
        ``shm_l2_direct_min_bytes``. Other values are promoted into L1."""
        least = self.l2_direct_min_bytes
        if not least or item.length < least or item.offset % BLOCK_BYTES:
            return None
        record = self.store.l2_only(ns, item.key)
        if record is None or record.size % BLOCK_BYTES or record.size > item.length:
            return None
        if record.size < least:
            return None
        span = region.span(item.offset, record.size)
        self.inflight.acquire(record.size)
        start = time.perf_counter()
        try:
            read = await self.store.read_l2_into(record, span.data)
        finally:
            self.inflight.release(record.size)
        values = self.values
        values.fetched("shm_get", "l2" if read else "miss", start)
        if not read:
            values.missed("shm_get")
            return miss()
        values.served("shm_get", "l2", record.size)
        return ItemResult(
            size=record.size, checksum=record.checksum, meta=record.meta, tier=TIER_L2
        )

    async def _fetch_batched(
        self, region: Region, ns: str, items: Sequence[RegionItem]
    ) -> dict[int, Reader | None]:
        """The values of a batch that are only on L2, read into L1 in one
        ``read_many`` call (``Store.fetch_many``), by item index. Left out:
        items that may go straight into the region (``_l2_direct``) and
        items whose room is not inside it (``_open`` words the error)."""
        if len(items) < 2:
            return {}
        least = self.l2_direct_min_bytes
        indices = [
            i for i, item in enumerate(items)
            if (not least or item.length < least or item.offset % BLOCK_BYTES)
            and region.holds(item.offset, item.length)
        ]  # fmt: skip
        found = await self.values.fetch_many("shm_get", ns, [items[i].key for i in indices])
        return {indices[j]: reader for j, reader in found.items()}

    def _open_now(self, region: Region, ns: str, item: RegionItem) -> Reader | None:
        """The item's value pinned if it is in L1 now and its room lies inside
        the region; None otherwise (the awaited path then fetches it, or
        words the error)."""
        if not region.holds(item.offset, item.length):
            return None
        return self.store.open(ns, item.key)

    async def _open(self, region: Region, ns: str, item: RegionItem) -> Reader | None:
        region.span(item.offset, item.length)  # the room must lie inside the region
        return await self.values.fetch("shm_get", ns, item.key)
