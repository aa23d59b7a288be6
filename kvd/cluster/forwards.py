"""Puts handed on to their owner (kvd.cluster.router): a put lands on the
daemon the engine reached and is answered there; if another member owns the
key, the value goes to it in the background, so a lookup from any node
finds it.

Each owner has a queue and one sender: an owner gets its puts in the order
they were made, a chain's blocks in order, as its eviction policy expects
them (``density`` marks the block a chain is being filled up to). The
sender takes up to ``FORWARD_BATCH_MAX`` waiting puts (``FORWARD_BATCH_BYTES``)
and sends them on one connection to the owner's bulk port, one PUT frame
after the other, each from the value's L1 pages, then reads their answers
(``PeerReads.put_many``); where the owner is reached only over gRPC (the
``grpc`` transport, a bulk port on loopback) each goes as a BatchPut of a
copy, in order.

Measured (a scratch script: puts of values one member of two owns, through
the other, in network namespaces, timed until the owner held them all):
over gRPC a 4 MiB value cost the owner 7.7-9.2 ms of CPU and the member 5.3
ms (the engine's put included), at 0.44-0.52 GB/s. Over the bulk port, four
puts at once on four connections reached 2.2 GB/s at 0.9-1.1 ms and 1.4 ms,
but landed out of order: in ``kvd bench pool``'s replay (the first 3,000
requests) the pool then hit 4.2 % against one daemon's 9.5 %; one put at a
time in order hit 8.5 %, at 1.3 GB/s; batches in order on one connection
9.25 % (the simulator 9.29 %), at 1.9 GB/s, 1.6 and 1.3 ms of CPU.

Bounded: at most ``FORWARD_QUEUE_MAX`` puts wait in all (past it the owner
does not get the value, counted in ``dropped``, as is a value not pinned
and evicted before its turn), and at most
``FORWARD_SENDING_MAX`` owners are sent a batch at once (each batch's
values held while it goes).
A waiting value is pinned (a guest goes first otherwise) while the pinned
bytes stay within ``FORWARD_PIN_FRACTION`` of L1; past that a forward reads
the value when its turn comes, if it is still here (else counted in
``dropped``). A value deleted before its turn is not sent; one whose owner
is down, fails or refuses it counts in ``errors``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd.cluster.peer_reads import PeerReads
from kvd.cluster.peers import PeerError, Peers
from kvd.cluster.pinned import PinShare
from kvd.store.index import Entry, Reader
from kvd.store.store import Store

# Puts waiting to reach their owners, in all; a burst past it is dropped
# (the put is still here), since queuing without end would hold up to this
# many values' worth of L1 pages pinned by readers later.
FORWARD_QUEUE_MAX = 4096
# Puts one owner gets in one go (one connection, frames back to back), and
# their bytes at most (a larger value goes alone).
FORWARD_BATCH_MAX = 16
FORWARD_BATCH_BYTES = 16 << 20
# Owners sent a batch at once: the values of a batch are held (pinned)
# while it goes, so at most this many batches' worth, whatever the members.
FORWARD_SENDING_MAX = 4
# A forward is background work: it may take longer than a caller's lookup
# (64 MiB over loopback gRPC takes ~70 ms), but not for ever.
FORWARD_TIMEOUT_S = 10.0
# Part of L1 that values waiting for their forward may keep pinned.
FORWARD_PIN_FRACTION = 0.25


Taken = Callable[[Entry], None]


@dataclass
class Waiting:
    """A put waiting for its owner: the value's key, size, its reader
    where it was pinned at the put, and who is told once the owner took it."""

    namespace: str
    key: bytes
    size: int
    pinned: Reader | None
    taken: Taken | None = None


@dataclass
class Going:
    """A put of the batch being sent: its reader, whether it was pinned at
    the put, who is told once the owner took it, and the value's history in
    this member's eviction policy (None for a guest: not in it)."""

    reader: Reader
    pinned: bool
    taken: Taken | None
    history: bytes | None = None


class Forwards:
    """The queue of puts to hand on to each owner, and its sender."""

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
        self._queues: dict[str, collections.deque[Waiting]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._sending = asyncio.Semaphore(FORWARD_SENDING_MAX)
        self._waiting = 0
        # The values waiting in the queues that are pinned (their pages sent).
        self._pins = PinShare(store.peek, int(store.pool.capacity_bytes * FORWARD_PIN_FRACTION))
        self.sent = 0
        self.errors = 0
        self.dropped = 0
        # This member is leaving the pool: every owner keeps what it is sent
        # as its own (it owns it once this one is gone).
        self.leaving = False

    def start(self) -> None:
        """Nothing to start: a sender starts with its owner's first put."""

    def tasks(self) -> list[asyncio.Task[None]]:
        return [task for task in self._senders.values() if not task.done()]

    def close(self) -> None:
        """Give back what the queued puts pin (after the senders stopped)."""
        for queue in self._queues.values():
            while queue:
                waiting = queue.popleft()
                if waiting.pinned is not None:
                    self._release(waiting.pinned, pinned=True)
        self._waiting = 0

    def waiting(self) -> int:
        return self._waiting

    def can_pin(self, size: int) -> bool:
        """Whether a value of ``size`` bytes queued now would be pinned
        while it waits (within ``FORWARD_PIN_FRACTION`` of L1), or nothing
        is pinned (a value larger than the share goes unpinned, alone)."""
        return self._pins.has_room(size) or not self._pins.bytes

    def put(self, entry: Entry, owner: str, taken: Taken | None = None) -> None:
        """Queue ``entry``'s value for ``owner``; ``taken(entry)`` once the
        owner took it (not when it refused it, failed or the put was dropped)."""
        if self._waiting >= FORWARD_QUEUE_MAX:
            self.dropped += 1
            return
        # A guest goes first: pinned, it waits for its forward.
        reader = self._pins.pin(entry.ns.name, entry.key, size=entry.size)
        queue = self._queues.setdefault(owner, collections.deque())
        queue.append(Waiting(entry.ns.name, entry.key, entry.size, reader, taken))
        self._waiting += 1
        sender = self._senders.get(owner)
        if sender is None or sender.done():
            self._senders[owner] = asyncio.get_running_loop().create_task(
                self._send_all(owner, queue), name=f"kvd-pool-forward-{owner}"
            )

    def _release(self, reader: Reader, *, pinned: bool) -> None:
        """Close a forward's reader; one pinned since the put gives its bytes back."""
        if pinned:
            self._pins.release(reader)
        else:
            reader.close()

    async def _send_all(self, owner: str, queue: collections.deque[Waiting]) -> None:
        """Send ``owner`` its queue, a batch at a time, in order."""
        while queue:
            async with self._sending:
                batch = self._next_batch(queue)
                try:
                    if batch and self._is_down(owner):
                        self.errors += len(batch)
                    elif batch:
                        taken = await self._send(owner, batch)
                        for going, took in zip(batch, taken, strict=True):
                            if took and going.taken is not None:
                                going.taken(going.reader.entry)
                except PeerError as error:
                    self.errors += len(batch)
                    self._failed(error, owner)
                finally:
                    for going in batch:
                        self._release(going.reader, pinned=going.pinned)

    def _next_batch(self, queue: collections.deque[Waiting]) -> list[Going]:
        """The next puts to send, their values open (a value deleted or
        evicted before its turn is left out, not an error)."""
        batch: list[Going] = []
        size = 0
        while queue and len(batch) < FORWARD_BATCH_MAX:
            if batch and size + queue[0].size > FORWARD_BATCH_BYTES:
                break
            waiting = queue.popleft()
            self._waiting -= 1
            reader = waiting.pinned or self._store.peek(waiting.namespace, waiting.key)
            if reader is None:
                self.dropped += 1  # not pinned, and evicted before its turn
                continue
            if not reader.entry.linked:
                self._release(reader, pinned=waiting.pinned is not None)
                continue
            entry = reader.entry  # its history as it goes: lookups since its put count
            history = None if entry.guest else self._store.shares.history(entry)
            batch.append(Going(reader, waiting.pinned is not None, waiting.taken, history))
            size += waiting.size
        return batch

    async def _send(self, owner: str, batch: list[Going]) -> list[bool]:
        """The values to their owner: on its bulk port straight from their
        pages (with their histories), else a gRPC BatchPut of a copy each;
        whether it took each (one refused counts in ``errors``)."""
        deadline = time.monotonic() + FORWARD_TIMEOUT_S
        readers = [going.reader for going in batch]
        histories = [going.history for going in batch]
        taken = await self._reads.put_many(
            owner, readers, FORWARD_TIMEOUT_S, histories, keep=self.leaving
        )
        if taken is None:  # over gRPC
            taken = []
            for reader in readers:
                entry = reader.entry
                value = b"".join(reader.views)
                left_s = deadline - time.monotonic()
                try:
                    await self._peers.put(
                        owner, entry.ns.name, entry.key, value, reader.meta, entry.parent,
                        reader.checksum, left_s,
                    )  # fmt: skip
                except PeerError as error:
                    if error.kind != "refused":
                        raise
                    taken.append(False)
                else:
                    taken.append(True)
        refused = taken.count(False)
        self.errors += refused
        self.sent += len(taken) - refused
        return taken
