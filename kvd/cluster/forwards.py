"""Puts handed on to their owner (kvd.cluster.router): a put lands on the
daemon the engine reached and is answered there; if another member owns the
key, the value goes to it in the background, so a lookup from any node
finds it: a PUT on the owner's bulk port sent from the value's L1 pages
(``PeerReads.put``), or where the owner is reached only over gRPC (the
``grpc`` transport, a bulk port on loopback) a BatchPut of a copy. Over
gRPC a forwarded 4 MiB value cost the owner 7.7-9.2 ms of CPU and this
daemon 5.3 ms (with the engine's put), and reached it at 0.44-0.52 GB/s.

Bounded: at most ``FORWARD_QUEUE_MAX`` puts wait (past it the owner does not
get the value, counted in ``dropped``) and ``FORWARD_WORKERS`` are in
flight or waiting for their owner, each holding one value. An owner gets its puts one
at a time, in the order they were made: a chain's blocks in order, as its
eviction policy expects them (``density`` marks the block a chain is being
filled up to). Over the bulk port, four puts to one owner on four
connections at once could land out of order: in ``kvd bench pool``'s
replay (the first 3,000 requests) the pool then hit 4.2 % against one
daemon's 9.5 %, and 8.6 % once in order. A waiting value is pinned (a
guest goes first otherwise) while the pinned bytes stay within
``FORWARD_PIN_FRACTION`` of L1; past that a forward reads the value when its
turn comes, if it is still here. A value deleted before its turn is not
sent; one whose owner is down or fails counts in ``errors``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvd.cluster.peer_reads import PeerReads
from kvd.cluster.peers import PeerError, Peers
from kvd.store.index import Entry, Reader
from kvd.store.store import Store

# Puts waiting to reach their owner; a burst past it is dropped (the put is
# still here), since queuing without end would hold up to this many values'
# worth of L1 pages pinned by readers later.
FORWARD_QUEUE_MAX = 4096
# Forwards in flight at once: each holds one value (<= max_value_bytes)
# pinned while it goes out on the owner's bulk port, or a copy for gRPC.
FORWARD_WORKERS = 4
# A forward is background work: it may take longer than a caller's lookup
# (64 MiB over loopback gRPC takes ~70 ms), but not for ever.
FORWARD_TIMEOUT_S = 10.0
# Part of L1 that values waiting for their forward may keep pinned.
FORWARD_PIN_FRACTION = 0.25


class Forwards:
    """The queue of puts to hand on, and its workers."""

    def __init__(
        self,
        store: Store,
        peers: Peers,
        reads: PeerReads,
        is_down: Callable[[str], bool],
        failed: Callable[[PeerError, str], None],
    ) -> None:
        """``is_down(member)``: skip it now; ``failed``: a call to a member failed."""
        self._store = store
        self._peers = peers
        self._reads = reads
        self._is_down = is_down
        self._failed = failed
        self._queue: asyncio.Queue[tuple[str, bytes, str, Reader | None]] = asyncio.Queue(
            FORWARD_QUEUE_MAX
        )
        self._pinned = 0  # bytes of the values in the queue it pins
        self._pin_max = int(store.pool.capacity_bytes * FORWARD_PIN_FRACTION)
        self._workers: list[asyncio.Task[None]] = []
        self._order: dict[str, asyncio.Lock] = {}  # per owner: its puts one at a time, in order
        self.sent = 0
        self.errors = 0
        self.dropped = 0

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._loop(), name=f"kvd-pool-forward-{i}")
            for i in range(FORWARD_WORKERS)
        ]

    def tasks(self) -> list[asyncio.Task[None]]:
        return self._workers

    def close(self) -> None:
        """Give back what the queued puts pin (after the workers stopped)."""
        while not self._queue.empty():
            reader = self._queue.get_nowait()[3]
            if reader is not None:
                self._release(reader, pinned=True)

    def waiting(self) -> int:
        return self._queue.qsize()

    def put(self, entry: Entry, owner: str) -> None:
        """Queue ``entry``'s value for ``owner``."""
        reader = None
        if self._pinned + entry.size <= self._pin_max:
            # A guest goes first: pinned, it waits for its forward.
            reader = self._store.peek(entry.ns.name, entry.key)
            self._pinned += entry.size
        try:
            self._queue.put_nowait((entry.ns.name, entry.key, owner, reader))
        except asyncio.QueueFull:
            self.dropped += 1
            if reader is not None:
                self._release(reader, pinned=True)

    def _release(self, reader: Reader, *, pinned: bool) -> None:
        """Close a forward's reader; one pinned since the put gives its bytes back."""
        if pinned:
            self._pinned -= reader.entry.size
        reader.close()

    async def _loop(self) -> None:
        while True:
            namespace, key, owner, pinned = await self._queue.get()
            reader = pinned if pinned is not None else self._store.peek(namespace, key)
            if reader is None:
                continue  # evicted or deleted before its turn
            if not reader.entry.linked or self._is_down(owner):
                # Deleted while it waited (not an error), or the owner is down.
                self.errors += reader.entry.linked
                self._release(reader, pinned=pinned is not None)
                continue
            try:
                # Taken before any wait (asyncio's lock wakes its waiters in
                # order): an owner gets its puts in the order they were made.
                async with self._order.setdefault(owner, asyncio.Lock()):
                    await self._send(owner, namespace, key, reader, pinned is not None)
            except PeerError as error:
                self.errors += 1
                self._failed(error, owner)
                continue
            self.sent += 1

    async def _send(
        self, owner: str, namespace: str, key: bytes, reader: Reader, pinned: bool
    ) -> None:
        """The value to its owner: on its bulk port straight from its pages
        (held until sent), else a gRPC BatchPut of a copy; ``reader`` is
        closed (``pinned``: since the put)."""
        deadline = time.monotonic() + FORWARD_TIMEOUT_S
        try:
            if await self._reads.put(owner, namespace, key, reader, FORWARD_TIMEOUT_S):
                return
            value = b"".join(reader.views)
            sum_, meta, parent = reader.checksum, reader.meta, reader.entry.parent
        finally:
            self._release(reader, pinned=pinned)
        left_s = deadline - time.monotonic()
        await self._peers.put(owner, namespace, key, value, meta, parent, sum_, left_s)
