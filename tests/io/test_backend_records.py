"""Tests for L2 record reads: the uring backend's ``read_records`` (cut into
ops and checked in C) and the plain-Python path of kvd.l2.reads, on the same
records.

Records are written in the L2 format to real O_DIRECT files, on one path or
striped over two, and read back in one batch: a good one, a payload that
fails its checksum, a header for another key, a tombstone over the record, a
record cut off by the end of the file, a closed fd. Every path must give
each the same status, and none but the good one may be a hit. The native
ring is tested directly too: whole-batch rejection of bad input, a prefix
accepted when the ring is full, buffers held until reaped, close with record
reads in flight, no leaks.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd.io import backend as iobackend
from kvd.io.backend import (
    IoBackend,
    OpKind,
    ReadStatus,
    RecordRead,
    StripeLayout,
    native_available,
    native_record_reads,
    open_backend,
)
from kvd.l2.format import BLOCK_BYTES, FLAG_TOMBSTONE, RECORD_ALIGN_BYTES, RecordHeader, align_up
from kvd.l2.reads import RecordReads
from kvd.wire.checksum import checksum

NATIVE_OK, NATIVE_REASON = native_available()
needs_native = pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)
TEST_TIMEOUT_S = 30.0
GENERATION = 0x1234_5678_9ABC_DEF1
PAYLOAD_BYTES = 20_000  # not a multiple of 4 KiB: the checksum stops mid-block
LAYOUT = StripeLayout((0,), BLOCK_BYTES, BLOCK_BYTES)  # reads nothing: the choice of checks


PATHS = [
    pytest.param(("uring", "auto"), id="uring-native",
                 marks=pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)),
    pytest.param(("uring", "python"), id="uring-python",
                 marks=pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)),
    pytest.param(("threads", "auto"), id="threads-python"),
]  # fmt: skip


class Aligned:
    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        self.view = memoryview(self.map)[:nbytes]

    def close(self) -> None:
        self.view.release()
        self.map.close()  # BufferError if an export leaked


def encode(key: bytes, payload: bytes, seq: int, flags: int = 0) -> bytes:
    header = RecordHeader("ns", key, b"", b"", GENERATION, seq, len(payload), checksum(payload),
                          flags).encode()  # fmt: skip
    body = header + payload
    return body + bytes(align_up(len(body), BLOCK_BYTES) - len(body))


Records = tuple[StripeLayout, dict[str, int]]  # the layout and each record's offset
SEGMENT_BYTES = 8 * RECORD_ALIGN_BYTES  # per path: the records of every layout fit in one


def slot_data() -> dict[str, bytes]:
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    flipped = bytearray(encode(b"flipped", good, 2))
    flipped[BLOCK_BYTES + 777] ^= 0x01
    return {
        "good": encode(b"good", good, 1),
        "flipped": bytes(flipped),
        "other_key": encode(b"someone", good, 3),
        "tombstone": encode(b"dead", good, 4, FLAG_TOMBSTONE),
        "cut": encode(b"cut", good, 5)[: BLOCK_BYTES + 8192],  # the file ends inside it
    }


@pytest.fixture(params=[1, 2], ids=["one-path", "striped"])
def record_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Records]:
    """Records at 64 KiB slots of segment 0: name -> logical offset, on one
    O_DIRECT file or striped over two in 4 KiB stripes (then each record
    spans both paths: two read ops)."""
    paths = [tmp_path / f"records{i}" for i in range(request.param)]
    writers = tuple(os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in paths)
    offsets = {}
    try:
        write_layout = StripeLayout(writers, SEGMENT_BYTES, BLOCK_BYTES)
        for i, (name, data) in enumerate(slot_data().items()):
            offsets[name] = i * RECORD_ALIGN_BYTES
            buffer = bytearray(align_up(len(data), BLOCK_BYTES))
            buffer[: len(data)] = data
            for op in write_layout.ops(OpKind.WRITE, 0, offsets[name], [memoryview(buffer)]):
                assert os.pwritev(op.fd, op.bufs, op.offset) == sum(len(b) for b in op.bufs)
    finally:
        for fd in writers:
            os.close(fd)
    readers = tuple(os.open(path, os.O_RDONLY | os.O_DIRECT) for path in paths)
    try:
        yield StripeLayout(readers, SEGMENT_BYTES, BLOCK_BYTES), offsets
    finally:
        for fd in readers:
            os.close(fd)


EXPECTED = {
    "good": (b"good", 1, ReadStatus.OK),
    "flipped": (b"flipped", 2, ReadStatus.BAD_CHECKSUM),
    "other_key": (b"other_key", 3, ReadStatus.BAD_HEADER),  # asks for a key it does not hold
    "tombstone": (b"dead", 4, ReadStatus.BAD_HEADER),
    "cut": (b"cut", 5, ReadStatus.SHORT),
}


def record_read(offset: int, key: bytes, seq: int, payload: memoryview) -> RecordRead:
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    return RecordRead(0, offset, BLOCK_BYTES, [payload], PAYLOAD_BYTES, checksum(good), seq,
                      GENERATION, "ns", key)  # fmt: skip


async def _read_all(
    io: IoBackend, layout: StripeLayout, checks: str, records: list[RecordRead]
) -> list[int]:
    reads = RecordReads(io, layout, checks)
    assert reads.native == (checks == "auto" and io.name == "uring")
    try:
        return list(await asyncio.gather(*(reads.read(r) for r in records)))
    finally:
        reads.close()


@pytest.mark.parametrize("path", PATHS)
def test_each_damage_is_a_miss_on_every_path(
    record_file: tuple[StripeLayout, dict[str, int]], path: tuple[str, str]
) -> None:
    layout, offsets = record_file
    kind, checks = path
    buffers = [Aligned(align_up(PAYLOAD_BYTES, BLOCK_BYTES)) for _ in EXPECTED]
    records = [
        record_read(offsets[name], key, seq, buffer.view)
        for (name, (key, seq, _)), buffer in zip(EXPECTED.items(), buffers, strict=True)
    ]
    # A record read from a bad fd fails with the kernel's errno.
    closed = StripeLayout((-1,) * len(layout.fds), layout.segment_bytes, layout.stripe_bytes)
    extra = Aligned(align_up(PAYLOAD_BYTES, BLOCK_BYTES))

    async def main() -> tuple[list[int], list[int]]:
        io = open_backend(kind, depth=8, threads=4)
        try:
            statuses = await asyncio.wait_for(_read_all(io, layout, checks, records),
                                              TEST_TIMEOUT_S)  # fmt: skip
            bad_fd = [record_read(0, b"good", 1, extra.view)]
            errors = await asyncio.wait_for(_read_all(io, closed, checks, bad_fd),
                                            TEST_TIMEOUT_S)  # fmt: skip
            return statuses, errors
        finally:
            io.close()

    statuses, errors = asyncio.run(main(), debug=True)
    assert statuses == [status for _, _, status in EXPECTED.values()]
    assert errors == [-errno.EBADF]
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    assert bytes(buffers[0].view[:PAYLOAD_BYTES]) == good
    records.clear()
    for buffer in [*buffers, extra]:
        buffer.close()


@needs_native
def test_read_records_is_the_native_path_only_on_uring() -> None:
    async def main() -> None:
        uring, threads = open_backend("uring", depth=4), open_backend("threads", depth=4)
        try:
            assert native_record_reads(uring) is not None
            assert native_record_reads(threads) is None
        finally:
            uring.close()
            threads.close()

    asyncio.run(main())


@needs_native
def test_many_records_through_a_small_ring(record_file: Records) -> None:
    """More records than the ring holds (of two ops each when striped): admitted
    as slots free up, two callers taking turns in line."""
    layout, offsets = record_file
    count = 40
    buffers = [Aligned(align_up(PAYLOAD_BYTES, BLOCK_BYTES)) for _ in range(count)]
    records = [record_read(offsets["good"], b"good", 1, b.view) for b in buffers]

    async def main() -> list[int]:
        io = open_backend("uring", depth=3)
        try:
            reads = native_record_reads(io)
            assert reads is not None
            half = count // 2
            statuses = [-1] * count

            def done(index: int, status: int) -> None:
                statuses[index] = status

            def done_second(index: int, status: int) -> None:
                statuses[half + index] = status

            await asyncio.wait_for(
                asyncio.gather(reads(layout, records[:half], done),
                               reads(layout, records[half:], done_second)),
                TEST_TIMEOUT_S,
            )  # fmt: skip
            return statuses
        finally:
            io.close()

    assert asyncio.run(main(), debug=True) == [ReadStatus.OK] * count
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    assert all(bytes(b.view[:PAYLOAD_BYTES]) == good for b in buffers)
    records.clear()
    for buffer in buffers:
        buffer.close()


# ---- the native ring itself ----------------------------------------------------


def native_record(offset: int, payload: list[object], key: object = b"k", *,
                  payload_bytes: int = 0, header_bytes: int = BLOCK_BYTES) -> Any:  # fmt: skip
    return (0, offset, header_bytes, payload, payload_bytes, 0, 1, GENERATION, "ns", key)


def one_path(fd: int) -> tuple[tuple[int, ...], int, int]:
    return (fd,), SEGMENT_BYTES, BLOCK_BYTES


@needs_native
def test_ring_rejects_a_bad_record_batch_whole(record_file: Records) -> None:
    layout, _ = record_file
    region = mmap.mmap(-1, BLOCK_BYTES)
    body = memoryview(region)
    good = native_record(0, [body])
    native = layout.native
    ring = iobackend.open_ring(8)
    try:
        logical_bytes = SEGMENT_BYTES * len(layout.fds)
        bad_batches: list[tuple[type[Exception], object, list[object]]] = [
            (TypeError, native, [good, good[:9]]),  # too few fields
            (ValueError, native, [good, native_record(-1, [body])]),
            (ValueError, native, [good, (-1, *good[1:])]),  # segment
            (ValueError, native, [good, native_record(0, [body], header_bytes=100)]),
            (ValueError, native, [good, native_record(0, [body], payload_bytes=BLOCK_BYTES + 1)]),
            (ValueError, native, [good, native_record(logical_bytes - BLOCK_BYTES, [body])]),
            (BufferError, native, [good, native_record(0, [b"read-only"])]),
            (TypeError, native, [good, native_record(0, [body], key="str")]),
            (TypeError, native, [good, native_record(0, [42])]),
            (TypeError, native, [good, native_record(0, body)]),  # not a list of buffers
            (TypeError, native, [good, (*good[:8], 7, b"k")]),  # namespace
            (ValueError, ((), SEGMENT_BYTES, BLOCK_BYTES), [good]),  # no path
            (ValueError, (layout.fds, SEGMENT_BYTES, 3 * BLOCK_BYTES), [good]),
            (ValueError, ((layout.fds[0],) * 65, SEGMENT_BYTES, BLOCK_BYTES), [good]),
        ]  # fmt: skip
        for exc_type, bad_layout, batch in bad_batches:
            with pytest.raises(exc_type):
                ring.submit_records(bad_layout, batch, 0, 1)  # type: ignore[arg-type]
            assert ring.inflight == 0
        with pytest.raises(ValueError, match="start"):
            ring.submit_records(native, [good], 2, 1)
    finally:
        ring.close()
    del body, good, bad_batches, batch
    region.close()  # raises BufferError if any export leaked


@needs_native
def test_ring_accepts_the_records_that_fit(tmp_path: Path) -> None:
    # Three paths in 4 KiB stripes: a record of 4 KiB header + 8 KiB payload
    # is three ops, one per path.
    fds = tuple(os.open(tmp_path / f"p{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(3))
    region = mmap.mmap(-1, 2 * BLOCK_BYTES)
    body = memoryview(region)
    layout = (fds, SEGMENT_BYTES, BLOCK_BYTES)
    ring = iobackend.open_ring(4)
    try:
        records = [native_record(i * RECORD_ALIGN_BYTES, [body]) for i in range(3)]
        assert ring.submit_records(layout, records, 0, 10) == 1  # 3 of 4 slots
        assert ring.inflight == 3
        assert ring.submit_records(layout, records, 1, 11) == 0  # the next needs 3 more
        done = ring.reap(4, wait_nr=3, timeout_ms=int(TEST_TIMEOUT_S * 1000))
        # One result for the record, once all three ops completed: empty files
        # read nothing, a short read.
        assert done == [(10, ReadStatus.SHORT)]
        assert ring.inflight == 0
        assert ring.submit_records(layout, records, 1, 11) == 1
        done = ring.reap(4, wait_nr=3, timeout_ms=int(TEST_TIMEOUT_S * 1000))
        assert done == [(11, ReadStatus.SHORT)]
    finally:
        ring.close()
        for fd in fds:
            os.close(fd)
    del body, records
    region.close()


@needs_native
def test_ring_holds_record_buffers_until_reaped() -> None:
    ring = iobackend.open_ring(2)
    region = mmap.mmap(-1, BLOCK_BYTES)
    body = memoryview(region)
    rfd, wfd = os.pipe()
    try:
        assert ring.submit_records(one_path(rfd), [native_record(0, [body])], 0, 7) == 1
        assert ring.reap(2, wait_nr=1, timeout_ms=20) == []
        del body
        with pytest.raises(BufferError):
            region.close()
        os.write(wfd, b"abc")  # 3 bytes of 8 KiB: a short read, a miss
        done = ring.reap(2, wait_nr=1, timeout_ms=int(TEST_TIMEOUT_S * 1000))
        assert done == [(7, ReadStatus.SHORT)]
        region.close()
    finally:
        ring.close()
        os.close(rfd)
        os.close(wfd)


@needs_native
def test_ring_close_releases_record_reads_in_flight() -> None:
    ring = iobackend.open_ring(4)
    region = mmap.mmap(-1, BLOCK_BYTES)
    body = memoryview(region)
    rfd, wfd = os.pipe()
    try:
        # Two paths (the same pipe twice), 4 KiB stripes: header and payload
        # are one op each.
        layout = ((rfd, rfd), SEGMENT_BYTES, BLOCK_BYTES)
        assert ring.submit_records(layout, [native_record(0, [body])], 0, 1) == 1
        assert ring.inflight == 2
        ring.close()  # cancelled, not waited for
        assert ring.inflight == 0
        del body
        region.close()
    finally:
        os.close(rfd)
        os.close(wfd)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_native
def test_ring_does_not_leak_over_2e4_records(record_file: Records) -> None:
    layout, offsets = record_file
    region = mmap.mmap(-1, align_up(PAYLOAD_BYTES, BLOCK_BYTES))
    body = memoryview(region)
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    key, namespace = b"good", "ns"
    refs_before = (sys.getrefcount(body), sys.getrefcount(key), sys.getrefcount(namespace))
    batch, rounds = 32, 625
    rss_warm = 0
    ring = iobackend.open_ring(64)
    native = layout.native
    try:
        for i in range(rounds):
            record = (0, offsets["good"], BLOCK_BYTES, [body], PAYLOAD_BYTES, checksum(good), 1,
                      GENERATION, namespace, key)  # fmt: skip
            records: list[Any] = [record] * (batch - 1)
            # A record past the end of the files each batch: a short read.
            records.append((0, 6 * RECORD_ALIGN_BYTES, *record[2:]))
            assert ring.submit_records(native, records, 0, 0) == batch
            done: list[tuple[int, int]] = []
            while len(done) < batch:
                done += ring.reap(64, wait_nr=1, timeout_ms=int(TEST_TIMEOUT_S * 1000))
            if i == 50:
                rss_warm = _rss_bytes()
        assert dict(done)[batch - 1] == ReadStatus.SHORT
        assert dict(done)[0] == ReadStatus.OK
        records.clear()
        del record
    finally:
        ring.close()
    assert (sys.getrefcount(body), sys.getrefcount(key), sys.getrefcount(namespace)) == refs_before
    assert _rss_bytes() - rss_warm < 4 * 1024 * 1024
    del body
    region.close()


def test_the_record_checks_are_chosen_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[bool]:
        kinds = [("uring", "auto"), ("uring", "python")] if NATIVE_OK else []
        native = []
        for kind, checks in [*kinds, ("threads", "auto")]:
            io = open_backend(kind, depth=4)
            try:
                native.append(RecordReads(io, LAYOUT, checks).native)
            finally:
                io.close()
        return native

    with caplog.at_level("INFO", logger="kvd.l2"):
        native = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "kvd.l2"]
    if NATIVE_OK:
        assert native == [True, False, False]
        assert lines == [
            "L2 record reads: batched, checked in C (kvd.io._uring)",
            "L2 record reads: batched, checked in Python (requested)",
            "L2 record reads: batched, checked in Python (threads io backend)",
        ]
    else:
        assert native == [False]
        assert lines == ["L2 record reads: batched, checked in Python (threads io backend)"]
    io = open_backend("threads", depth=1)
    try:
        with pytest.raises(ValueError, match="record checks"):
            RecordReads(io, LAYOUT, "c")
    finally:
        io.close()
