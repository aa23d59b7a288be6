"""Huge pages for fio's buffers (kvd.tools.bench.hugetlb): reserved and
mounted for the block, fio reads into them, and everything is given back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvd.tools.bench import hugetlb
from kvd.tools.bench.backends import fio_randread

MiB = 1 << 20


def _mounted(path: str) -> bool:
    with open("/proc/mounts") as mounts:
        return any(line.split()[1] == path and line.split()[2] == "hugetlbfs" for line in mounts)


@pytest.mark.skipif(os.geteuid() != 0, reason="reserving huge pages needs root")
def test_fio_reads_into_huge_pages_reserved_for_the_block(tmp_path: Path) -> None:
    before = int(hugetlb.NR_HUGEPAGES.read_text())
    with hugetlb.fio_huge_buffers(4 * (64 << 10)) as buffers:
        if buffers.path is None:
            pytest.skip(buffers.why_not)  # the kernel had no free huge pages
        mount = os.path.dirname(buffers.path)
        assert _mounted(mount)
        assert int(hugetlb.NR_HUGEPAGES.read_text()) >= before + 1 + hugetlb.SPARE_PAGES
        assert buffers.fio_args() == [f"--mem=mmaphuge:{buffers.path}"]
        if shutil.which("fio"):
            data = tmp_path / "data"
            data.write_bytes(os.urandom(16 * MiB))
            gbps = fio_randread(str(data), block_bytes=64 << 10, queue_depth=4, seconds=1,
                                file_bytes=16 * MiB, extra=buffers.fio_args())  # fmt: skip
            assert gbps is not None and gbps > 0
    assert not _mounted(mount) and not os.path.exists(mount)
    assert int(hugetlb.NR_HUGEPAGES.read_text()) == before


def test_without_root_fio_keeps_its_own_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugetlb.os, "geteuid", lambda: 1000)
    with hugetlb.fio_huge_buffers(MiB) as buffers:
        assert buffers.path is None and "not root" in buffers.why_not
        assert buffers.fio_args() == []
