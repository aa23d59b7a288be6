"""Value checksums: xxh3-64 over the value's bytes.

xxh3 hashes at ~20 GB/s on one core here, an order of magnitude above the
fastest path that moves the bytes, so checking every value on both sides
costs little. Clients send the checksum with a put and check it on a get;
the daemon checks it again whenever bytes come back from its SSD tier.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checksum_views(views: Iterable[bytes | bytearray | memoryview]) -> int:
    """Checksum of the concatenation of ``views`` without joining them."""
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(view)
    return hasher.intdigest()


class Hasher:
    """Incremental checksum for a value arriving in pieces."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def value(self) -> int:
        return self._h.intdigest()
