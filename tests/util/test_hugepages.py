"""Shared memory on huge pages where the kernel offers them (kvd.util.hugepages).

Real memfds and this process's own /proc: ``map_shared`` allocates and maps
a memfd in full, read-only mappings refuse writes, and with the kernel's
shmem huge pages on ``advise`` the pool's arena, a writer's mapping and a
reader's later mapping of the same memfd are on huge pages; on ``never``
they are not, and everything reads the same bytes either way."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.l1.pool import Pool
from kvd.tools.bench import shmem
from kvd.util.hugepages import huge_page_bytes, map_shared, mapping_address, shmem_mode

MiB = 1 << 20


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("kvd-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 8 * MiB)
    yield fd
    os.close(fd)


def test_shmem_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    setting = tmp_path / "shmem_enabled"
    setting.write_text("always within_size [advise] never deny force\n")
    assert shmem_mode(setting) == "advise"
    setting.write_text("garbage\n")
    assert shmem_mode(setting) == "unknown"
    assert shmem_mode(tmp_path / "missing") == "unknown"


def test_the_bench_sets_a_mode_and_puts_the_old_one_back(tmp_path: Path) -> None:
    setting = tmp_path / "shmem_enabled"
    setting.write_text("always within_size advise [never] deny force\n")
    with shmem.shmem_huge_pages("advise", setting) as old:
        assert old == "never"
        assert setting.read_text() == "advise"
    assert setting.read_text() == "never"
    with (
        pytest.raises(shmem.ShmemError, match="must be one of"),
        shmem.shmem_huge_pages("sometimes", setting),
    ):
        pass
    with (
        pytest.raises(shmem.ShmemError, match="no transparent huge pages"),
        shmem.shmem_huge_pages("advise", tmp_path / "missing"),
    ):
        pass


def test_map_shared_allocates_and_maps_in_full(memfd: int) -> None:
    mapping = map_shared(memfd, 8 * MiB)
    try:
        assert os.fstat(memfd).st_blocks * 512 >= 8 * MiB  # allocated, as posix_fallocate
        mapping[-4:] = b"last"
        reader = map_shared(memfd, 8 * MiB, populate=False, writable=False)
        try:
            assert reader[-4:] == b"last"
            with pytest.raises(TypeError):
                reader[0:1] = b"x"  # a read-only mapping
            assert mapping_address(reader) != mapping_address(mapping)
        finally:
            reader.close()
    finally:
        mapping.close()


def test_huge_pages_where_the_kernel_gives_them(memfd: int, shmem_huge_pages: str) -> None:
    writer = map_shared(memfd, 8 * MiB)
    try:
        writer[:] = bytes(range(256)) * (8 * MiB // 256)
        assert huge_page_bytes(writer) == 8 * MiB
        reader = map_shared(memfd, 8 * MiB, populate=False, writable=False)
        try:
            assert huge_page_bytes(reader) == 0  # nothing touched yet
            assert reader[:] == writer[:]
            assert huge_page_bytes(reader) == 8 * MiB  # mapped whole, 2 MiB at a time
        finally:
            reader.close()
    finally:
        writer.close()
    pool = Pool(16 * MiB, shared=True)
    try:
        assert pool.huge_page_bytes() == 16 * MiB
    finally:
        pool.close()


def test_no_huge_pages_where_the_kernel_says_never(memfd: int, shmem_huge_pages: str) -> None:
    with shmem.shmem_huge_pages("never"):
        mapping = map_shared(memfd, 8 * MiB)
        try:
            assert huge_page_bytes(mapping) == 0
            mapping[:4] = b"kvd!"
            assert mapping[:4] == b"kvd!"
        finally:
            mapping.close()


def test_an_unmapped_or_foreign_mapping_counts_nothing(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text("")
    anon = mmap.mmap(-1, MiB)
    try:
        assert huge_page_bytes(anon, smaps) == 0
        assert huge_page_bytes(anon, tmp_path / "missing") == 0
    finally:
        anon.close()
