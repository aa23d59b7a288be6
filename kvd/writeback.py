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
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd import crashpoints
from kvd.errors import ResourceExhausted, Unavailable
from kvd.iobackend import IoError
from kvd.l2 import L2Full, L2Tier
from kvd.l2.format import BLOCK_BYTES, align_up

if TYPE_CHECKING:
    from kvd.store import Entry, Store

log = logging.getLogger("kvd.writeback")

# Appends in flight at once: enough to keep a few NVMe queues busy while
# leaving pool pages for puts (each worker pins one value).
WORKERS = 4
# How long a put may wait for write-back to make room in L1.
WAIT_S = 5.0
# After an L2 write error, how long dirty entries may be dropped instead.
BACKOFF_S = 1.0


class WriteBack:
    def __init__(self, store: Store, l2: L2Tier, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.l2 = l2
        self._clock = clock
        self._queue: deque[Entry] = deque()
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._unhealthy_until = 0.0
        self.writing = 0
        self.errors = 0
        self.dropped_unwritten = 0
        self.quota_dropped = 0
        self.last_error = ""

    # ---- state -----------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._clock() >= self._unhealthy_until

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def backlog_bytes(self) -> int:
        return sum(entry.size for entry in self._queue)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = str(exc)
        if self.healthy:
            log.error("L2 write failed; dirty L1 values may be dropped", extra={"error": str(exc)})
        self._unhealthy_until = self._clock() + BACKOFF_S

    # ---- queue -----------------------------------------------------------------
    def start(self) -> None:
        for _ in range(WORKERS):
            self._workers.append(asyncio.create_task(self._work()))

    def enqueue(self, entry: Entry) -> None:
        self._queue.append(entry)
        self._wake.set()

    async def _work(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            if not self.healthy:
                await asyncio.sleep(max(0.0, self._unhealthy_until - self._clock()))
            entry = self._queue.popleft()
            if not entry.dirty or not entry.linked:
                continue
            try:
                await self.write(entry)
            except (IoError, L2Full) as exc:
                self._failed(exc)
                if entry.linked and entry.dirty:
                    self._queue.append(entry)

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
        quota = self.store.limits.namespace_l2_quota_bytes
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

    async def write(self, entry: Entry, *, durable: bool = False) -> None:
        """Append one L1 entry to L2 (its pages pinned meanwhile); raises on failure."""
        await self._within_l2_quota(entry, durable)
        store = self.store
        entry.readers += 1
        self.writing += 1
        try:
            views = store.pool.views(entry.runs, align_up(entry.size, BLOCK_BYTES))
            record = await self.l2.append(
                entry.ns.name, entry.key, entry.parent or b"", entry.meta, entry.size,
                entry.checksum, views,
            )  # fmt: skip
        finally:
            self.writing -= 1
            store._unpin(entry)
            self._progress.set()
        if entry.deleted:
            # Deleted while being written: the record must not outlive the delete.
            await self.l2.delete_record(record)
            return
        entry.l2 = record
        entry.dirty = False

    async def make_durable(self, entry: Entry | None) -> None:
        """Append (unless already on L2) and sync; errors map to kvd error codes."""
        try:
            if entry is not None and entry.dirty:
                await self.write(entry, durable=True)
            await self.l2.sync()
            crashpoints.hit("after_sync")
        except L2Full as exc:
            raise ResourceExhausted(f"durable put: {exc}") from exc
        except IoError as exc:
            self._failed(exc)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(f"durable put: L2 is full ({exc})") from exc
            raise Unavailable(f"durable put: L2 write failed ({exc})") from exc

    async def flush(self, deadline_s: float) -> int:
        """Write what is queued, until ``deadline_s`` (graceful shutdown); the rest left."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while (self._queue or self.writing) and loop.time() < end:
            if not self.healthy and not self.writing:
                break  # the disk is failing: what is queued stays in L1 only
            await self.wait_progress(max(0.01, end - loop.time()))
        return len(self._queue)

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []
