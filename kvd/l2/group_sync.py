"""Group commit: callers that ask for a sync at about the same time share
one (``L2Tier.sync`` runs each through a ``GroupSync``).

One sync runs at a time. A caller whose ask came before a sync began
returns when that sync ends: every write it completed before asking is
covered. A caller that asked while a sync was already running waits for
its end, then for the next one, which may not be its own; the callers a
sync covers all wake in the same loop turn, so their next writes (durable
puts) go out together again. A failed sync raises for the caller that ran
it; the others it would have covered run their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class GroupSync:
    def __init__(self, run: Callable[[], Awaitable[None]]) -> None:
        self._run = run  # the sync itself (fdatasync of every path)
        self._asked = 0
        self._done = 0  # asks covered by a sync that ended
        self._running = False
        self._waiters: list[asyncio.Future[None]] = []  # for the running sync's end

    async def sync(self) -> None:
        asked = self._asked = self._asked + 1
        while self._done < asked:
            if self._running:  # it may have begun before the ask: wait for its end
                ended = asyncio.get_running_loop().create_future()
                self._waiters.append(ended)
                await ended
                continue
            self._running = True
            try:
                await asyncio.sleep(0)  # callers woken with this one ask first
                covers = self._asked
                await self._run()
                self._done = max(self._done, covers)
            finally:
                self._running = False
                waiters, self._waiters = self._waiters, []
                for ended in waiters:
                    if not ended.done():
                        ended.set_result(None)
