"""An owner keeps what it told a member it holds for as long as the member
may answer lookups from that answer (``kvd.cluster.hints``).

A member with ``pool_lookup_hint_ms`` answers a lookup from the owners'
recent answers without asking them again, for up to twice that. Before, an
owner could evict a key in that time, and the lookup then claimed a block
whose get missed (a load error the engine recomputes). Now an owner with
the setting pins each key it answers held in a PEER_EXISTS, as long as the
value is in its L1, for twice the setting at least (``life_s``), and says
so in its answer (``EXISTS_KEPT``); the asking member keeps a hint "held"
only for such a key. A key held but not kept (only on L2, or past
``max_bytes`` of pins) is answered ``EXISTS_HELD``: the member asks again
the next time. A "not held" hint needs no promise: a key stored since is
a miss it need not have been, never a wrong block.

Pins are kept in two generations of ``life_s`` each: a key answered again
moves into the current one; the previous one's pins end when the current
one turns, so a promise lasts from ``life_s`` to twice that. The members
of a pool share one ``pool_lookup_hint_ms``: an owner without it promises
nothing, and a member with a longer one may keep a hint its owner no
longer backs (then as before: a miss at the get).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvd.cluster.pinned import PinShare
from kvd.wire.bulk import EXISTS_HELD, EXISTS_KEPT, EXISTS_NOT_HELD

if TYPE_CHECKING:
    from kvd.store.index import Reader
    from kvd.store.store import Store

PromiseKey = tuple[str, bytes]


class Promises:
    """The keys this owner pinned for members' hints, in two generations."""

    def __init__(self, store: Store, life_s: float, max_bytes: int) -> None:
        self.life_s = life_s
        self._pins = PinShare(store.hold, max_bytes)
        self._current: dict[PromiseKey, Reader] = {}
        self._previous: dict[PromiseKey, Reader] = {}
        self._began = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self.kept = 0  # keys answered EXISTS_KEPT
        self.not_kept = 0  # keys held but past max_bytes of pins: EXISTS_HELD

    @property
    def enabled(self) -> bool:
        return self.life_s > 0

    @property
    def pinned_bytes(self) -> int:
        return self._pins.bytes

    def answer(self, namespace: str, keys: Sequence[bytes], found: Sequence[bool]) -> bytes:
        """A PEER_EXISTS answer for ``keys`` (``found``: held here), a byte
        each: not held, held, or held and kept for ``life_s`` at least."""
        if not self.enabled:
            return bytes(found)
        self._age()
        current, previous = self._current, self._previous
        answer = bytearray(len(keys))
        for i, (key, held) in enumerate(zip(keys, found, strict=True)):
            if not held:
                answer[i] = EXISTS_NOT_HELD
                continue
            at = (namespace, key)
            reader = current.pop(at, None) or previous.pop(at, None)
            if reader is not None and not reader.entry.linked:  # replaced or deleted since
                self._end(reader)
                reader = None
            if reader is None:
                reader = self._pins.pin(namespace, key)  # no hit, the policy not told
            if reader is not None:
                current[at] = reader
            answer[i] = EXISTS_HELD if reader is None else EXISTS_KEPT
        kept = answer.count(EXISTS_KEPT)
        self.kept += kept
        self.not_kept += sum(found) - kept
        if current and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.life_s, self._turn_later)
        return bytes(answer)

    def close(self) -> None:
        """Every promise ends (the daemon stops, or leaves the pool)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for generation in (self._previous, self._current):
            for reader in generation.values():
                self._end(reader)
            generation.clear()

    def _end(self, reader: Reader) -> None:
        self._pins.release(reader)

    def _age(self) -> None:
        if time.monotonic() - self._began >= self.life_s:
            self._turn()

    def _turn(self) -> None:
        """The previous generation's promises end; the current one becomes it."""
        for reader in self._previous.values():
            self._end(reader)
        self._previous, self._current = self._current, {}
        self._began = time.monotonic()

    def _turn_later(self) -> None:
        """Promises end when due though no member asks any more."""
        self._timer = None
        self._age()
        if self._current or self._previous:
            wait_s = max(self._began + self.life_s - time.monotonic(), 0.0)
            self._timer = asyncio.get_running_loop().call_later(wait_s, self._turn_later)
