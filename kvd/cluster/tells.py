"""Lookups told to the owners that were not asked about them, for their
eviction policies to learn from (kvd.cluster.router): queued per owner and
sent in the background, those queued while one was on its way together in
one PEER_TELL frame, which is not answered (docs/bulk-protocol.md).

Before, each such lookup was a PEER_EXISTS of its own whose answer nobody
needed: on the development VM (2 CPUs, five daemons) a lookup answered from
the owners' recent answers (kvd.cluster.hints) still cost the asking member
and the owners as much CPU as one that asked them, and that work, not the
waiting, set the lookups' pace. An owner that takes no PEER_TELL (DescribePaths'
``bulk_ops`` without ``tell``, or one read over gRPC) is sent one Exists per
lookup as before.

Bounded: at most ``TELLS_MAX`` lookups wait per owner; past it a lookup is
not told, and counted (``kvd_cluster_tells_dropped``), as are the lookups
queued for an owner when a call to it fails. Order is kept per owner:
its policy's clock counts lookups (``ChainShare.untold``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from kvd.cluster.peer_reads import PeerReads
from kvd.cluster.peers import PeerError
from kvd.wire.bulk import TELL_SHARES_MAX
from kvd.wire.lookup import ChainShare

# Lookups waiting to be told to one owner; past it a lookup is not told.
TELLS_MAX = 1024
# Frames to one owner start at least this far apart: lookups that come
# faster wait and go together (an owner's CPU per told lookup is mostly the
# kernel waking it for a frame); a lookup told after a quiet spell goes at once.
TELL_GAP_S = 0.002

Told = tuple[str, list[bytes], ChainShare]  # namespace, the owner's keys, their share
AskFn = Callable[[str, str, list[bytes], float, ChainShare], Awaitable[list[bool]]]


class Tells:
    """The queue of lookups to tell each owner, and its sender."""

    def __init__(
        self,
        reads: PeerReads,
        ask: AskFn,
        failed: Callable[[PeerError, str], None],
        timeout_s: float,
        max_keys: int,
    ) -> None:
        """``ask(owner, namespace, keys, timeout_s, chain)``: an Exists, for
        an owner that takes no PEER_TELL; ``failed``: a call to an owner failed."""
        self._reads = reads
        self._ask = ask
        self._failed = failed
        self._timeout_s = timeout_s
        self._max_keys = max_keys
        self._queues: dict[str, collections.deque[Told]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._sent_at: dict[str, float] = {}  # when the last frame to each owner left
        self.dropped = 0  # lookups not told: a full queue, or the owner failed

    def tell(self, owner: str, namespace: str, keys: list[bytes], chain: ChainShare) -> bool:
        """Queue a lookup's share for ``owner``; False where its queue is full."""
        queue = self._queues.setdefault(owner, collections.deque())
        if len(queue) >= TELLS_MAX:
            self.dropped += 1
            return False
        queue.append((namespace, keys, chain))
        sender = self._senders.get(owner)
        if sender is None or sender.done():
            sender = asyncio.get_running_loop().create_task(self._send(owner, queue))
            self._senders[owner] = sender
        return True

    def retain(self, members: tuple[str, ...]) -> None:
        """Forget the queues of members gone (a sender still running drains its own)."""
        self._queues = {m: queue for m, queue in self._queues.items() if m in members}
        self._sent_at = {m: at for m, at in self._sent_at.items() if m in members}

    def tasks(self) -> list[asyncio.Task[None]]:
        return [task for task in self._senders.values() if not task.done()]

    async def _send(self, owner: str, queue: collections.deque[Told]) -> None:
        """Tell ``owner`` what is queued for it, in order: the lookups of one
        namespace queued meanwhile in one PEER_TELL (up to TELL_SHARES_MAX
        shares and ``max_keys`` keys), or one Exists each where it takes no
        PEER_TELL."""
        loop = asyncio.get_running_loop()
        while queue:
            wait_s = self._sent_at.get(owner, 0.0) + TELL_GAP_S - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self._sent_at[owner] = loop.time()
            namespace = queue[0][0]
            batch: list[tuple[list[bytes], ChainShare]] = []
            count = 0
            while queue and queue[0][0] == namespace and len(batch) < TELL_SHARES_MAX:
                if batch and count + len(queue[0][1]) > self._max_keys:
                    break
                _, keys, chain = queue.popleft()
                batch.append((keys, chain))
                count += len(keys)
            try:
                if await self._reads.tell(owner, namespace, batch, self._timeout_s):
                    continue
                for keys, chain in batch:  # as it was before PEER_TELL
                    await self._ask(owner, namespace, keys, self._timeout_s, chain)
            except PeerError as error:
                self._failed(error, owner)
                self.dropped += len(batch) + len(queue)
                queue.clear()
