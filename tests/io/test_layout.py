"""The stripe layout: ``StripeLayout.ops`` (writes, recovery, the Python record
reads) and the native ring's own cut of a record read (native/kvd_reads.c)
must put every byte in the same place.

Random layouts and records are read both ways from files of random bytes:
the native ring's payload buffers must hold exactly what the Python ops
read, and the ring must use as many ops as the Python cut.
"""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.io import backend as iobackend
from kvd.io.backend import IoOp, OpKind, StripeLayout, native_available

NATIVE_OK, NATIVE_REASON = native_available()
needs_native = pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)
KiB = 1024
BLOCK = 4 * KiB
PATHS_MAX = 5
SEGMENTS = 3
TIMEOUT_MS = 30_000


@pytest.fixture
def files(tmp_path: Path) -> Iterator[list[int]]:
    """Paths filled with random bytes, large enough for every layout below."""
    fds = []
    rng = random.Random(7)
    try:
        for i in range(PATHS_MAX):
            fd = os.open(tmp_path / f"path{i}", os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            os.write(fd, rng.randbytes(SEGMENTS * 1024 * KiB))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def read_python(layout: StripeLayout, segment: int, offset: int, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    for op in layout.ops(OpKind.READ, segment, offset, [memoryview(buffer)]):
        assert os.preadv(op.fd, op.bufs, op.offset) == sum(len(b) for b in op.bufs)
    return bytes(buffer)


def test_ops_cover_the_range_once_per_path() -> None:
    layout = StripeLayout((10, 11, 12), 256 * KiB, 16 * KiB)
    view = memoryview(bytearray(100 * KiB))
    ops = layout.ops(OpKind.READ, 1, 8 * KiB, [view])
    # Stripes 0..6 of the range go to paths 0,1,2,0,1,2,0: one op per path.
    assert [op.fd for op in ops] == [10, 11, 12]
    assert ops[0].offset == 256 * KiB + 8 * KiB  # segment 1, inside the first stripe
    assert sum(len(b) for op in ops for b in op.bufs) == 100 * KiB
    assert layout.ops(OpKind.READ, 0, 0, []) == []


def test_ops_past_iov_max_are_cut() -> None:
    layout = StripeLayout((3,), 64 * 1024 * KiB, 64 * KiB)
    pieces = [memoryview(bytearray(BLOCK)) for _ in range(1100)]
    ops = layout.ops(OpKind.WRITE, 0, 0, pieces)
    assert [len(op.bufs) for op in ops] == [1024, 76]
    assert ops[1].offset == 1024 * BLOCK
    for op in ops:
        op.check()


@pytest.mark.parametrize(
    ("fds", "segment_bytes", "stripe_bytes"),
    [((), 64 * KiB, 4 * KiB), ((1,) * 65, 64 * KiB, 4 * KiB), ((1,), 64 * KiB, 24 * KiB),
     ((1,), 64 * KiB, 0)],
)  # fmt: skip
def test_bad_layouts_are_refused(
    fds: tuple[int, ...], segment_bytes: int, stripe_bytes: int
) -> None:
    with pytest.raises(ValueError):
        StripeLayout(fds, segment_bytes, stripe_bytes)


@needs_native
def test_native_cut_matches_the_layout(files: list[int]) -> None:
    rng = random.Random(11)
    ring = iobackend.open_ring(256)
    try:
        for case in range(300):
            paths = rng.randint(1, PATHS_MAX)
            stripe = BLOCK * rng.choice([1, 2, 4, 16])
            segment_bytes = stripe * rng.choice([16, 32, 64])
            segment_bytes = min(segment_bytes, 1024 * KiB) // stripe * stripe
            layout = StripeLayout(tuple(files[:paths]), segment_bytes, stripe)
            header = BLOCK * rng.choice([1, 2])
            room = layout.logical_segment_bytes - header
            blocks = rng.randint(1, min(room // BLOCK, 96))
            offset = BLOCK * rng.randint(0, (room - blocks * BLOCK) // BLOCK)
            segment = rng.randrange(SEGMENTS)
            # The payload in random pieces of whole blocks, as pool runs are.
            cuts = sorted(rng.sample(range(1, blocks), min(blocks - 1, rng.randint(0, 6))))
            sizes = [b - a for a, b in zip([0, *cuts], [*cuts, blocks], strict=True)]
            region = mmap.mmap(-1, blocks * BLOCK)
            pieces, at = [], 0
            for size in sizes:
                pieces.append(memoryview(region)[at : at + size * BLOCK])
                at += size * BLOCK
            record = (segment, offset, header, pieces, blocks * BLOCK, 0, 1, 1, "ns", b"k")
            assert ring.submit_records(layout.native, [record], 0, case) == 1
            header_view = memoryview(bytearray(header))
            python_ops: list[IoOp] = layout.ops(OpKind.READ, segment, offset,
                                                [header_view, *pieces])  # fmt: skip
            assert ring.inflight == len(python_ops), case
            done = ring.reap(256, wait_nr=ring.inflight, timeout_ms=TIMEOUT_MS)
            assert [ud for ud, _ in done] == [case]  # random bytes: not a header, a miss
            want = read_python(layout, segment, offset, header + blocks * BLOCK)[header:]
            assert bytes(region) == want, case
            pieces.clear()
            del header_view, python_ops, record
            region.close()
    finally:
        ring.close()


@needs_native
def test_native_cut_past_iov_max(files: list[int]) -> None:
    # 1,100 pieces of 1 KiB on one path (buffered: any size goes): two ops,
    # as the layout cuts them.
    layout = StripeLayout((files[0],), 2 * 1024 * KiB, 64 * KiB)
    region = mmap.mmap(-1, 1100 * KiB)
    pieces = [memoryview(region)[i * KiB : (i + 1) * KiB] for i in range(1100)]
    ring = iobackend.open_ring(8)
    try:
        record = (0, 0, BLOCK, pieces, 1100 * KiB, 0, 1, 1, "ns", b"k")
        assert ring.submit_records(layout.native, [record], 0, 1) == 1
        assert ring.inflight == 2
        assert len(layout.ops(OpKind.READ, 0, 0, [memoryview(bytearray(BLOCK)), *pieces])) == 2
        ring.reap(8, wait_nr=2, timeout_ms=TIMEOUT_MS)
        assert bytes(region) == read_python(layout, 0, 0, BLOCK + 1100 * KiB)[BLOCK:]
    finally:
        ring.close()
    pieces.clear()
    del record
    region.close()


def test_ops_past_op_bytes_max_are_cut() -> None:
    # One buffer of 2.5 GiB as the layout would see it (never allocated: a
    # memoryview of a large sparse mapping).
    gib = 1 << 30
    region = mmap.mmap(-1, 2 * gib + gib // 2)
    try:
        view = memoryview(region)
        ops = StripeLayout((3,), 4 * gib, 64 * KiB).ops(OpKind.READ, 0, 0, [view])
        assert [(op.offset, sum(len(b) for b in op.bufs)) for op in ops] == [
            (0, gib), (gib, gib), (2 * gib, gib // 2)]  # fmt: skip
        ops.clear()
        view.release()
    finally:
        region.close()
