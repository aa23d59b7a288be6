"""Values handed to their new owner after the pool's members changed.

Rendezvous placement moves only the keys a joining member now owns (about
1/N of them) and those a leaving member owned. Before, a value whose owner
changed stayed where it was: lookups asked the new owner, which did not
hold it, and the pool missed it until an engine stored it again; after a
fifth member joined four, a fifth of the pool's L1 was out of reach.

Now, once the members have been the same for ``SETTLE_S`` (etcd or DNS may
report a restart as a leave and a join), each member walks what its L1
holds, namespace by namespace, in the order the values came:

- a value it owned and another member owns now is handed to that member
  as a put is (``kvd.cluster.forwards``: in order on the owner's bulk port,
  kept there, never handed on) and stays here as a guest (out of this
  member's eviction policy, evicted first);
- a guest whose key this member owns now (a copy of a value whose owner
  left) becomes its own: into its eviction policy, a value lookups find.

Bounded: at most ``QUEUED_MAX`` hand-offs wait in the forward queue at once
(the walk waits for it to drain, so engines' puts keep their room), and
the walk yields to the event loop every ``STEP_ENTRIES`` values. A change
of members during a walk starts it again under the new placement. What is
only on L2 is not handed on: a member's L2 holds its own keys, and one
whose owner changed is read again only after it is stored again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvd.cluster.forwards import Forwards
from kvd.cluster.membership import Membership
from kvd.store.entries import Entries
from kvd.store.index import Entry

log = logging.getLogger("kvd.cluster")

# Members unchanged this long before a walk starts.
SETTLE_S = 1.0
# Hand-offs waiting in the forward queue at most; the walk waits below it.
QUEUED_MAX = 256
# Values looked at between two turns of the event loop.
STEP_ENTRIES = 512
# How often a walk waiting for the forward queue looks again.
DRAIN_POLL_S = 0.005


class Rebalance:
    """The walk after each change of members (module doc)."""

    def __init__(
        self,
        entries: Entries,
        membership: Membership,
        forwards: Forwards,
        is_down: Callable[[str], bool],
    ) -> None:
        self._entries = entries
        self._membership = membership
        self._forwards = forwards
        self._is_down = is_down
        self._task: asyncio.Task[None] | None = None
        self.handed_on = 0  # values queued for their new owner
        self.adopted = 0  # guests this member owns now, kept as its own
        self.walks = 0  # walks finished

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
        await self.walk()
        self.walks += 1
        handed, adopted = self.handed_on - before[0], self.adopted - before[1]
        if handed or adopted:
            log.info(
                "pool values handed to their new owners",
                extra={"handed_on": handed, "adopted": adopted,
                       "members": ",".join(placement.members)},
            )  # fmt: skip

    async def walk(self) -> None:
        """One walk over L1 under the current placement."""
        placement = self._membership.placement
        me = self._membership.advertise
        if len(placement.members) == 1:
            return
        forwards, set_guest = self._forwards, self._entries.set_guest
        seen = 0
        for ns in list(self._entries.by_name.values()):
            for entry in list(ns.entries.values()):
                seen += 1
                if seen % STEP_ENTRIES == 0:
                    await asyncio.sleep(0)
                if not entry.linked:
                    continue  # gone while the walk yielded
                owner = placement.owner(ns.name, entry.key)
                if owner == me:
                    if entry.guest:
                        set_guest(entry, False)
                        self.adopted += 1
                    continue
                if entry.guest or self._is_down(owner):
                    continue  # a copy already, or an owner that would not take it now
                while forwards.waiting() >= QUEUED_MAX:
                    await asyncio.sleep(DRAIN_POLL_S)
                if not _still_own(entry):
                    continue  # deleted, or evicted, while the walk waited
                forwards.put(entry, owner)
                set_guest(entry, True)
                self.handed_on += 1


def _still_own(entry: Entry) -> bool:
    return entry.linked and not entry.guest
