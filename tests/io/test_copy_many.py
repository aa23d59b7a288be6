"""The region copies' native batch (``kvd.io._uring.copy_many``) against the
plain-Python copies it replaces (``kvd.paths.shm.jobs.run_jobs`` without it):
the same bytes land, with the same checksums, both ways, over one page run
or many; sizes that do not fit are refused before anything is copied."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvd.io.backend import native_copy_many
from kvd.paths.shm.jobs import CopyJob, run_jobs
from kvd.wire.checksum import checksum

native = native_copy_many()
needs_native = pytest.mark.skipif(native is None, reason="kvd.io._uring is not built")


def _pages(sizes: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(size)) for size in sizes]


def _jobs(region: np.ndarray, layouts: list[list[int]]) -> list[CopyJob]:
    jobs, at = [], 0
    for index, sizes in enumerate(layouts):
        total = sum(sizes)
        jobs.append(CopyJob(index, region[at : at + total], _pages(sizes), total))
        at += total + 4096
    return jobs


# The last two pass the native copy's 256 KiB chunks, whole and mid-chunk.
LAYOUTS = [[65536], [1], [65536, 65536, 1000], [4096] * 40, [3 << 20, 65536],
           [(1 << 20) + 7, 300000, 5]]  # fmt: skip


@needs_native
@pytest.mark.parametrize("impl", ["native", "python"])
def test_puts_and_gets_land_the_same_bytes_with_their_checksums(impl: str) -> None:
    size = sum(sum(sizes) + 4096 for sizes in LAYOUTS)
    region = np.frombuffer(bytearray(os.urandom(size)), dtype=np.uint8)
    copier = native if impl == "native" else None
    puts = _jobs(region, LAYOUTS)
    run_jobs(puts, True, copier)
    for job in puts:
        assert b"".join(job.views) == job.span.tobytes()
        assert job.checksum == checksum(job.span.tobytes())
    back = np.zeros(size, dtype=np.uint8)
    gets = _jobs(back, LAYOUTS)
    for put, get in zip(puts, gets, strict=True):
        get.views = put.views
    run_jobs(gets, False, copier)
    for put, get in zip(puts, gets, strict=True):
        assert get.span.tobytes() == put.span.tobytes()
        assert get.checksum == put.checksum


@needs_native
def test_a_get_into_more_room_than_the_value_copies_the_value() -> None:
    assert native is not None
    pages = [memoryview(b"x" * 100), memoryview(b"y" * 50)]
    room = bytearray(b"\0" * 4096)
    (digest,) = native([(room, pages)], False)
    assert bytes(room[:150]) == b"x" * 100 + b"y" * 50 and room[150:] == b"\0" * (4096 - 150)
    assert digest == checksum(b"x" * 100 + b"y" * 50)
    assert native([], True) == []


@needs_native
def test_sizes_that_do_not_fit_are_refused_and_nothing_is_copied() -> None:
    assert native is not None
    span = bytearray(b"s" * 100)
    pages = [bytearray(60), bytearray(60)]
    with pytest.raises(ValueError, match="120 bytes"):
        native([(span, pages)], True)  # a put fills its pages exactly
    small = bytearray(10)
    good = (bytearray(4), [memoryview(b"abcd")])
    with pytest.raises(ValueError):
        native([good, (small, [memoryview(b"z" * 11)])], False)  # no room for a get
    assert good[0] == bytearray(4)  # the good job was not copied either
    with pytest.raises(BufferError):
        native([(b"read-only", [memoryview(b"v")])], False)  # a get writes its span
    with pytest.raises(TypeError):
        native([(span,)], True)
    with pytest.raises(TypeError):
        native([(span, 7)], True)
