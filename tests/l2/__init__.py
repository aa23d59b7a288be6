"""Helpers shared by the L2 tier tests: backends, aligned memory, payloads.

Every L2 test runs against real files opened with O_DIRECT under the test's
tmp dir and on both io backends (io_uring and threads), and the tier's
record checks both in C (uring) and in Python (threads, and uring-pychecks:
io_uring with the checks in Python).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvd.io.backend import IoBackend, IoOp, native_available, open_backend
from kvd.l2.devices import DeviceSet
from kvd.l2.format import BLOCK_BYTES, align_up
from kvd.l2.records import L2Record
from kvd.l2.tier import L2Tier
from kvd.wire.checksum import checksum

NATIVE_OK, NATIVE_REASON = native_available()
BACKENDS = [
    pytest.param("uring", marks=pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)),
    "threads",
    pytest.param("uring-pychecks", marks=pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)),
]
KiB = 1024
MiB = 1024 * KiB
# The ``small`` fixture's tier (tests/l2/conftest.py): one path, 4 segments.
SMALL_SEGMENT_BYTES = 256 * KiB  # a marker and three 64 KiB records
SMALL_PAYLOAD_BYTES = 60 * KiB  # header + payload = exactly one 64 KiB record


def backend(kind: str) -> IoBackend:
    """A fresh backend; call inside the test's event loop."""
    return open_backend(kind.removesuffix("-pychecks"), depth=32, threads=4)


def record_checks(kind: str) -> str:
    """The tier's record_checks for a test kind."""
    return "python" if kind.endswith("-pychecks") else "auto"


class Aligned:
    """Page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        self.view = memoryview(self._map)[:nbytes]

    def close(self) -> None:
        """Unmap now, or when the last slice taken from ``view`` is gone."""
        self.view.release()
        with contextlib.suppress(BufferError):
            self._map.close()


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def padded(data: bytes) -> Aligned:
    """``data`` in aligned memory, zero-padded to whole 4 KiB blocks."""
    buffer = Aligned(align_up(len(data), BLOCK_BYTES))
    buffer.view[: len(data)] = data
    return buffer


async def put(
    tier: L2Tier,
    key: bytes,
    data: bytes,
    namespace: str = "ns",
    meta: bytes = b"",
    parent: bytes = b"",
) -> L2Record:
    buffer = padded(data)
    try:
        views = [buffer.view] if len(buffer.view) else []
        return await tier.append(namespace, key, parent, meta, len(data), checksum(data), views)
    finally:
        buffer.close()


async def get(tier: L2Tier, record: L2Record) -> bytes:
    """The record's payload as L2Tier.read returns it (raises what read raises)."""
    buffer = Aligned(record.read_bytes)
    try:
        await tier.read(record, [buffer.view] if record.read_bytes else [])
        return bytes(buffer.view[: record.size])
    finally:
        buffer.close()


def open_devices(
    paths: Sequence[str],
    *,
    segments: int = 4,
    segment_bytes: int = MiB,
    stripe_bytes: int = 64 * KiB,
) -> DeviceSet:
    devices = DeviceSet(paths, segments * segment_bytes, segment_bytes, stripe_bytes)
    assert devices.direct, "tmp_path must take O_DIRECT for these tests"
    return devices


def raw_read(path: str, offset: int, nbytes: int) -> bytes:
    """Bytes of a file read the plain way (no O_DIRECT), to check where writes landed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def raw_write(path: str, offset: int, data: bytes) -> None:
    """Overwrite bytes behind the daemon's back (corruption, torn writes)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Evict a file's pages so an O_DIRECT read sees what raw_write left."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Env:
    """Opens DeviceSets and L2Tiers over the same files, like daemon restarts."""

    def __init__(
        self, root: Path, kind: str, paths: int, segments: int, segment_bytes: int,
        stripe_bytes: int = 64 * KiB,
    ) -> None:  # fmt: skip
        self.paths = [str(root / f"ssd{i}.dat") for i in range(paths)]
        self.kind = kind
        self.segments = segments
        self.segment_bytes = segment_bytes
        self.stripe_bytes = stripe_bytes
        self.opened: list[tuple[DeviceSet, IoBackend, L2Tier]] = []
        self.dropped: list[L2Record] = []

    async def open(self, wrap: object = None, *, recover: bool = True) -> L2Tier:
        """A tier over the files; recovered unless asked (the daemon always recovers)."""
        devices = open_devices(
            self.paths, segments=self.segments, segment_bytes=self.segment_bytes,
            stripe_bytes=self.stripe_bytes,
        )  # fmt: skip
        io = backend(self.kind)
        if wrap is not None:
            io = wrap(io)  # type: ignore[operator]
        tier = L2Tier(devices, io, record_checks(self.kind))
        assert tier.reads.native == (self.kind == "uring" and wrap is None)
        tier.on_drop = self.dropped.append
        self.opened.append((devices, io, tier))
        if recover:
            await tier.recover()
        return tier

    def shut(self, tier: L2Tier) -> None:
        for entry in self.opened:
            if entry[2] is tier:
                self.opened.remove(entry)
                tier.close()
                entry[1].close()
                entry[0].close()
                return

    def close_all(self) -> None:
        for _, io, tier in reversed(self.opened):
            tier.close()
            io.close()
        for devices, _, _ in self.opened:
            devices.close()
        self.opened = []

    def location(self, record: L2Record, at: int) -> tuple[str, int]:
        """File and offset of byte ``at`` of a record (0 = first header byte)."""
        logical = record.offset + at
        stripe = logical // self.stripe_bytes
        n = len(self.paths)
        return self.paths[stripe % n], (
            record.segment * self.segment_bytes + (stripe // n) * self.stripe_bytes
            + logical % self.stripe_bytes
        )  # fmt: skip

    def flip(self, record: L2Record, at: int) -> None:
        path, offset = self.location(record, at)
        old = raw_read(path, offset, 1)
        raw_write(path, offset, bytes([old[0] ^ 0x5A]))


class PassThrough:
    """An io backend that hands every call to ``inner``: tests subclass it
    to hold, count or watch the calls they care about."""

    def __init__(self, inner: IoBackend) -> None:
        self.inner = inner
        self.name = inner.name

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        return await self.inner.submit_many(ops)

    async def read(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return await self.inner.read(fd, offset, bufs)

    async def write(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return await self.inner.write(fd, offset, bufs)

    async def fsync(self, fd: int, *, data_only: bool = False) -> None:
        await self.inner.fsync(fd, data_only=data_only)

    def close(self) -> None:
        self.inner.close()
