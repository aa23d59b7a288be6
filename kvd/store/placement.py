"""Placement between L1 and L2: promotion of an L2 hit into L1 (shared by
concurrent gets of one key; a batched get's in one ``L2Tier.read_many``
call, ``promote_many``), prefetch after a Lookup, reads straight from L2
into a client's memory, rewrites of values whose L2 record was dropped
(within write-back's credit), and withdrawal of a durable put that failed.

The store owns the get (``Store.fetch``) and hands this module the L1 index
and the callables it needs: ``reader`` pins an entry for a get and counts the hit, ``miss``
counts a miss, ``reinsert`` queues a rewrite. Imports neither grpc nor metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvd.io.backend import IoError
from kvd.l1.pool import Pool, Run
from kvd.l2 import ChecksumMismatch, L2Record, L2Tier
from kvd.store.entries import Entries
from kvd.store.index import TIER_L2, Entry, Reader, StoreCounters, check_key
from kvd.wire.errors import ResourceExhausted
from kvd.wire.limits import KEY_BYTES_MAX

# Keys read from L2 straight into a client's memory that are remembered: a
# second such get within the last this many promotes the value into L1.
DIRECT_READS_REMEMBERED = 4096
# Bytes one ``promote_many`` reads from L2 in one backend call. A batched get
# of a chain pins all its values until its copies end either way; this only
# bounds the pages allocated for reads not yet done. 32 MiB: 512 values of
# 64 KiB, where the batch's Python work is already per call (kvd bench l2).
FETCH_BATCH_BYTES_MAX = 32 << 20


class Placement:
    def __init__(
        self,
        l2: L2Tier,
        pool: Pool,
        entries: Entries,
        counters: StoreCounters,
        readers: Callable[[Sequence[tuple[Entry, bool | list[memoryview]]], int], list[Reader]],
        miss: Callable[[str], None],
        reinsert: Callable[[Entry], bool],
    ) -> None:
        self.l2 = l2
        self.pool = pool
        self.entries = entries
        self.counters = counters
        # Pins entries for a get and counts their hits (``Store._readers``).
        self._readers = readers
        self._miss = miss
        self._reinsert = reinsert
        # Reads of L2 records into L1 under way, by (namespace, key): a get of
        # one waits for it instead of reading the record again.
        self.promotions: dict[tuple[str, bytes], asyncio.Future[None]] = {}
        self._direct_reads: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    async def promote_many(self, ns_name: str, keys: Sequence[bytes]) -> dict[int, Reader | None]:
        """``Store.fetch`` for the keys of a batched get whose values are only
        on L2, read in one ``L2Tier.read_many`` call per ``FETCH_BATCH_BYTES_MAX``.

        Returns, by index into ``keys``, a pinned reader or None for a miss
        (a failed read: counted and its record dropped, as ``fetch`` does).
        Indices left out (values in L1, not stored here, being read by
        another get, a key repeated in the batch, no room in a pool pinned
        full) go through ``fetch``.
        """
        records: list[tuple[int, L2Record]] = []
        seen: set[bytes] = set()
        ns = self.entries.by_name.get(ns_name)
        in_l1 = ns.entries if ns is not None else {}
        lookup, promotions = self.l2.lookup, self.promotions
        for index, key in enumerate(keys):
            if not key or len(key) > KEY_BYTES_MAX:
                continue  # ``fetch`` refuses it, for this item alone
            if key in seen or key in in_l1 or (ns_name, key) in promotions:
                continue
            seen.add(key)
            if record := lookup(ns_name, key):
                records.append((index, record))
        readers: dict[int, Reader | None] = {}
        try:
            while records:
                taken = await self._promote_some(ns_name, records, readers)
                del records[:taken]
        except ResourceExhausted:
            pass  # the pool is pinned full: the rest go to ``fetch``, which says so per key
        except BaseException:
            for reader in readers.values():
                if reader is not None:
                    reader.close()
            raise
        return readers

    async def _promote_some(
        self, ns_name: str, records: list[tuple[int, L2Record]], readers: dict[int, Reader | None]
    ) -> int:
        """Promote a prefix of ``records`` with one L2 read; its length.

        The first record's pages may wait for eviction; the others' are
        taken only when free at once, so that no batch waits holding pages.
        """
        # One future for the batch's promotions: a get of one of its keys
        # waits for the whole read (one backend call) either way.
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch: list[tuple[int, L2Record, list[Run]]] = []
        promotions: list[tuple[str, bytes]] = []
        views: list[tuple[L2Record, list[memoryview]]] = []
        under_way, entries, pool_views = self.promotions, self.entries, self.pool.views
        batch_bytes = taken = 0
        try:
            for index, record in records:
                pk = (ns_name, record.key)
                read_bytes = record.read_bytes
                if batch and batch_bytes + read_bytes > FETCH_BATCH_BYTES_MAX:
                    break
                if pk in under_way or not record.live:
                    # Another get began reading it while this batch waited for
                    # pages, or it was deleted: ``fetch`` shares or misses.
                    taken += 1
                    continue
                # Room at once (no coroutine made), or, for the first, waited for.
                runs = entries.alloc_now(record.size, expire=not batch)
                if runs is None and not batch:
                    runs = await entries.alloc(record.size)
                    if pk in under_way or not record.live:
                        # Taken by another get (a read-ahead) while this one
                        # waited: reading it as well, both would claim it.
                        self.pool.free(runs)
                        taken += 1
                        continue
                if runs is None:
                    break
                under_way[pk] = done
                promotions.append(pk)
                batch.append((index, record, runs))
                views.append((record, pool_views(runs, read_bytes)))
                batch_bytes += read_bytes
                taken += 1
            errors = await self.l2.read_many(views)
            read, batch = batch, []
            fresh: list[Entry] = []  # read here: linked into L1 together
            served: list[tuple[Entry, bool | list[memoryview]]] = []
            at: list[int] = []
            for (index, record, runs), (_, pages), error in zip(read, views, errors, strict=True):
                entry = None
                if error is None:
                    entry = self._adopted(record, runs)
                else:
                    self.pool.free(runs)
                    self.counters.promotion_failures += 1
                if entry is None:
                    self._miss(ns_name)
                    readers[index] = None
                    continue
                if entry.runs is runs:  # the pages just read: their views serve the get
                    fresh.append(entry)
                    served.append((entry, _value_views(pages, record)))
                else:  # L1 got its own copy while this read ran (a put)
                    served.append((entry, True))
                at.append(index)
            views.clear()
            entries.link_many(fresh)
            self.counters.promotions += len(fresh)
            self.counters.l2_hits += len(fresh)
            readers.update(zip(at, self._readers(served, TIER_L2), strict=True))
            return taken
        finally:
            views.clear()
            for _, _, runs in batch:  # not read: cancelled, or the backend failed
                self.pool.free(runs)
            for pk in promotions:
                del under_way[pk]
            done.set_result(None)

    def l2_only(self, ns_name: str, key: bytes) -> L2Record | None:
        """The L2 record of a value that is not in L1 and not being read into
        it, for ``read_l2_into``. None as well for a value read that way
        recently: read again, it is being reused, and the get promotes it."""
        check_key(key)
        if (ns_name, key) in self.promotions:
            return None
        if self.entries.get(ns_name, key) is not None:
            return None
        if (ns_name, key) in self._direct_reads:
            del self._direct_reads[(ns_name, key)]
            return None
        return self.l2.lookup(ns_name, key)

    async def read_l2_into(self, record: L2Record, dst: memoryview) -> bool:
        """Read an L2-only value straight into ``dst`` (``record.read_bytes``
        long, 4 KiB-aligned memory, e.g. a client's shared-memory region),
        checked against its checksum; L1 is left as it was. False when the
        read failed: the record is dropped and the get is a miss."""
        try:
            await self.l2.read(record, [dst])
        except (ChecksumMismatch, IoError):
            self.counters.promotion_failures += 1
            self._miss(record.namespace)
            return False
        ns = self.entries.namespace(record.namespace)
        ns.hits += 1
        self.counters.hits += 1
        self.counters.l2_hits += 1
        self.counters.bytes_out += record.size
        self._direct_reads[(record.namespace, record.key)] = None
        if len(self._direct_reads) > DIRECT_READS_REMEMBERED:
            self._direct_reads.popitem(last=False)
        return True

    async def prefetch(self, record: L2Record) -> None:
        if (
            record.live
            and self.entries.get(record.namespace, record.key) is None
            and (record.namespace, record.key) not in self.promotions
        ):
            await self.promote(record)

    async def promote(self, record: L2Record) -> Entry | None:
        done = asyncio.get_running_loop().create_future()
        self.promotions[(record.namespace, record.key)] = done
        try:
            runs = self.entries.alloc_now(record.size) or await self.entries.alloc(record.size)
            try:
                await self.l2.read(record, self.pool.views(runs, record.read_bytes))
            except (ChecksumMismatch, IoError):
                self.pool.free(runs)
                self.counters.promotion_failures += 1
                return None
            except BaseException:
                self.pool.free(runs)
                raise
            return self._adopt(record, runs)
        finally:
            del self.promotions[(record.namespace, record.key)]
            done.set_result(None)

    def _adopt(self, record: L2Record, runs: list[Run]) -> Entry | None:
        """Link a value read from L2 into ``runs`` into L1 (or free them)."""
        entry = self._adopted(record, runs)
        if entry is not None and entry.runs is runs:
            self.entries.link(entry)
            self.counters.promotions += 1
            self.counters.l2_hits += 1
        return entry

    def _adopted(self, record: L2Record, runs: list[Run]) -> Entry | None:
        """The entry for a value read from L2 into ``runs``, not linked yet;
        or L1's copy, or None, the pages freed."""
        current = self.entries.get(record.namespace, record.key)
        if current is not None or not record.live:
            # A put landed meanwhile (same bytes, keys are write-once) or a
            # delete removed the key: use L1's copy, or miss.
            self.pool.free(runs)
            return current
        ns = self.entries.namespace(record.namespace)
        return Entry(ns, record.key, record.size, record.checksum, record.meta, runs,
                     record.parent or None, l2=record)  # fmt: skip

    async def withdraw(self, entry: Entry) -> None:
        """Take back a put that was not acknowledged: no copy of it stays visible."""
        if entry.linked:
            entry.deleted = True
            self.entries.unlink(entry)
        if entry.l2 is not None:
            # The index forgets the record first; the tombstone is best effort
            # (the disk just failed) and only guards a restart.
            with contextlib.suppress(IoError):
                await self.l2.delete_record(entry.l2)

    def on_l2_drop(self, record: L2Record) -> None:
        """L2 forgot a record (reclaim, bad checksum): an L1 copy stays in L1,
        clean (evictable, as before), and is written again if write-back's
        rewrite credit allows (``reinsert``). It is not marked dirty: a dirty
        value cannot leave L1, and re-queueing every one made each reclaim
        force the next."""
        entry = self.entries.get(record.namespace, record.key)
        if entry is not None and entry.l2 is record:
            entry.l2 = None
            if self._reinsert(entry):
                self.counters.l2_reinserted += 1


def _value_views(views: list[memoryview], record: L2Record) -> list[memoryview]:
    """The views a read of ``record`` filled (``record.read_bytes``, whole
    blocks) cut to the value's ``size``: the last one loses the tail block's
    padding, which is under a block and so shorter than it."""
    cut = record.read_bytes - record.size
    if cut:
        last = views[-1]
        views[-1] = last[: len(last) - cut]
    return views
