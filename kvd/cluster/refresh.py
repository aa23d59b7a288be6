"""The owners' answers behind a chain's hints asked again in the background
while the chain is looked up, so that hints neither age out under a
waiting request nor stay stale for their whole life.

A lookup answered from hints (``kvd.cluster.hints``) asks no owner: its
owners are told of it (``kvd.cluster.tells``) and answer nothing. Left at
that, a chain looked up at every scheduler step would be asked again, with
the lookup waiting, each time its hints aged out (every one to two
``pool_lookup_hint_ms``), and a key stored at its owner since a "not held"
answer would be missed for as long. Instead, at most every ``every_s``
(a quarter of the setting) per chain, a hinted lookup has the owners of its
keys past the local prefix asked again in the background, one PEER_EXISTS
each (not as a share of the chain: the tell teaches their policies, once
per lookup as before); their answers replace the hints (and the owners pin
what they answer kept, ``kvd.cluster.promises``). So while a chain is
looked up, its hints are at most ``every_s`` and a round trip old.

Bounded: ``CHAINS_MAX`` chains remembered (past it the oldest half is
forgotten: such a chain is at worst refreshed early) and ``IN_FLIGHT_MAX``
refreshes at once (past it none starts: the hints age out and a lookup
asks, as it would without them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

# Chains whose last refresh is remembered (a key of 32 bytes and a float each).
CHAINS_MAX = 4096
# Refreshes running at once; past it a due one is skipped.
IN_FLIGHT_MAX = 16

# ask(owner, namespace, keys, timeout_s): the owner's PEER_EXISTS, its answer
# noted in the hints (a failure counted and the member marked down by it).
AskFn = Callable[[str, str, list[bytes], float], Awaitable[object]]


class Refresh:
    """When each chain's hints were last asked for again, and those asks."""

    def __init__(self, every_s: float, ask: AskFn) -> None:
        self.every_s = every_s
        self._ask = ask
        self._last: dict[tuple[str, bytes], float] = {}  # (namespace, the chain's last key)
        self._running: set[asyncio.Task[None]] = set()
        self.started = 0  # refreshes started
        self.skipped = 0  # refreshes due but not started: too many running

    def chain(
        self, namespace: str, keys: list[bytes], shares: dict[str, list[int]], start: int,
        timeout_s: float,
    ) -> bool:  # fmt: skip
        """Ask the owners of ``keys[start:]`` (each owner's positions in
        ``shares``) about them again in the background, if the chain is due;
        whether it was."""
        if not self._due(namespace, keys[-1]):
            return False
        asks = {owner: [keys[i] for i in positions if i >= start]
                for owner, positions in shares.items()}  # fmt: skip
        asking = asyncio.gather(*(self._ask(owner, namespace, mine, timeout_s)
                                  for owner, mine in asks.items() if mine))  # fmt: skip
        task = asyncio.get_running_loop().create_task(_settled(asking))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        self.started += 1
        return True

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._running)

    def clear(self) -> None:
        """Forget every chain (the members changed: their hints went)."""
        self._last = {}

    def _due(self, namespace: str, last_key: bytes) -> bool:
        """Whether the chain ending in ``last_key`` is to be refreshed now (and
        then counts as refreshed)."""
        now = time.monotonic()
        chain = (namespace, last_key)
        if now - self._last.get(chain, float("-inf")) < self.every_s:
            return False
        if len(self._running) >= IN_FLIGHT_MAX:
            self.skipped += 1
            return False
        if len(self._last) >= CHAINS_MAX:
            middle = sorted(self._last.values())[len(self._last) // 2]
            self._last = {c: at for c, at in self._last.items() if at > middle}
        self._last[chain] = now
        return True


async def _settled(asking: Awaitable[object]) -> None:
    await asking
