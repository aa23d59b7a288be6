"""Write-back from L1 to L2.

A put is acknowledged once it is in L1; its entry is then queued here and a
few workers append it to the L2 log. A durable put skips the queue: its
writer appends and syncs before the put returns. The queue holds at most
what L1 holds (dirty entries cannot be evicted), so it is bounded by
``dram_bytes``; when L1 is all dirty, a put waits here for progress, up to
``WAIT_S``, then gets RESOURCE_EXHAUSTED.

When L2 writes fail (EIO, ENOSPC, no reclaimable segment) the tier is marked
unhealthy for ``BACKOFF_S``: dirty entries may then be evicted from L1
(dropped, and counted) so the daemon keeps serving, and the queue is retried
afterwards. Writes resume by themselves once the device answers again.

Rewrites. When L2 reclaims a segment, a record whose value is still in L1
may be written again (reinsertion of hot blocks). Each rewrite spends
credit that only first writes earn (``REWRITE_RATIO`` of their bytes, at
most ``REWRITE_CREDIT_SEGMENTS`` segments banked), so L2 value writes stay
within (1 + REWRITE_RATIO) x the bytes put, plus the bank, and a daemon
that gets no puts stops writing. Without one, every reclaimed record still
in L1 was written again, each rewrite filled L2 and forced the next reclaim:
an idle daemon whose L1 held more than L2 kept rewriting at the device's
full bandwidth (2 GB/s, 483x the bytes put, measured on a 48 MiB L1 over a
32 MiB L2). A record that is not rewritten leaves its value in L1 only: it
is evicted like any other and then gone, as a cache may.

Write-back holds an entry's pages while it writes them through the ``pin``
and ``unpin`` it is given (the L1 index's), never through the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import Callable

from kvd.io.backend import IoError
from kvd.l1.pool import Pool
from kvd.l2 import L2Full, L2Record, L2Tier
from kvd.l2.format import BLOCK_BYTES, align_up
from kvd.l2.records import Append
from kvd.store.index import Entry
from kvd.util import crashpoints
from kvd.wire.errors import ResourceExhausted, Unavailable

log = logging.getLogger("kvd.store.writeback")

# Appends in flight at once: enough to keep a few NVMe queues busy while
# leaving pool pages for puts (each worker pins the values of one batch).
WORKERS = 4
# A worker takes what is queued, up to this many values and bytes (at least
# one value), and appends them with one submission: one ring call for a
# batch of small values instead of one each.
BATCH_VALUES_MAX = 32
BATCH_BYTES_MAX = 4 << 20
# How long a put may wait for write-back to make room in L1.
WAIT_S = 5.0
# After an L2 write error, how long dirty entries may be dropped instead.
BACKOFF_S = 1.0
# Rewrites may add at most half the bytes of first writes: L2 value writes
# stay within 1.5x the bytes put. CacheLib's BlockCache reinserts hot items
# on the same order (its reinsertion percentage is typically 0-50 %).
REWRITE_RATIO = 0.5
# Credit banked while no record needs a rewrite, in logical segments: one
# segment of rewrites can force at most one more reclaim, so an idle daemon
# writes at most this much after its last put.
REWRITE_CREDIT_SEGMENTS = 1


# Why an append of an entry failed (write_many).
WriteError = IoError | L2Full | ResourceExhausted


class DurableNoRoom(ResourceExhausted):
    """A durable put found L2 full: no reclaimable segment, or ENOSPC/EDQUOT
    (``errno``, 0 for the former). RESOURCE_EXHAUSTED, as the registry in
    ``kvd.wire.errors`` maps its parent."""

    def __init__(self, message: str, errno_code: int = 0) -> None:
        super().__init__(message)
        self.errno = errno_code


class DurableWriteFailed(Unavailable):
    """A durable put's L2 write or sync failed with ``errno`` (EIO, ...);
    UNAVAILABLE, as the registry maps its parent."""

    def __init__(self, message: str, errno_code: int) -> None:
        super().__init__(message)
        self.errno = errno_code


class WriteBack:
    def __init__(
        self,
        l2: L2Tier,
        pool: Pool,
        pin: Callable[[Entry], None],
        unpin: Callable[[Entry], None],
        namespace_l2_quota_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        cleaned: Callable[[Entry], None] = lambda entry: None,
        failing: Callable[[], None] = lambda: None,
    ) -> None:
        self.l2 = l2
        self.pool = pool
        self._pin = pin
        self._unpin = unpin
        self._cleaned = cleaned  # told of each value that reached L2 (Entries.cleaned)
        self._failing = failing  # told when a failure starts a backoff (Entries.l2_failing)
        self.namespace_l2_quota_bytes = namespace_l2_quota_bytes  # 0: no quota
        self._clock = clock
        self._queue: deque[Entry] = deque()  # dirty: not yet on L2
        self._rewrites: deque[Entry] = deque()  # clean, L2 record reclaimed
        self._rewrite_credit_bytes = 0.0
        self._rewrite_credit_max_bytes = REWRITE_CREDIT_SEGMENTS * l2.devices.logical_segment_bytes
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        # Durable puts of this loop turn, appended together (_write_durable).
        self._durable: list[tuple[Entry, asyncio.Future[None]]] = []
        self._durable_tasks: set[asyncio.Task[None]] = set()
        self._unhealthy_until = 0.0
        self.writing = 0
        self.errors = 0
        self.dropped_unwritten = 0
        self.quota_dropped = 0
        self.over_quota = 0  # values left in L1 only: larger than their namespace's L2 quota
        self.first_write_bytes = 0  # value bytes of puts written to L2
        self.rewrite_bytes = 0  # value bytes written again after a reclaim
        self.rewrites = 0
        self.rewrites_skipped = 0  # out of credit: left in L1 only
        self.last_error = ""

    # ---- state -----------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._clock() >= self._unhealthy_until

    @property
    def queue_depth(self) -> int:
        return len(self._queue) + len(self._rewrites)

    @property
    def backlog_bytes(self) -> int:
        return sum(entry.size for entry in self._queue) + sum(e.size for e in self._rewrites)

    def stats(self) -> dict[str, int]:
        return {
            "writeback_queue": self.queue_depth,
            "writeback_writing": self.writing,
            "writeback_errors": self.errors,
            "l1_dropped_unwritten": self.dropped_unwritten,
            "l2_first_write_bytes": self.first_write_bytes,
            "l2_rewrite_bytes": self.rewrite_bytes,
            "l2_rewrites": self.rewrites,
            "l2_rewrites_skipped": self.rewrites_skipped,
        }

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = str(exc)
        if self.healthy:
            log.error("L2 write failed; dirty L1 values may be dropped", extra={"error": str(exc)})
        self._unhealthy_until = self._clock() + BACKOFF_S
        self._failing()

    # ---- queue -----------------------------------------------------------------
    def start(self) -> None:
        for _ in range(WORKERS):
            self._workers.append(asyncio.create_task(self._work()))

    def enqueue(self, entry: Entry) -> None:
        self._queue.append(entry)
        self._wake.set()

    def reinsert(self, entry: Entry) -> bool:
        """Queue a clean L1 value whose L2 record was dropped for a rewrite,
        if credit allows; False leaves it in L1 only."""
        if self._rewrite_credit_bytes < entry.size:
            self.rewrites_skipped += 1
            return False
        self._rewrite_credit_bytes -= entry.size
        self._rewrites.append(entry)
        self._wake.set()
        return True

    async def _next(self) -> list[Entry]:
        """The next entries to write (``BATCH_VALUES_MAX``, ``BATCH_BYTES_MAX``),
        dirty ones before rewrites; evicted, deleted and already written
        ones are dropped on the way."""
        while True:
            while not self._queue and not self._rewrites:
                self._wake.clear()
                await self._wake.wait()
            if not self.healthy:
                await asyncio.sleep(max(0.0, self._unhealthy_until - self._clock()))
            batch: list[Entry] = []
            nbytes = 0
            for queue in (self._queue, self._rewrites):
                while queue and len(batch) < BATCH_VALUES_MAX:
                    entry = queue[0]
                    if batch and nbytes + entry.size > BATCH_BYTES_MAX:
                        break
                    queue.popleft()
                    if _unwritten(entry):
                        batch.append(entry)
                        nbytes += entry.size
            if batch:
                # Every worker may sleep through a backoff; the first ones
                # awake take what was queued.
                return batch

    async def _work(self) -> None:
        while True:
            entries = await self._next()
            for entry, error in zip(entries, await self.write_many(entries), strict=True):
                if error is None:
                    continue
                if isinstance(error, ResourceExhausted):  # over its namespace's L2 quota
                    self.over_quota += 1
                    if entry.dirty:  # left in L1 only, evicted like a clean value
                        entry.dirty = False
                        self._cleaned(entry)
                    continue
                self._failed(error)
                if entry.linked and entry.dirty:
                    self._queue.append(entry)
                elif entry.linked and entry.l2 is None:
                    self._rewrites.append(entry)

    async def wait_progress(self, timeout_s: float = WAIT_S) -> bool:
        """Wait until an append finishes; False after ``timeout_s`` without one."""
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def can_make_progress(self) -> bool:
        return bool(self._queue) or self.writing > 0

    # ---- one append ------------------------------------------------------------
    async def _within_l2_quota(self, entry: Entry, durable: bool) -> None:
        """Drop the namespace's oldest L2 records to fit ``entry``; durable puts are refused."""
        quota = self.namespace_l2_quota_bytes
        if not quota:
            return
        name = entry.ns.name
        need = align_up(entry.size + 2 * BLOCK_BYTES, 64 * 1024)
        while self.l2.namespace_bytes.get(name, 0) + need > quota:
            oldest = self.l2.oldest(name)
            if durable or oldest is None:
                raise ResourceExhausted(f"namespace {name!r} is at its L2 quota ({quota} bytes)")
            await self.l2.delete_record(oldest)
            self.quota_dropped += 1

    async def write_many(
        self, entries: list[Entry], *, durable: bool = False
    ) -> list[WriteError | None]:
        """Append L1 entries to L2 in one submission, each within its
        namespace's L2 quota, their pages pinned meanwhile; each one's error
        (ResourceExhausted: over the quota with nothing to drop, or durable),
        or None (written, or gone while the quota's deletes ran)."""
        refused: dict[int, WriteError] = {}
        for entry in entries:
            try:
                await self._within_l2_quota(entry, durable)
            except ResourceExhausted as exc:
                refused[id(entry)] = exc
        live = [e for e in entries if _unwritten(e) and id(e) not in refused]
        for entry in live:
            self._pin(entry)
        self.writing += len(live)
        try:
            outcomes = await self.l2.append_many([self._append_of(entry) for entry in live])
        finally:
            self.writing -= len(live)
            for entry in live:
                self._unpin(entry)
            self._progress.set()
        for entry, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, L2Record):
                await self._written(entry, outcome)
            else:
                refused[id(entry)] = outcome
        return [refused.get(id(entry)) for entry in entries]

    def _append_of(self, entry: Entry) -> Append:
        views = self.pool.views(entry.runs, align_up(entry.size, BLOCK_BYTES))
        ns, parent = entry.ns.name, entry.parent or b""
        return Append(ns, entry.key, parent, entry.meta, entry.size, entry.checksum, views)

    async def _written(self, entry: Entry, record: L2Record) -> None:
        """``entry`` is on L2 as ``record``: count it, and mark it clean."""
        if entry.dirty:
            self.first_write_bytes += entry.size
            self._rewrite_credit_bytes = min(
                self._rewrite_credit_max_bytes,
                self._rewrite_credit_bytes + REWRITE_RATIO * entry.size,
            )
        else:
            self.rewrite_bytes += entry.size
            self.rewrites += 1
        if entry.deleted:
            # Deleted while being written: the record must not outlive the delete.
            await self.l2.delete_record(record)
            return
        entry.l2 = record
        if entry.dirty:
            entry.dirty = False
            self._cleaned(entry)

    async def make_durable(self, entry: Entry | None) -> None:
        """Append (unless already on L2) and sync. Failures are ``DurableNoRoom``
        or ``DurableWriteFailed``, keeping the errno; their codes come from the
        error registry, where every transport maps errors."""
        try:
            # Clean without a record: its record was reclaimed and not rewritten.
            if entry is not None and (entry.dirty or entry.l2 is None):
                await self._write_durable(entry)
            await self.l2.sync()
            crashpoints.hit("after_sync")
        except L2Full as exc:
            raise DurableNoRoom(f"durable put: {exc}") from exc
        except IoError as exc:
            self._failed(exc)
            code = exc.errno or errno.EIO
            if code in (errno.ENOSPC, errno.EDQUOT):
                raise DurableNoRoom(f"durable put: L2 is full ({exc})", code) from exc
            raise DurableWriteFailed(f"durable put: L2 write failed ({exc})", code) from exc

    async def _write_durable(self, entry: Entry) -> None:
        """Append a durable put's entry together with the other durable puts
        of this loop turn (one submission, as their sync is one); raises its
        own failure."""
        loop = asyncio.get_running_loop()
        written: asyncio.Future[None] = loop.create_future()
        self._durable.append((entry, written))
        if len(self._durable) == 1:
            loop.call_soon(self._start_durable)
        await written

    def _start_durable(self) -> None:
        batch, self._durable = self._durable, []
        task = asyncio.get_running_loop().create_task(self._durable_batch(batch))
        self._durable_tasks.add(task)
        task.add_done_callback(self._durable_tasks.discard)

    async def _durable_batch(self, batch: list[tuple[Entry, asyncio.Future[None]]]) -> None:
        try:
            errors = await self.write_many([entry for entry, _ in batch], durable=True)
        except asyncio.CancelledError:  # write-back closing
            _fail_all(batch, IoError(errno.ECANCELED, "durable put: write-back closed"))
            raise
        except Exception as exc:  # each waiting put raises it
            _fail_all(batch, exc)
            return
        for (_, written), error in zip(batch, errors, strict=True):
            if written.done():
                continue  # its put was cancelled meanwhile
            if error is None:
                written.set_result(None)
            else:
                written.set_exception(error)

    async def flush(self, deadline_s: float) -> int:
        """Write what is queued, until ``deadline_s`` (graceful shutdown); the rest left."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while (self._queue or self._rewrites or self.writing) and loop.time() < end:
            if not self.healthy and not self.writing:
                break  # the disk is failing: what is queued stays in L1 only
            await self.wait_progress(max(0.01, end - loop.time()))
        return self.queue_depth

    async def close(self) -> None:
        for task in [*self._workers, *self._durable_tasks]:
            task.cancel()
        for task in [*self._workers, *self._durable_tasks]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []


def _unwritten(entry: Entry) -> bool:
    """Whether ``entry`` still needs an append: in L1, and dirty, or clean
    with its record reclaimed (a rewrite)."""
    return entry.linked and (entry.dirty or entry.l2 is None)


def _fail_all(batch: list[tuple[Entry, asyncio.Future[None]]], error: Exception) -> None:
    """Fail the waiting puts of a durable batch with ``error``."""
    for _, written in batch:
        if not written.done():
            written.set_exception(error)
