"""Gets through the pool's directory in native code
(``kvd.io._uring.pool_read_many``) against the Python reads it replaces
(``PoolMap`` without it): on a real shared pool, with every byte of the
directory, the tags and the values damaged in turn, both find the same
values and neither ever gives back bytes that are not the value's; a
batch mixes hits and misses; without ``verify`` the tags still stop a
reused page; arguments that do not fit are refused before anything is read."""

from __future__ import annotations

import hashlib
import random
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvd.client.pool_reads import PoolMap, native_pool_reads
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.wire.checksum import checksum
from kvd.wire.shm import DIRECTORY_SLOT, TAG, directory_digest

native = native_pool_reads()
pytestmark = pytest.mark.skipif(native is None, reason="kvd.io._uring is not built")

NS = "pool-read-many"
# One page, a part of one, several, and more than one chunk of the native
# copy (256 KiB) ending mid-page.
SIZES = [PAGE_BYTES, 1, 3 * PAGE_BYTES, 5 * PAGE_BYTES + 123, 7]


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _key(i: int) -> bytes:
    return hashlib.sha256(b"read-many-%d" % i).digest()


class Pooled:
    """A shared pool holding ``values`` through its directory, mapped twice
    read-only: by native reads and by Python ones."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        directory = pool.directory
        assert directory is not None
        fields = (
            directory.base,
            directory.base + directory.slots_offset,
            directory.bucket_count,
            directory.ways,
        )
        self._ends: list[socket.socket] = []
        self.native = self._map(fields, native=True, verify=True)
        self.python = self._map(fields, native=False, verify=True)
        self.unverified = self._map(fields, native=True, verify=False)
        self.values: dict[bytes, bytes] = {}
        self.runs: dict[bytes, Any] = {}
        self.slots: dict[bytes, int] = {}
        self._uid = 0

    def _map(self, fields: tuple[int, int, int, int], *, native: bool, verify: bool) -> PoolMap:
        daemon_end, watch = socket.socketpair()
        self._ends.append(daemon_end)
        return PoolMap(
            self.pool.read_only_fd(),
            self.pool.capacity_bytes,
            fields,
            watch,
            native=native,
            verify=verify,
        )

    def put(self, key: bytes, value: bytes) -> None:
        pool, directory = self.pool, self.pool.directory
        assert directory is not None
        runs = pool.alloc(len(value))
        assert len(runs) == 1
        pool.views(runs, len(value))[0][:] = value
        self._uid += 1
        first = runs[0][0]
        slot = directory.publish(
            NS, key, self._uid, first, len(value), checksum(value), first * PAGE_BYTES
        )
        assert slot >= 0
        self.values[key], self.runs[key], self.slots[key] = value, runs, slot

    def drop(self, key: bytes) -> None:
        """Free the value's pages as the daemon does: the tag first, the
        slot left behind (withdrawn later, or never)."""
        runs = self.runs.pop(key)
        self.pool.free(runs)

    def close(self) -> None:
        for mapped in (self.native, self.python, self.unverified):
            mapped.close()
        for end in self._ends:
            end.close()


@pytest.fixture
def pooled() -> Iterator[Pooled]:
    pool = Pool(64 * PAGE_BYTES, shared=True)
    held = Pooled(pool)
    yield held
    held.close()
    pool.close()


def _read(mapped: PoolMap, keys: list[bytes], room: int) -> tuple[list[int | None], list[bytes]]:
    buffers = [memoryview(bytearray(room)) for _ in keys]
    sizes = mapped.read_direct_many(NS, keys, buffers)
    return sizes, [bytes(buf[: size or 0]) for buf, size in zip(buffers, sizes, strict=True)]


def test_native_and_python_reads_find_the_same_values(pooled: Pooled) -> None:
    for i, size in enumerate(SIZES):
        pooled.put(_key(i), _value(size, i))
    keys = [_key(i) for i in range(len(SIZES) + 2)]  # and two that were never put
    room = max(SIZES)
    sizes, got = _read(pooled.native, keys, room)
    assert (sizes, got) == _read(pooled.python, keys, room)
    assert sizes == [*SIZES, None, None]
    assert got[: len(SIZES)] == [pooled.values[k] for k in keys[: len(SIZES)]]
    assert pooled.native.take_touched() == {NS: keys[: len(SIZES)]}
    assert pooled.native.direct_hits == len(SIZES)
    # A buffer too small for a value is no value (the caller asks the daemon).
    assert pooled.native.read_direct_many(NS, [_key(2)], [memoryview(bytearray(10))]) == [None]


def test_no_damage_makes_either_read_give_back_wrong_bytes(pooled: Pooled) -> None:
    """Every kind of byte, changed one at a time: slot fields (sequence
    number, id, digest, size, checksum, offset), page tags and value bytes.
    Both reads agree, and a hit is always the value put."""
    for i, size in enumerate(SIZES):
        pooled.put(_key(i), _value(size, 10 + i))
    keys = list(pooled.values)
    directory = pooled.pool.directory
    assert directory is not None
    view = memoryview(pooled.pool._directory_map)  # the daemon's writable directory
    slot_bytes = [at + b for at in pooled.slots.values() for b in range(DIRECTORY_SLOT.size)]
    tag_bytes = [runs[0][0] * TAG.size + b for runs in pooled.runs.values() for b in range(8)]
    rng = random.Random(7)
    hits = 0
    for trial in range(600):
        target = rng.choice(["slot", "tag", "value"])
        if target == "value":
            key = rng.choice(keys)
            page_view = pooled.pool.views(pooled.runs[key], len(pooled.values[key]))[0]
            at = rng.randrange(len(page_view))
            where: memoryview = page_view
        else:
            at = rng.choice(slot_bytes if target == "slot" else tag_bytes)
            where = view
        old = where[at]
        where[at] = old ^ (1 << rng.randrange(8)) if trial % 2 else rng.randrange(256)
        try:
            sizes, got = _read(pooled.native, keys, max(SIZES))
            assert (sizes, got) == _read(pooled.python, keys, max(SIZES)), (target, at)
            for key, size, data in zip(keys, sizes, got, strict=True):
                if size is not None:
                    assert data == pooled.values[key], (target, at)
                    hits += 1
        finally:
            where[at] = old
    view.release()
    assert 0 < hits < 600 * len(keys)  # damage made misses, and the rest still hit
    sizes, got = _read(pooled.native, keys, max(SIZES))
    assert got == [pooled.values[k] for k in keys]  # all restored


def test_a_batch_mixes_hits_and_misses(pooled: Pooled) -> None:
    for i in range(40):
        pooled.put(_key(i), _value(1000 + i, 100 + i))
    keys = [_key(i) for i in range(0, 80)]
    rng = random.Random(3)
    rng.shuffle(keys)
    sizes, got = _read(pooled.native, keys, 2000)
    assert (sizes, got) == _read(pooled.python, keys, 2000)
    for key, size, data in zip(keys, sizes, got, strict=True):
        assert data == pooled.values.get(key, b"")
        assert (size is None) == (key not in pooled.values)


def test_without_verify_the_tags_still_stop_a_reused_page(pooled: Pooled) -> None:
    value = _value(2 * PAGE_BYTES, 5)
    pooled.put(b"a", value)
    sizes, got = _read(pooled.unverified, [b"a"], len(value))
    assert sizes == [len(value)] and got == [value]
    # Freed: its tag is zeroed before the pages can be reused.
    pooled.drop(b"a")
    assert _read(pooled.unverified, [b"a"], len(value))[0] == [None]
    # Reused by another value, the old slot still there: not a value.
    pooled.put(b"b", _value(PAGE_BYTES, 6))
    assert _read(pooled.unverified, [b"a"], len(value))[0] == [None]
    assert _read(pooled.unverified, [b"b"], PAGE_BYTES)[1] == [pooled.values[b"b"]]
    # What verify adds: bytes changed in place under a live tag.
    page = pooled.pool.views(pooled.runs[b"b"], PAGE_BYTES)[0]
    page[0] ^= 0xFF
    assert _read(pooled.native, [b"b"], PAGE_BYTES)[0] == [None]
    assert _read(pooled.python, [b"b"], PAGE_BYTES)[0] == [None]
    assert _read(pooled.unverified, [b"b"], PAGE_BYTES)[0] == [PAGE_BYTES]


def test_arguments_that_do_not_fit_are_refused(pooled: Pooled) -> None:
    assert native is not None
    pooled.put(b"k", _value(100, 9))
    mapped = pooled.native
    directory = mapped.directory
    assert directory is not None
    pool = memoryview(pooled.pool._directory_map)  # any buffer: only sizes are checked
    layout = (directory.tags, directory.slots, directory.mask, directory.ways, mapped.size)
    digest = directory_digest(NS, b"k")
    out = memoryview(bytearray(100))
    bad_layouts = [
        (directory.tags, directory.slots, directory.mask, directory.ways, 1 << 40),
        (directory.tags, directory.slots + 8, directory.mask, directory.ways, mapped.size),
        (directory.tags, directory.slots, 6, directory.ways, mapped.size),  # not 2^n - 1
        (directory.tags, directory.slots, directory.mask, 0, mapped.size),
        (directory.tags, directory.slots, directory.mask * 4 + 3, directory.ways, mapped.size),
    ]
    for bad in bad_layouts:
        with pytest.raises(ValueError):
            native(mapped._view, bad, [digest], [out], True)
    with pytest.raises(ValueError):
        native(mapped._view, layout, [digest], [out, out], True)
    with pytest.raises(TypeError):
        native(mapped._view, layout, [digest[:8]], [out], True)
    with pytest.raises(BufferError):
        native(mapped._view, layout, [digest], [memoryview(b"x" * 100)], True)
    with pytest.raises(TypeError):
        native(mapped._view, (1, 2), [digest], [out], True)
    assert bytes(out) == bytes(100)  # nothing was read by a refused call
    assert native(mapped._view, layout, [digest], [out], True) == [100]
    assert bytes(out) == pooled.values[b"k"]
    pool.release()
