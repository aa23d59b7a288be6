"""``kvd bench l2`` on a small data set: rows for every case (the fill's and
the durable puts among them) with GB/s and CPU time per op, on a directory
and on RAM-backed loop devices it makes itself (root only), striped over two
of them, and cleaned up after."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from kvd.io.backend import native_available
from kvd.store.writeback import WORKERS
from kvd.tools.bench import l2_read, ramdisk

MiB = 1 << 20
DATA_BYTES = 16 * MiB
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("losetup") is None, reason="loop devices need root"
)


def _attached() -> str:
    return subprocess.run(["losetup", "-l", "-n", "-O", "BACK-FILE"], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip


def _check_rows(rows: list[l2_read.Row], devices: int) -> None:
    backends = {"uring", "threads"} if native_available()[0] else {"threads"}
    fill = "uring" if native_available()[0] else "threads"
    puts = {(fill, "put"), (fill, "put-durable")}
    cases = {(b, p) for b in backends for p in l2_read.READ_PATHS} | puts
    assert {(r.backend, r.path) for r in rows} == cases
    depths = {"put": WORKERS, "put-durable": l2_read.DURABLE_WRITERS}
    for row in rows:
        depth = depths.get(row.path, 4)
        assert row.devices == devices and row.block_bytes == 64 << 10 and row.depth == depth
        assert row.kvd_gbps > 0 and row.cpu_us_per_read > 0
        if row.path not in ("put", "put-durable") and row.fio_gbps is not None:
            # fio read before and after the depth's cases; the ceiling is their mean
            assert len(row.fio_runs) == 2 and row.fio_gbps == sum(row.fio_runs) / 2
        if row.path not in ("put", "put-durable") and shutil.which("fio"):
            # and replayed the tier's own reads, before and after too
            assert len(row.replay_runs) == 2 and row.replay_gbps == sum(row.replay_runs) / 2
            assert row.replay_gbps > 0
    table = l2_read.markdown(rows)
    assert "CPU µs/op" in table and table.count("\n") == len(rows) + 1


@pytest.mark.slow
def test_bench_on_a_directory(tmp_path: Path) -> None:
    target = l2_read.Target.of([str(tmp_path)], [], data_bytes=DATA_BYTES)
    said: list[str] = []
    rows = l2_read.run(target, said.append, blocks_bytes=[64 << 10], depths=[4], seconds=0.2)
    _check_rows(rows, 1)
    assert not (tmp_path / l2_read.DATA_FILE).exists()
    # fio read into huge pages, as kvd's L1, or the run said why not (not root, none free)
    on_small_pages = [line for line in said if "fio's buffers on 4 KiB pages" in line]
    assert {row.fio_huge_pages for row in rows} == {not on_small_pages}
    assert os.geteuid() == 0 or on_small_pages


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize(("count", "fs"), [(2, "none"), (1, "ext4")])
def test_bench_on_ramdisks_it_makes_and_removes(count: int, fs: str) -> None:
    # 256 MiB each: the tier wants at least two 64 MiB segments per path.
    with ramdisk.ramdisks(count, 256 * MiB, fs) as made:
        assert len(made) == count
        for path in made:
            mode = os.stat(path).st_mode
            assert stat.S_ISBLK(mode) if fs == "none" else stat.S_ISDIR(mode)
        on_fs = fs != "none"
        target = l2_read.Target.of(made if on_fs else [], [] if on_fs else made, DATA_BYTES)
        rows = l2_read.run(target, lambda _: None, blocks_bytes=[64 << 10], depths=[4],
                           seconds=0.2)  # fmt: skip
        _check_rows(rows, count)
        backing = [line for line in _attached().splitlines() if "kvd-ramdisk-" in line]
        assert len(backing) >= count
    for path in made:
        assert not os.path.exists(path) or not _is_ours(path)
    assert not [d for d in os.listdir(ramdisk.SHM_DIR) if d.startswith("kvd-ramdisk-")]


def _is_ours(device: str) -> bool:
    """Whether ``device`` is still a loop device backed by a kvd ramdisk file."""
    out = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", device], capture_output=True,
                         text=True)  # fmt: skip
    return "kvd-ramdisk-" in out.stdout


def test_lay_out_leaves_no_unwritten_block_for_fio(tmp_path: Path) -> None:
    """fio reads the span the records take; the lay-out writes data into every
    block of it first (padding included), so no read of fio's lands in a hole
    (a cheaper read than one of data), and the fill then works on top."""
    target = l2_read.Target.of([str(tmp_path)], [], data_bytes=DATA_BYTES)
    per_path = l2_read._bytes_per_path(target)
    l2_read._lay_out(target)
    path = target.paths[0]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.fstat(fd).st_size == per_path
        assert os.lseek(fd, 0, os.SEEK_HOLE) == per_path  # data up to the end
        assert os.pread(fd, 4096, per_path - 4096) != bytes(4096)
    finally:
        os.close(fd)
    count, _ = asyncio.run(l2_read._fill(target, "threads", 64 << 10))
    assert count == DATA_BYTES // (64 << 10)
    case = asyncio.run(l2_read._read_tier(target, "threads", 4, 0.2, batched=True))
    assert case.gbps > 0
    l2_read._wipe(target)


def test_the_replay_log_reads_each_record_as_the_tier_does(tmp_path: Path) -> None:
    """fio's replay log holds random records of the run's values (not the
    durable puts'), each read as the tier reads it: its header block and
    payload, 68 KiB for a 64 KiB value, on the paths the stripes put it."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for where in dirs:
        where.mkdir()
    target = l2_read.Target.of([str(d) for d in dirs], [], data_bytes=DATA_BYTES)
    l2_read._lay_out(target)
    asyncio.run(l2_read._fill(target, "threads", 64 << 10))
    asyncio.run(l2_read._durable(target, "threads", 16 << 10))
    log = tmp_path / "reads.iolog"
    asyncio.run(l2_read._write_replay_log(target, log))
    lines = log.read_text().splitlines()
    assert lines[0] == "fio version 2 iolog"
    for path in target.paths:
        assert f"{path} add" in lines and f"{path} open" in lines and lines.count(f"{path} close")
    reads = [(path, int(offset), int(length)) for path, _, offset, length in
             (line.split() for line in lines if " read " in line)]  # fmt: skip
    # A record that crosses a 256 KiB stripe is two reads, one on each path.
    assert l2_read.REPLAY_READS < len(reads) < 2 * l2_read.REPLAY_READS
    # 68 KiB a record: the 64 KiB values', never the 16 KiB durable puts' (20 KiB)
    assert sum(length for *_, length in reads) == l2_read.REPLAY_READS * (68 << 10)
    assert {path for path, *_ in reads} == set(target.paths)
    assert all(offset % 4096 == 0 and length % 4096 == 0 for _, offset, length in reads)
    l2_read._wipe(target)


def test_bad_bench_settings_are_refused(tmp_path: Path) -> None:
    target = l2_read.Target.of([str(tmp_path)], [], data_bytes=DATA_BYTES)
    for bad in ({"depths": [0]}, {"blocks_bytes": [1000]}, {"read_paths": ["l1"]},
                {"seconds": 0.0}):  # fmt: skip
        with pytest.raises(ValueError):
            l2_read.run(target, lambda _: None, **bad)
    with pytest.raises(ValueError, match="not a block device"):
        l2_read.Target.of([], [str(tmp_path)])
    with pytest.raises(ramdisk.RamdiskError), ramdisk.ramdisks(1, 64 * MiB, "xfs"):
        pass
    with pytest.raises(ramdisk.RamdiskError, match="count"):
        ramdisk.check_can_make(0, MiB)


def _cgroups() -> str:
    return Path("/proc/self/cgroup").read_text()


@needs_root
def test_ramdisk_reads_can_be_capped_per_device() -> None:
    """``read_bps`` puts this process in a throttled cgroup for the run (each
    device's limit written there), and takes it out again."""
    if (
        not (ramdisk.CGROUP_ROOT / "blkio" / "blkio.throttle.read_bps_device").exists()
        and not (ramdisk.CGROUP_ROOT / "cgroup.controllers").exists()
    ):
        pytest.skip("no block throttle on this machine")
    before = _cgroups()
    with ramdisk.ramdisks(2, 64 * MiB, "none", read_bps=100 * MiB) as made:
        inside = _cgroups()
        assert inside != before and f"kvd-bench-{os.getpid()}" in inside
        group = next(ramdisk.CGROUP_ROOT.rglob(f"kvd-bench-{os.getpid()}"))
        limits = "".join(p.read_text() for p in group.iterdir()
                         if p.name in ("blkio.throttle.read_bps_device", "io.max"))  # fmt: skip
        for device in made:
            st = os.stat(device)
            assert f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" in limits
        assert str(100 * MiB) in limits
    assert _cgroups() == before
    assert not list(ramdisk.CGROUP_ROOT.rglob(f"kvd-bench-{os.getpid()}"))
