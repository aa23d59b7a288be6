"""Values a pool member pins in L1 for the pool's own work, each use within
its share of L1.

Past what engines lease, a member pins values for three reasons: a value
fetched from its owner, until the get that waits for it opens it
(kvd.cluster.router); a key an owner answered "kept" for a member's hints
(kvd.cluster.promises); a put waiting to be handed on to its owner
(kvd.cluster.forwards). Each use pins at most its own share of L1's bytes,
so together they leave most of L1 to the eviction policy and none pins L1
full; the router's holds may go past their share only for a value a get
is waiting on (at most one per such get).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvd.store.index import Reader


class PinShare:
    """Readers pinned for one use, their bytes within ``max_bytes``."""

    def __init__(self, take: Callable[[str, bytes], Reader | None], max_bytes: int) -> None:
        """``take(namespace, key)``: a reader pinning the value in L1, or None
        where it is not in L1 (``Store.hold``, or ``Store.peek`` for one whose
        pages are read)."""
        self._take = take
        self.max_bytes = max_bytes
        self.bytes = 0  # of the readers pinned and not yet released

    def pin(
        self, namespace: str, key: bytes, *, past_share: bool = False, size: int | None = None
    ) -> Reader | None:
        """Pin the value, or None where it is not in L1 or its bytes would go
        past the share (unless ``past_share``). ``size``: the value's, where
        the caller knows it: past the share nothing is taken (``take`` may
        build the value's page views)."""
        if size is not None and not past_share and not self.has_room(size):
            return None
        reader = self._take(namespace, key)
        if reader is None:
            return None
        if self.bytes + reader.size > self.max_bytes and not past_share:
            reader.close()
            return None
        self.bytes += reader.size
        return reader

    def has_room(self, size: int) -> bool:
        """Whether a value of ``size`` bytes would be pinned now."""
        return self.bytes + size <= self.max_bytes

    def release(self, reader: Reader) -> None:
        """End a pin this share made (once)."""
        self.bytes -= reader.size
        reader.close()


class Holds:
    """Values pinned by key until their time is up or ``end`` (a pool
    member's values fetched from their owners, held for their get)."""

    def __init__(self, share: PinShare, hold_s: float) -> None:
        self._share = share
        self._hold_s = hold_s
        self._held: dict[tuple[str, bytes], Reader] = {}

    def hold(self, namespace: str, key: bytes, *, past_share: bool = False) -> None:
        """Pin the value for ``hold_s`` (``PinShare.pin``); a value held already stays as it is."""
        if (namespace, key) in self._held:
            return
        reader = self._share.pin(namespace, key, past_share=past_share)
        if reader is None:
            return
        self._held[(namespace, key)] = reader
        asyncio.get_running_loop().call_later(self._hold_s, self.end, namespace, key, reader)

    def end_later(self, namespace: str, keys: list[bytes], after_s: float) -> None:
        """End the holds of ``keys`` ``after_s`` from now."""
        asyncio.get_running_loop().call_later(after_s, self._end_all, namespace, keys)

    def _end_all(self, namespace: str, keys: list[bytes]) -> None:
        for key in keys:
            self.end(namespace, key)

    def end(self, namespace: str, key: bytes, reader: Reader | None = None) -> None:
        """End a hold (only ``reader``'s, where given: a later hold of the key is its own)."""
        held = self._held.get((namespace, key))
        if held is None or (reader is not None and held is not reader):
            return
        del self._held[(namespace, key)]
        self._share.release(held)

    def close(self) -> None:
        for namespace, key in list(self._held):
            self.end(namespace, key)
