"""Tests for L2 record reads: the uring backend's ``read_records`` (checked in
C) and the plain-Python path of kvd.l2.reads, on the same records.

Records are written in the L2 format to a real O_DIRECT file and read back
in one batch: a good one, a payload that fails its checksum, a header for
another key, a tombstone over the record, a record cut off by the end of
the file, a closed fd. Every path must give each the same status, and none
but the good one may be a hit. The native ring is tested directly too:
whole-batch rejection of bad input, a prefix accepted when the ring is full,
buffers held until reaped, close with record reads in flight, no leaks.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvd.io import backend as iobackend
from kvd.io.backend import (
    IoBackend,
    IoOp,
    OpKind,
    ReadStatus,
    RecordRead,
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


@pytest.fixture
def record_file(tmp_path: Path) -> Iterator[tuple[int, dict[str, int]]]:
    """Records at 64 KiB slots: name -> offset; the fd is O_DIRECT."""
    path = tmp_path / "records"
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    flipped = bytearray(encode(b"flipped", good, 2))
    flipped[BLOCK_BYTES + 777] ^= 0x01
    slots = {
        "good": encode(b"good", good, 1),
        "flipped": bytes(flipped),
        "other_key": encode(b"someone", good, 3),
        "tombstone": encode(b"dead", good, 4, FLAG_TOMBSTONE),
        "cut": encode(b"cut", good, 5),
    }
    offsets = {}
    with open(path, "wb") as file:
        for i, (name, data) in enumerate(slots.items()):
            offsets[name] = i * RECORD_ALIGN_BYTES
            file.seek(offsets[name])
            file.write(data[: BLOCK_BYTES + 8192] if name == "cut" else data)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        yield fd, offsets
    finally:
        os.close(fd)


EXPECTED = {
    "good": (b"good", 1, ReadStatus.OK),
    "flipped": (b"flipped", 2, ReadStatus.BAD_CHECKSUM),
    "other_key": (b"other_key", 3, ReadStatus.BAD_HEADER),  # asks for a key it does not hold
    "tombstone": (b"dead", 4, ReadStatus.BAD_HEADER),
    "cut": (b"cut", 5, ReadStatus.SHORT),
}


def record_read(fd: int, offset: int, key: bytes, seq: int, header: memoryview,
                payload: memoryview, *, split: bool = False) -> RecordRead:  # fmt: skip
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    if split:  # two ops, as a record striped over two devices reads
        ops = [IoOp(OpKind.READ, fd, offset, [header]),
               IoOp(OpKind.READ, fd, offset + len(header), [payload])]  # fmt: skip
    else:
        ops = [IoOp(OpKind.READ, fd, offset, [header, payload])]
    return RecordRead(ops, header, [payload], PAYLOAD_BYTES, checksum(good), seq, GENERATION,
                      b"ns", key)  # fmt: skip


async def _read_all(io: IoBackend, checks: str, records: list[RecordRead]) -> list[int]:
    reads = RecordReads(io, checks)
    assert reads.native == (checks == "auto" and io.name == "uring")
    return list(await asyncio.gather(*(reads.read(r) for r in records)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("split", [False, True])
def test_each_damage_is_a_miss_on_every_path(
    record_file: tuple[int, dict[str, int]], path: tuple[str, str], split: bool
) -> None:
    fd, offsets = record_file
    kind, checks = path
    buffers = [Aligned(BLOCK_BYTES + align_up(PAYLOAD_BYTES, BLOCK_BYTES)) for _ in EXPECTED]
    records = []
    for (name, (key, seq, _)), buffer in zip(EXPECTED.items(), buffers, strict=True):
        header, payload = buffer.view[:BLOCK_BYTES], buffer.view[BLOCK_BYTES:]
        records.append(record_read(fd, offsets[name], key, seq, header, payload, split=split))
    # A record read from a bad fd fails with the kernel's errno.
    closed = -1
    extra = Aligned(BLOCK_BYTES + align_up(PAYLOAD_BYTES, BLOCK_BYTES))
    records.append(record_read(closed, 0, b"good", 1, extra.view[:BLOCK_BYTES],
                               extra.view[BLOCK_BYTES:], split=split))  # fmt: skip

    async def main() -> list[int]:
        io = open_backend(kind, depth=8, threads=4)
        try:
            return await asyncio.wait_for(_read_all(io, checks, records), TEST_TIMEOUT_S)
        finally:
            io.close()

    statuses = asyncio.run(main(), debug=True)
    want = [status for _, _, status in EXPECTED.values()] + [-errno.EBADF]
    assert statuses == want
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    assert bytes(buffers[0].view[BLOCK_BYTES : BLOCK_BYTES + PAYLOAD_BYTES]) == good
    records.clear()
    del header, payload  # the last slices taken
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
def test_many_records_through_a_small_ring(record_file: tuple[int, dict[str, int]]) -> None:
    """More records (of two ops each) than the ring holds: admitted as slots free up."""
    fd, offsets = record_file
    count = 40
    buffers = [Aligned(BLOCK_BYTES + align_up(PAYLOAD_BYTES, BLOCK_BYTES)) for _ in range(count)]
    records = [record_read(fd, offsets["good"], b"good", 1, b.view[:BLOCK_BYTES],
                           b.view[BLOCK_BYTES:], split=True) for b in buffers]  # fmt: skip

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
                asyncio.gather(reads(records[:half], done), reads(records[half:], done_second)),
                TEST_TIMEOUT_S,
            )
            return statuses
        finally:
            io.close()

    assert asyncio.run(main(), debug=True) == [ReadStatus.OK] * count
    records.clear()
    for buffer in buffers:
        buffer.close()


# ---- the native ring itself ----------------------------------------------------


def native_record(user_data: int, ops: Sequence[tuple[object, ...]], header: object,
                  payload: list[object], key: object = b"k") -> Any:  # fmt: skip
    return (user_data, ops, header, payload, 0, 0, 1, GENERATION, b"ns", key)


@needs_native
def test_ring_rejects_a_bad_record_batch_whole(record_file: tuple[int, dict[str, int]]) -> None:
    fd, _ = record_file
    region = mmap.mmap(-1, 2 * BLOCK_BYTES)
    head, body = memoryview(region)[:BLOCK_BYTES], memoryview(region)[BLOCK_BYTES:]
    good = native_record(1, [(fd, 0, [head, body])], head, [body])
    ring = iobackend.open_ring(8)
    try:
        bad_batches: list[tuple[type[Exception], list[object]]] = [
            (TypeError, [good, (2, [(fd, 0, head)], head)]),  # too few fields
            (ValueError, [good, native_record(2, [], head, [body])]),  # no ops
            (TypeError, [good, native_record(2, [(fd, 0)], head, [body])]),
            (ValueError, [good, native_record(2, [(fd, -1, head)], head, [body])]),
            (BufferError, [good, native_record(2, [(fd, 0, b"read-only")], head, [body])]),
            (TypeError, [good, native_record(2, [(fd, 0, head)], head, [body], key="str")]),
            (TypeError, [good, native_record(2, [(fd, 0, head)], head, [42])]),
        ]  # fmt: skip
        for exc_type, batch in bad_batches:
            with pytest.raises(exc_type):
                ring.submit_reads(batch)  # type: ignore[arg-type]
            assert ring.inflight == 0
    finally:
        ring.close()
    del head, body, good, bad_batches, batch
    region.close()  # raises BufferError if any export leaked


@needs_native
def test_ring_accepts_the_records_that_fit(record_file: tuple[int, dict[str, int]]) -> None:
    fd, offsets = record_file
    region = mmap.mmap(-1, 2 * BLOCK_BYTES)
    head, body = memoryview(region)[:BLOCK_BYTES], memoryview(region)[BLOCK_BYTES:]
    three_ops = [(fd, offsets["good"], head), (fd, 0, body), (fd, 0, body)]
    ring = iobackend.open_ring(4)
    try:
        records = [native_record(i, three_ops, head, [body]) for i in range(3)]
        assert ring.submit_reads(records) == 1  # 3 of 4 slots; the next needs 3 more
        assert ring.inflight == 3
        assert ring.submit_reads(records[1:]) == 0
        done = ring.reap(4, wait_nr=3, timeout_ms=int(TEST_TIMEOUT_S * 1000))
        # One result for the record, once all three ops completed: a header that
        # is not this record's (it asked for key b"k") is a miss.
        assert done == [(0, ReadStatus.BAD_HEADER)]
        assert ring.inflight == 0
    finally:
        ring.close()
    del head, body, three_ops, records
    region.close()


@needs_native
def test_ring_holds_record_buffers_until_reaped() -> None:
    ring = iobackend.open_ring(2)
    region = mmap.mmap(-1, 2 * BLOCK_BYTES)
    head, body = memoryview(region)[:BLOCK_BYTES], memoryview(region)[BLOCK_BYTES:]
    rfd, wfd = os.pipe()
    try:
        assert ring.submit_reads([native_record(7, [(rfd, 0, [head, body])], head, [body])]) == 1
        assert ring.reap(2, wait_nr=1, timeout_ms=20) == []
        del head, body
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
    region = mmap.mmap(-1, 2 * BLOCK_BYTES)
    head, body = memoryview(region)[:BLOCK_BYTES], memoryview(region)[BLOCK_BYTES:]
    rfd, wfd = os.pipe()
    try:
        ops = [(rfd, 0, head), (rfd, 0, body)]
        assert ring.submit_reads([native_record(1, ops, head, [body])]) == 1
        assert ring.inflight == 2
        ring.close()  # cancelled, not waited for
        assert ring.inflight == 0
        del head, body, ops
        region.close()
    finally:
        os.close(rfd)
        os.close(wfd)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_native
def test_ring_does_not_leak_over_2e4_records(record_file: tuple[int, dict[str, int]]) -> None:
    fd, offsets = record_file
    region = mmap.mmap(-1, BLOCK_BYTES + align_up(PAYLOAD_BYTES, BLOCK_BYTES))
    head, body = memoryview(region)[:BLOCK_BYTES], memoryview(region)[BLOCK_BYTES:]
    good = random.Random(1).randbytes(PAYLOAD_BYTES)
    key, namespace = b"good", b"ns"
    refs_before = (sys.getrefcount(head), sys.getrefcount(body), sys.getrefcount(key))
    batch, rounds = 32, 625
    rss_warm = 0
    ring = iobackend.open_ring(64)
    try:
        for i in range(rounds):
            expected = (PAYLOAD_BYTES, checksum(good), 1, GENERATION, namespace, key)
            records: list[Any] = [
                (j, [(fd, offsets["good"], [head, body])], head, [body], *expected)
                for j in range(batch)
            ]
            # An error completion each batch, on the second op of a record.
            two_ops = [(fd, offsets["good"], head), (-1, 0, body)]
            records[-1] = (batch - 1, two_ops, head, [body], *expected)
            assert ring.submit_reads(records) == batch
            done: list[tuple[int, int]] = []
            while len(done) < batch:
                done += ring.reap(64, wait_nr=1, timeout_ms=int(TEST_TIMEOUT_S * 1000))
            if i == 50:
                rss_warm = _rss_bytes()
        assert dict(done)[batch - 1] == -errno.EBADF
        assert dict(done)[0] == ReadStatus.OK
        records.clear()
        two_ops.clear()
        del expected
    finally:
        ring.close()
    assert (sys.getrefcount(head), sys.getrefcount(body), sys.getrefcount(key)) == refs_before
    assert _rss_bytes() - rss_warm < 4 * 1024 * 1024
    del head, body
    region.close()


def test_the_record_checks_are_chosen_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[bool]:
        kinds = [("uring", "auto"), ("uring", "python")] if NATIVE_OK else []
        native = []
        for kind, checks in [*kinds, ("threads", "auto")]:
            io = open_backend(kind, depth=4)
            try:
                native.append(RecordReads(io, checks).native)
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
            RecordReads(io, "c")
    finally:
        io.close()
