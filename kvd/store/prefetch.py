"""Prefetch from L2: a Lookup that hits values only on SSD starts reading
them into L1 at once, in parallel, so the Gets that follow find them in
DRAM (or join the read already under way) instead of reading one chunk at
a time behind each Get.

Bounded: at most ``PARALLEL`` reads at once, at most ``QUEUED_MAX`` waiting;
past that a lookup's prefetches are dropped (a Get still reads the value
itself). A prefetched value is a normal clean L1 entry, evictable as any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("kvd.store.prefetch")

# L2 reads a prefetch keeps in flight: the disk's queue depth sweet spot
# here is 8-32 for 1-4 MiB reads (kvd bench l2), and each read pins one
# value's pages in L1 while it runs.
PARALLEL = 8
QUEUED_MAX = 256


class Prefetcher:
    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(PARALLEL)
        self._tasks: set[asyncio.Task[None]] = set()
        self.started = 0
        self.dropped = 0

    def schedule(self, reads: Sequence[Callable[[], Awaitable[object]]]) -> None:
        """Start ``reads`` in the background (call on the event loop)."""
        for read in reads:
            if len(self._tasks) >= QUEUED_MAX:
                self.dropped += 1
                continue
            task = asyncio.get_running_loop().create_task(self._run(read))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.started += 1

    async def _run(self, read: Callable[[], Awaitable[object]]) -> None:
        async with self._slots:
            try:
                await read()
            except Exception:  # a prefetch is only a hint: the Get will read (and report) itself
                log.debug("prefetch failed", exc_info=True)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
