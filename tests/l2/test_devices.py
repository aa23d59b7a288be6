"""Tests for kvd.l2.devices: striping math against the bytes on disk, opening
and sizing paths, and the exclusive lock that keeps fsck and the daemon apart."""

from __future__ import annotations

import errno
import itertools
import os
import random
from pathlib import Path

import pytest

from kvd.io.backend import OpKind
from kvd.l2.devices import DeviceError, DeviceSet, lock_paths
from tests.l2 import BACKENDS, Aligned, KiB, MiB, backend, open_devices, raw_read

SEGMENT_BYTES = 256 * KiB  # per path
STRIPE_BYTES = 16 * KiB
SEGMENTS = 3


def expected_location(
    logical: int, segment: int, paths: int, segment_bytes: int, stripe_bytes: int
) -> tuple[int, int]:
    """(path index, file offset) of a logical byte, straight from the docstring."""
    stripe = logical // stripe_bytes
    return stripe % paths, (
        segment * segment_bytes + (stripe // paths) * stripe_bytes + logical % stripe_bytes
    )


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("path_count", [1, 3])
async def test_ops_put_bytes_where_the_stripe_math_says(
    tmp_path: Path, kind: str, path_count: int
) -> None:
    paths = [str(tmp_path / f"d{i}.dat") for i in range(path_count)]
    devices = open_devices(
        paths, segments=SEGMENTS, segment_bytes=SEGMENT_BYTES, stripe_bytes=STRIPE_BYTES
    )
    io = backend(kind)
    rng = random.Random(path_count)
    logical_bytes = devices.logical_segment_bytes
    assert logical_bytes == SEGMENT_BYTES * path_count
    assert devices.segment_count == SEGMENTS
    assert devices.capacity_bytes == SEGMENTS * logical_bytes
    # Ranges: aligned starts and lengths in 4 KiB, inside and across stripes,
    # a whole segment, and ranges given as several views.
    cases = [(1, 0, logical_bytes, 1), (0, 0, 4 * KiB, 1), (2, logical_bytes - 8 * KiB, 8 * KiB, 2)]
    for _ in range(12):
        start = rng.randrange(0, logical_bytes // (4 * KiB)) * 4 * KiB
        length = rng.randrange(1, (logical_bytes - start) // (4 * KiB) + 1) * 4 * KiB
        cases.append((rng.randrange(SEGMENTS), start, length, rng.randrange(1, 4)))
    try:
        for segment, start, length, view_count in cases:
            data = rng.randbytes(length)
            buffer = Aligned(length)
            buffer.view[:] = data
            cuts = sorted({0, length, *(rng.randrange(0, length // 4096) * 4096
                                        for _ in range(view_count - 1))})  # fmt: skip
            views = [buffer.view[a:b] for a, b in itertools.pairwise(cuts)]
            ops = devices.ops(OpKind.WRITE, segment, start, views)
            fds = [op.fd for op in ops]
            assert len(fds) == len(set(fds)), "at most one op per path"
            stripes = (start + length - 1) // STRIPE_BYTES - start // STRIPE_BYTES + 1
            assert len(ops) == min(path_count, stripes)
            assert sum(len(b) for op in ops for b in op.bufs) == length
            results = await io.submit_many(ops)
            assert results == [sum(len(b) for b in op.bufs) for op in ops]
            # Every 4 KiB block landed where the docstring's formula says.
            for block in range(0, length, 4096):
                path, offset = expected_location(
                    start + block, segment, path_count, SEGMENT_BYTES, STRIPE_BYTES
                )
                assert raw_read(paths[path], offset, 4096) == data[block : block + 4096], (
                    segment, start, block,
                )  # fmt: skip
            # And reads through ops() bring the same bytes back.
            back = Aligned(length)
            results = await io.submit_many(devices.ops(OpKind.READ, segment, start, [back.view]))
            assert sum(results) == length
            assert bytes(back.view) == data
            buffer.close()
            back.close()
    finally:
        io.close()
        devices.close()


def test_ops_stay_inside_the_segment(tmp_path: Path) -> None:
    devices = open_devices([str(tmp_path / "d")], segments=2, segment_bytes=MiB)
    buffer = Aligned(8 * KiB)
    try:
        with pytest.raises(AssertionError):
            devices.ops(OpKind.READ, 0, MiB - 4 * KiB, [buffer.view])
        with pytest.raises(AssertionError):
            devices.ops(OpKind.READ, 2, 0, [buffer.view])
        assert devices.ops(OpKind.READ, 1, 0, []) == []
    finally:
        buffer.close()
        devices.close()


def test_files_are_created_and_sized(tmp_path: Path) -> None:
    paths = [str(tmp_path / "sub" / f"d{i}") for i in range(2)]
    devices = DeviceSet(paths, 3 * MiB + 5, MiB, 64 * KiB)
    try:
        assert devices.segment_count == 3
        assert [os.path.getsize(p) for p in paths] == [3 * MiB + 5] * 2
        assert len(set(devices.fds())) == 2
    finally:
        devices.close()
    assert devices.devices == []


def test_refuses_bad_geometry(tmp_path: Path) -> None:
    path = str(tmp_path / "d")
    with pytest.raises(DeviceError) as info:
        DeviceSet([], MiB, MiB, 64 * KiB)
    assert info.value.errno == errno.EINVAL
    with pytest.raises(DeviceError) as info:
        DeviceSet([path], 4 * MiB, MiB, 96 * KiB)
    assert info.value.errno == errno.EINVAL
    with pytest.raises(DeviceError) as info:
        DeviceSet([path], MiB + MiB // 2, MiB, 64 * KiB)  # one segment only
    assert info.value.errno == errno.ENOSPC


def test_lock_paths_is_exclusive(tmp_path: Path) -> None:
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path in paths:
        Path(path).write_bytes(b"")
    held = lock_paths(paths)
    try:
        with pytest.raises(DeviceError) as info:
            lock_paths(paths[1:])
        assert info.value.errno == errno.EBUSY
        assert paths[1] in str(info.value)
    finally:
        for fd in held:
            os.close(fd)
    again = lock_paths(paths)  # released with the fds
    for fd in again:
        os.close(fd)
    with pytest.raises(DeviceError) as info:
        lock_paths([str(tmp_path / "missing")])
    assert info.value.errno == errno.ENOENT
