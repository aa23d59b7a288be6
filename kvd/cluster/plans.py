"""One eviction plan for the whole pool: every member keeps its blocks by
the plan of one member, the plan holder (the first of the members in
sorted order, so every member names the same one).

Why. A chain's keys are spread over the members, and a lookup stops at
its first key held nowhere. Each member's policy plans for its own share
(``density``: a retention per class of reference, learned from its own
references), and plans that differ a little drop a chain's shares at
different times: the first member to drop its block cuts the chain, and
the other members' blocks past it are held for nothing. In the pool
simulator (conversation trace, L1 for 5 % of its blocks over 4 members)
the pool hit 21.18 % against one daemon's 23.01 % of the same total L1;
with every member's clock moved by every lookup (``ChainShare.untold``)
it hit 21.77 %, with one plan as well 22.90 % (docs/pool.md).

How. Each member counts the lookups it learns of (its own, and the shares
of other members' lookups it is told) and every ``PLAN_EVERY_LOOKUPS``
asks the holder for its plan (PEER_PLAN on the holder's bulk port, in the
background, one ask at a time) and hands it to its policy
(``adopt_plan``). The policy keeps blocks by it until it is stale and
then plans for itself again, so a holder that left or does not answer
(a peer error, as any other) costs only the members' agreement. A plan of
another policy (members configured differently) or of a member of another
size is refused, counted and logged once per holder: that member plans
for itself. Imports neither grpc nor metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvd.cluster.membership import Membership
from kvd.cluster.peer_reads import PeerReads
from kvd.cluster.peers import PeerError
from kvd.store.learning import DeferredPolicy

log = logging.getLogger("kvd.cluster")

# Lookups between two asks for the holder's plan. density plans every 64
# lookups; in the pool simulator (conversation trace at 5 %, 4 members)
# asking every 16 / 64 / 256 / 1,024 lookups hit 22.90 / 22.81 / 22.62 /
# 21.92 % (one daemon: 23.01 %). An ask is one small frame each way
# (density's plan is 300 bytes), so a member asks every 16.
PLAN_EVERY_LOOKUPS = 16


def plan_due(seen_before: int, seen: int) -> bool:
    """Whether a member that has learned of ``seen`` lookups (``seen_before``
    until now) asks for the holder's plan: every PLAN_EVERY_LOOKUPS."""
    return seen // PLAN_EVERY_LOOKUPS != seen_before // PLAN_EVERY_LOOKUPS


class PoolPlans:
    """This member's asks for the holder's plan (module doc)."""

    def __init__(
        self,
        learning: DeferredPolicy[Any],
        membership: Membership,
        reads: PeerReads,
        *,
        timeout_s: float,
        failed: Callable[[PeerError, str], None],
        is_down: Callable[[str], bool],
    ) -> None:
        self.learning = learning
        self.membership = membership
        self.reads = reads
        self.timeout_s = timeout_s
        self._failed = failed
        self._is_down = is_down
        self.adopted = 0  # plans the policy keeps blocks by
        self.refused = 0  # plans of another policy or another member's size
        self._seen = 0
        self._asking: asyncio.Task[None] | None = None
        self._refusals_logged: set[str] = set()

    @property
    def holder(self) -> str:
        return min(self.membership.members)

    def seen(self, lookups: int = 1) -> None:
        """This member learned of ``lookups`` more lookups of the pool."""
        before = self._seen
        self._seen += lookups
        if not plan_due(before, self._seen):
            return
        holder = self.holder
        if holder == self.membership.advertise or self._asking is not None:
            return
        if self._is_down(holder):
            return
        self._asking = asyncio.get_running_loop().create_task(self._ask(holder))
        self._asking.add_done_callback(self._asked)

    def _asked(self, task: asyncio.Task[None]) -> None:
        self._asking = None

    async def _ask(self, holder: str) -> None:
        try:
            answer = await self.reads.plan(holder, self.timeout_s)
        except PeerError as error:
            self._failed(error, holder)
            return
        if answer is None:
            return  # the holder has no plan yet, or offers none
        name, plan = answer
        if name == self.learning.name and self.learning.adopt_plan(plan):
            self.adopted += 1
            return
        self.refused += 1
        if holder not in self._refusals_logged:
            self._refusals_logged.add(holder)
            log.warning(
                "the pool's plan holder's eviction plan does not fit this daemon; "
                "it plans for itself",
                extra={
                    "peer": holder,
                    "peer_policy": name,
                    "policy": self.learning.name,
                    "plan_bytes": len(plan),
                },
            )

    async def close(self) -> None:
        task = self._asking
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
