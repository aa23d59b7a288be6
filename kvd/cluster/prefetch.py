"""Values a pool lookup found at their owners, fetched as soon as it answered.

A lookup that leases what it found (``lease_ms``: the connectors' lookups,
an engine about to load the chain) starts reading into L1, in the
background, the values it found held by other members and not here. The
engine's get that follows then finds them in L1, or joins the read already
under way (``PoolRouter._fetch`` shares one read per key), instead of
starting the peer reads only when the engine asks: the owners' round trips
and transfers overlap the engine's own work between its lookup and its load
(scheduling the step, allocating its blocks).

Bounded: a lookup fetches at most the first ``keys_max`` such values of its
chain (``pool_prefetch_keys``; the get reads the rest itself), and at most
``RUNNING_MAX`` lookups' fetches run at once; past that a lookup's are not
started (``dropped``). A prefetch runs on its own time (the peer timeout),
not the lookup's deadline, in a context of its own, and is only a hint: a
value it could not read is the get's to read (or miss), and its failures
count as the reads' own (peer errors), never as the lookup's.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("kvd.cluster")

# Lookups whose values are being fetched at once; the router keeps each
# one's reads to FETCH_PARALLEL_MAX in flight.
RUNNING_MAX = 4

FetchFn = Callable[[str, list[bytes]], Awaitable[None]]


class Prefetches:
    """The lookups' fetches running in the background, bounded."""

    def __init__(self, fetch: FetchFn, keys_max: int) -> None:
        """``fetch(namespace, keys)``: read into L1 those of ``keys`` not here."""
        self._fetch = fetch
        self.keys_max = keys_max
        self._running: set[asyncio.Task[None]] = set()
        self.values = 0  # values lookups started fetching
        self.dropped = 0  # lookups whose values were not fetched: RUNNING_MAX ran

    def start(self, namespace: str, keys: list[bytes]) -> None:
        """Fetch the first ``keys_max`` of ``keys`` in the background (call on the loop)."""
        if not keys or not self.keys_max:
            return
        if len(self._running) >= RUNNING_MAX:
            self.dropped += 1
            return
        keys = keys[: self.keys_max]
        self.values += len(keys)
        # A context of its own: not the lookup's deadline or hop (kvd.cluster.scope).
        task = asyncio.get_running_loop().create_task(
            self._run(namespace, keys), context=contextvars.Context()
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._running)

    async def _run(self, namespace: str, keys: list[bytes]) -> None:
        try:
            await self._fetch(namespace, keys)
        except Exception:  # a hint only: the get reads (and reports) on its own
            log.debug("prefetch failed", exc_info=True)
