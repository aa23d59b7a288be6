"""PinShare: the pool's own pins in L1 (fetched values held for their get,
keys kept for members' hints, puts waiting for their owner) stay within
their share of L1, and a pinned value outlives the eviction around it."""

from __future__ import annotations

from kvd.cluster.pinned import PinShare
from kvd.l1.pool import PAGE_BYTES
from kvd.store.index import Reader
from tests.store.support import make_store, put, read


def test_pins_stay_within_the_share_and_count_only_what_they_pinned() -> None:
    store, _ = make_store(pages=16)
    for name in (b"a", b"b", b"c"):
        put(store, name, name * PAGE_BYTES)
    asked: list[bytes] = []

    def hold(namespace: str, key: bytes) -> Reader | None:
        asked.append(key)
        return store.hold(namespace, key)

    share = PinShare(hold, 2 * PAGE_BYTES)
    a, b = share.pin("ns", b"a"), share.pin("ns", b"b")
    assert a is not None and b is not None
    assert share.bytes == 2 * PAGE_BYTES
    assert share.pin("ns", b"c") is None  # past the share: not pinned, not counted
    asked.clear()
    assert share.pin("ns", b"c", size=PAGE_BYTES) is None  # known past it: nothing taken
    assert asked == []
    assert share.pin("ns", b"missing") is None  # not in L1: nothing counted
    assert share.pin("other", b"a") is None
    assert share.bytes == 2 * PAGE_BYTES
    c = share.pin("ns", b"c", past_share=True)
    assert c is not None and share.bytes == 3 * PAGE_BYTES
    for reader in (a, b, c):
        share.release(reader)
    assert share.bytes == 0
    assert share.pin("ns", b"c") is not None  # room again


def test_a_pinned_value_outlives_the_eviction_around_it() -> None:
    store, _ = make_store(pages=8)
    put(store, b"kept", b"k" * PAGE_BYTES)
    put(store, b"free", b"f" * PAGE_BYTES)
    share = PinShare(store.peek, 4 * PAGE_BYTES)
    reader = share.pin("ns", b"kept")
    assert reader is not None
    for i in range(32):  # four times L1
        put(store, b"fill-%d" % i, bytes([i]) * PAGE_BYTES)
    assert read(store, b"free") is None
    assert b"".join(reader.views) == b"k" * PAGE_BYTES
    share.release(reader)
    assert share.bytes == 0
