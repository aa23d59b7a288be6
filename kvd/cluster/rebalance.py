"""Values handed to their new owner after the pool's members changed.

Rendezvous placement moves only the keys a joining member now owns (about
1/N of them) and those a leaving member owned. Before, a value whose owner
changed stayed where it was: lookups asked the new owner, which did not
hold it, and the pool missed it until an engine stored it again. A
chain's lookup stops at its first key held nowhere, so a join cut nearly
every chain: right after a fifth member joined four, lookups found 31.5 %
of the blocks (``kvd bench pool``'s join; all of them 1.0-1.3 s later
with this walk).

Now, once the members have been the same for ``SETTLE_S`` (etcd or DNS may
report a restart as a leave and a join), each member walks what its L1
holds, namespace by namespace, in the order the values came, then what
only its L2 holds, in the order it was written:

- a value it owned and another member owns now is handed to that member
  as a put is (``kvd.cluster.forwards``: in order on the owner's bulk port,
  kept there, never handed on) and, once the owner took it, stays here as
  a guest (out of this member's eviction policy, evicted first); one the
  owner did not take stays this member's own, for the next walk; a value
  only on L2 is read into L1 first (its record stays until L2 reclaims it);
- a guest whose key this member owns now (a copy of a value whose owner
  left) becomes its own: into its eviction policy, a value lookups find.

Bounded: at most ``QUEUED_MAX`` hand-offs wait in the forward queue at once
(the walk waits for it to drain, so engines' puts keep their room), and a
value is queued only when the forwards can pin it while it waits (within
their share of L1: a guest not pinned would be the first value evicted,
by the walk's own reads from L2 among others), L2 values are read one at
a time, the walk yields to the event loop every ``STEP_ENTRIES``
values, and a member receives at most ``pool_rebalance_bytes_per_s`` of
hand-offs a second from all walks together (256 MiB by default; a node
holding terabytes on L2 sends its share over hours, not at the NIC's full
rate): each member hands each new owner at most that rate divided by the
other members, the most that may hand it values at once (every old member
after a join). A change of members during a walk starts it
again under the new placement. A value whose new owner is failing just
then (a call to it failed within the last second) is passed over and
stays this member's own; the walk then runs again ``RETRY_S`` later, up
to ``WALK_ROUNDS`` times (a walk again hands on only what is still this
member's). A walk during which a forward failed (a value its owner did
not take stays this member's own) runs again as well.

At a graceful stop with ``pool_leave_handoff_ms`` (``leave``), a member
hands what it owns to the members that own it once this one is gone, the
same way, unpaced, within that time, before it leaves the pool: what its
L1 holds, then what only its L2 holds, the newest first, read in batches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from kvd.cluster.forwards import FORWARD_TIMEOUT_S, Forwards
from kvd.cluster.membership import Membership
from kvd.cluster.rendezvous import Placement
from kvd.store.index import Entry, Reader
from kvd.store.store import Store

log = logging.getLogger("kvd.cluster")

# Members unchanged this long before a walk starts.
SETTLE_S = 1.0
# Hand-offs waiting in the forward queue at most; the walk waits below it.
QUEUED_MAX = 256
# Values looked at between two turns of the event loop.
STEP_ENTRIES = 512
# How often a walk waiting for the forward queue looks again.
DRAIN_POLL_S = 0.005
# A walk that passed over values of a member failing just then (a peer call
# to it failed within the last second) walks again this much later, at most
# WALK_ROUNDS times in all.
RETRY_S = 2.0
WALK_ROUNDS = 5
# A leaving member reads the values only its L2 holds this many bytes at a
# time (one L2 batch, pinned in L1 until queued for their owners).
LEAVE_READ_BYTES = 16 << 20


class Rebalance:
    """The walk after each change of members (module doc)."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        forwards: Forwards,
        is_down: Callable[[str], bool],
        bytes_per_s: int = 0,
    ) -> None:
        """``bytes_per_s``: the most a member receives from all walks a
        second (0: as fast as the forward queue drains)."""
        self._store = store
        self._bytes_per_s = bytes_per_s
        self._began = 0.0  # when the walk began
        self._walk_bytes: dict[str, int] = {}  # bytes the walk handed each new owner
        self._membership = membership
        self._forwards = forwards
        self._is_down = is_down
        self._task: asyncio.Task[None] | None = None
        self.handed_on = 0  # values queued for their new owner
        self.read_from_l2 = 0  # of them, values read from L2 to be handed on
        self.adopted = 0  # guests this member owns now, kept as its own
        self.walks = 0  # walks begun (each round of one counts)
        self.left_handed_on = 0  # values queued for their owner as this member left
        self.left_from_l2 = 0  # of them, values read from L2 to be handed on

    def changed(self) -> None:
        """The members changed: (re)start the walk once they settle."""
        self.cancel()
        self._task = asyncio.get_running_loop().create_task(
            self._walk_settled(), name="kvd-pool-rebalance"
        )

    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._task] if self._task is not None and not self._task.done() else []

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _walk_settled(self) -> None:
        await asyncio.sleep(SETTLE_S)
        placement = self._membership.placement
        before = self.handed_on, self.adopted
        for _ in range(WALK_ROUNDS):
            self.walks += 1
            errors = self._forwards.errors
            passed_over = await self.walk()
            # What is on its way is not sent twice.
            await self._sent(time.monotonic() + FORWARD_TIMEOUT_S)
            if not passed_over and self._forwards.errors == errors:
                break
            await asyncio.sleep(RETRY_S)
        else:
            log.warning(
                "pool values not handed to their new owner: it kept failing",
                extra={"members": ",".join(placement.members)},
            )
        handed, adopted = self.handed_on - before[0], self.adopted - before[1]
        if handed or adopted:
            log.info(
                "pool values handed to their new owners",
                extra={"handed_on": handed, "adopted": adopted,
                       "members": ",".join(placement.members)},
            )  # fmt: skip

    async def walk(self) -> int:
        """One walk over L1, then L2, under the current placement: how many
        values it passed over because their new owner was failing just then
        (they stay this member's own, for the next walk)."""
        placement = self._membership.placement
        me = self._membership.advertise
        if len(placement.members) == 1:
            return 0
        entries = self._store.entries
        self._began, self._walk_bytes = time.monotonic(), {}
        # Values handed on from L1 that also have an L2 record: evicted here
        # before the L2 walk reaches them, they are not read and sent again
        # (at most this member's L1 entries / members).
        handed: set[tuple[str, bytes]] = set()
        passed_over = 0
        async for entry in self._l1_entries():
            if not entry.linked:
                continue  # gone while the walk yielded
            owner = placement.owner(entry.ns.name, entry.key)
            if owner == me:
                if entry.guest:
                    entries.set_guest(entry, False)
                    self.adopted += 1
                continue
            if entry.guest:
                continue  # a copy already
            if self._is_down(owner):
                passed_over += 1
                continue
            if await self._hand_on(entry, owner) and entry.l2 is not None:
                handed.add((entry.ns.name, entry.key))
        l2, promoting = self._store.l2, self._store.placement
        if l2 is None or promoting is None:
            return passed_over
        seen = 0
        for namespace in l2.namespaces():
            for key in l2.keys_of(namespace):
                seen += 1
                if seen % STEP_ENTRIES == 0:
                    await asyncio.sleep(0)
                owner = placement.owner(namespace, key)
                if owner == me or (namespace, key) in handed:
                    continue
                if self._is_down(owner):
                    passed_over += 1
                    continue
                record = l2.lookup(namespace, key)
                if record is None or entries.get(namespace, key) is not None:
                    continue  # gone, or in L1 (walked above, or put since)
                if (namespace, key) in promoting.promotions:
                    passed_over += 1  # a get is reading it into L1: the next walk
                    continue
                promoted = await promoting.promote(record)
                if promoted is not None and _still_own(promoted):
                    self.read_from_l2 += 1
                    await self._hand_on(promoted, owner)
        return passed_over

    async def _l1_entries(self) -> AsyncIterator[Entry]:
        """Each value in L1, namespace by namespace in the order they came,
        with a turn of the event loop every ``STEP_ENTRIES``."""
        seen = 0
        for ns in list(self._store.entries.by_name.values()):
            for entry in list(ns.entries.values()):
                seen += 1
                if seen % STEP_ENTRIES == 0:
                    await asyncio.sleep(0)
                yield entry

    async def _room(self, size: int, deadline: float = math.inf) -> None:
        """Wait, until ``deadline`` at most, until the forward queue has room
        for a value of ``size`` bytes and can pin it while it waits."""
        forwards = self._forwards
        while time.monotonic() < deadline and (
            forwards.waiting() >= QUEUED_MAX or not forwards.can_pin(size)
        ):
            await asyncio.sleep(DRAIN_POLL_S)

    async def _sent(self, deadline: float) -> None:
        """Wait until every queued forward went (or failed), until
        ``deadline`` at most (engines' puts may keep the senders busy)."""
        while self._forwards.tasks() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    def _taken(self, entry: Entry) -> None:
        """Its new owner took a value handed on: the copy here is a guest
        (unless the members changed back meanwhile)."""
        if entry.linked and self._membership.placement.owner(entry.ns.name, entry.key) != (
            self._membership.advertise
        ):
            self._store.entries.set_guest(entry, True)

    async def _hand_on(self, entry: Entry, owner: str) -> bool:
        """Queue ``entry`` for ``owner`` once the queue has room; once the
        owner took it, it stays here as a guest (``_taken``). False when it
        went meanwhile (deleted, evicted)."""
        # Queued only once it will be pinned while it waits: a guest not
        # pinned is the first value evicted, and the walk's own reads from
        # L2 would evict the values it queued before them.
        await self._room(entry.size)
        if not _still_own(entry):
            return False
        self._forwards.put(entry, owner, self._taken)
        self.handed_on += 1
        sent = self._walk_bytes[owner] = self._walk_bytes.get(owner, 0) + entry.size
        if self._bytes_per_s:
            ahead_s = sent / self.owner_rate() - (time.monotonic() - self._began)
            if ahead_s > 0:
                await asyncio.sleep(ahead_s)
        return True

    def owner_rate(self) -> float:
        """Bytes a second this member hands one new owner: the rate a member
        receives, shared by every other member (each may be handing it
        values at once)."""
        senders = max(1, len(self._membership.members) - 1)
        return self._bytes_per_s / senders

    async def leave(self, budget_s: float) -> None:
        """At a graceful stop, before this member leaves the pool: hand each
        value it owns to the member that owns it once this one is gone (the
        placement over the others), as the walk does, unpaced, within
        ``budget_s``: first what its L1 holds, then what only its L2 holds,
        the newest first, read ``LEAVE_READ_BYTES`` at a time. What is not
        sent by then is left (a restart under this address serves it, one
        under another hands it on)."""
        self.cancel()
        started = time.monotonic()
        deadline = started + budget_s
        me = self._membership.advertise
        others = [member for member in self._membership.members if member != me]
        if not others:
            return
        placement, forwards = Placement(others), self._forwards
        forwards.leaving = True  # kept as their own, before the others see this one go
        before, errors, left = self.left_handed_on, forwards.errors, 0
        # Values handed on from L1 that also have an L2 record: evicted here
        # before the L2 pass reaches them (its reads need room), they are not
        # read and sent again.
        handed: set[tuple[str, bytes]] = set()
        async for entry in self._l1_entries():
            if not _still_own(entry):
                continue
            if not await self._leave_one(entry, placement, deadline):
                left += 1
            elif entry.l2 is not None:
                handed.add((entry.ns.name, entry.key))
        from_l2 = self.left_from_l2
        async for readers in self._l2_owned(deadline, handed):
            try:
                for reader in readers:
                    if await self._leave_one(reader.entry, placement, deadline):
                        self.left_from_l2 += 1
                    else:
                        left += 1
            finally:
                for reader in readers:
                    reader.close()
        await self._sent(deadline)
        log.info(
            "pool values handed on before leaving",
            extra={"handed_on": self.left_handed_on - before,
                   "from_l2": self.left_from_l2 - from_l2, "failed": forwards.errors - errors,
                   "unsent": forwards.waiting() + left,
                   "ms": round((time.monotonic() - started) * 1000)},
        )  # fmt: skip

    async def _leave_one(self, entry: Entry, placement: Placement, deadline: float) -> bool:
        """Queue a value this member owns for its owner once this one is
        gone (``leave``); False when the time is up first."""
        await self._room(entry.size, deadline)
        if time.monotonic() >= deadline:
            return False
        owner = placement.owner(entry.ns.name, entry.key)
        if _still_own(entry) and not self._is_down(owner):
            self._forwards.put(entry, owner)
            self.left_handed_on += 1
        return True

    async def _l2_owned(
        self, deadline: float, handed: set[tuple[str, bytes]]
    ) -> AsyncIterator[list[Reader]]:
        """The values this member owns that only its L2 holds (and are not
        in ``handed``), read into L1 a batch at a time (``LEAVE_READ_BYTES``,
        at most an eighth of L1), the newest first, until ``deadline``:
        pinned readers, closed by the caller."""
        l2 = self._store.l2
        if l2 is None or self._store.placement is None:
            return
        owner, me = self._membership.placement.owner, self._membership.advertise
        entries = self._store.entries
        most = min(LEAVE_READ_BYTES, self._store.pool.capacity_bytes // 8)
        for namespace in l2.namespaces():
            batch: list[bytes] = []
            size = 0
            for key in reversed(l2.keys_of(namespace)):
                record = l2.lookup(namespace, key)
                if record is None or owner(namespace, key) != me:
                    continue  # gone, or a copy of another member's value
                if entries.get(namespace, key) is not None or (namespace, key) in handed:
                    continue  # handed on above (in L1 then), or put since
                if batch and size + record.size > most:
                    if time.monotonic() >= deadline:
                        return
                    yield await self._promoted(namespace, batch)
                    batch, size = [], 0
                batch.append(key)
                size += record.size
            if batch and time.monotonic() < deadline:
                yield await self._promoted(namespace, batch)

    async def _promoted(self, namespace: str, keys: list[bytes]) -> list[Reader]:
        """``keys``' values read from L2 into L1 in one batch (pinned
        readers of those read). One the batch left out is taken from L1 if
        it is there now, passed over if a get is reading it just then, and
        else read on its own (L1 was pinned full for the batch)."""
        store, promoting = self._store, self._store.placement
        assert promoting is not None and store.l2 is not None, "an L2 tier has its placement"
        readers = await promoting.promote_many(namespace, keys)
        pinned = [reader for reader in readers.values() if reader is not None]
        for index, key in enumerate(keys):
            if index in readers or (namespace, key) in promoting.promotions:
                continue  # read (or failed: a miss), or a get reads it
            if store.entries.get(namespace, key) is None:
                record = store.l2.lookup(namespace, key)
                if record is None or await promoting.promote(record) is None:
                    continue
            reader = store.peek(namespace, key)
            if reader is not None:
                pinned.append(reader)
        return pinned


def _still_own(entry: Entry) -> bool:
    return entry.linked and not entry.guest
