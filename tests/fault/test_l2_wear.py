"""The L2 side played by an unlucky operator and a failing disk: settings
that make L1 hold more than L2 can keep, devices that go read-only (and
back), and an ``ssd_bytes`` larger than the file system's free space.

Each test runs a real daemon over real files, or a real loop device, and is
bounded to a few seconds of waiting. What they assert:

- an idle daemon does no L2 I/O, whatever L1 and L2 hold; what reinsertion
  rewrites is bounded by what was put, and reported (kvd_l2_write_amplification);
- write errors are counted where they happen (l2_write_errors), the daemon
  keeps serving, and SIGTERM after them exits 0;
- a read-only device, or a file that cannot be allocated, stops start-up
  with a message naming the path, and leaves no partly allocated file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.config.rules import l2_capacity_warning
from kvd.config.settings import Config
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.tier import L2Tier
from kvd.store.index import StoreLimits
from kvd.store.store import Store
from kvd.tools.bench.daemon import written_back
from kvd.wire.checksum import checksum
from tests.l2 import backend, open_devices
from tests.support import WRITE_BACK_WAIT_S, DaemonProcess, wait_until

pytestmark = pytest.mark.fault

MiB = 1 << 20
GiB = 1 << 30
NS = "wear"
# L1 (48 MiB) holds more than L2 (4 segments of 8 MiB) can keep.
DRAM = "48MiB"
SSD = "32MiB"
SEGMENT = "8MiB"
VALUE_BYTES = MiB
VALUES = 40  # 40 MiB: fits in L1, not in L2
# How long write-back may take to settle after the last put, and the window
# over which an idle daemon's L2 counters must not move.
SETTLE_S = 8.0
IDLE_WINDOW_S = 2.0


# Every command run here (losetup, mkfs, mount) is given this long.
COMMAND_TIMEOUT_S = 30
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(c) for c in ("losetup", "blockdev", "mkfs.ext4")),
    reason="needs root, losetup, blockdev and mkfs.ext4 (loop devices)",
)


def value_for(i: int, size: int = VALUE_BYTES) -> bytes:
    return (b"%08d" % i) * (size // 8)


def metric(daemon: DaemonProcess, name: str) -> float:
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


def l2_io(client: Client) -> tuple[int, int, int]:
    stats = client.stats()
    return stats["l2_writes"], stats["l2_reclaims"], stats["writeback_queue"]


def settled(client: Client, timeout_s: float) -> tuple[int, int, int] | None:
    """L2 counters once they stayed flat for IDLE_WINDOW_S; None if they never did."""
    deadline = time.monotonic() + timeout_s
    before = l2_io(client)
    while time.monotonic() < deadline:
        time.sleep(IDLE_WINDOW_S)
        now = l2_io(client)
        if now[:2] == before[:2] and now[2] == 0:
            return now
        before = now
    return None


def test_idle_daemon_with_l1_larger_than_l2_does_no_l2_io(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, [], dram=DRAM, max_value="4MiB", ssd=SSD, segment=SEGMENT)
    try:
        with Client(daemon.target, timeout_s=30) as client:
            for i in range(VALUES):
                client.put(NS, b"k%04d" % i, value_for(i))
            quiet = settled(client, SETTLE_S)
            assert quiet is not None, f"L2 never went quiet: {l2_io(client)}"
            # Idle: nothing moves for a further window.
            time.sleep(IDLE_WINDOW_S)
            assert l2_io(client) == quiet
            stats = client.stats()
            # Every value is still readable (L1 holds them all).
            for i in range(0, VALUES, 7):
                assert client.get(NS, b"k%04d" % i) == value_for(i)
        # The settings were accepted, with a warning naming them.
        assert any("L2 holds less than L1" in line for line in daemon.log), daemon.log[:5]
        put_bytes = VALUES * VALUE_BYTES
        assert stats["l2_write_bytes"] <= 1.5 * put_bytes, stats
        amplification = metric(daemon, "kvd_l2_write_amplification")
        assert 1.0 <= amplification <= 1.5, amplification
        assert metric(daemon, "kvd_l2_rewrite_bytes_total") == stats["l2_rewrite_bytes"]
    finally:
        assert daemon.stop() == 0


# ---- loop devices ------------------------------------------------------------------
def sh(*argv: str) -> str:
    done = subprocess.run(
        argv, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    return done.stdout.strip()


@contextlib.contextmanager
def loop_device(image: Path, size_bytes: int) -> Iterator[str]:
    """A loop device over a fresh sparse file; detached (and set writable) after."""
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    device = sh("losetup", "--find", "--show", str(image))
    try:
        yield device
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            sh("blockdev", "--setrw", device)
        sh("losetup", "--detach", device)


@contextlib.contextmanager
def ext4(root: Path, size_bytes: int) -> Iterator[Path]:
    """A small ext4 file system on a loop device, mounted under ``root``."""
    mount = root / "mnt"
    mount.mkdir()
    with loop_device(root / "ext4.img", size_bytes) as device:
        sh("mkfs.ext4", "-q", device)
        sh("mount", device, str(mount))
        try:
            yield mount
        finally:
            sh("umount", str(mount))


def l2_args(path: str, ssd_bytes: str) -> list[str]:
    return ["--ssd-path", path, "--ssd-bytes", ssd_bytes, "--ssd-segment-bytes", SEGMENT]


def start_on(workdir: Path, path: str, ssd_bytes: str = SSD) -> DaemonProcess:
    workdir.mkdir(exist_ok=True)
    return DaemonProcess(workdir, l2_args(path, ssd_bytes), dram="16MiB", max_value="4MiB", ssd="")


def refused(workdir: Path, path: str, ssd_bytes: str) -> str:
    """What a daemon that must not start printed."""
    with pytest.raises(RuntimeError, match="kvd did not start") as failed:
        start_on(workdir, path, ssd_bytes)
    return str(failed.value)


@needs_root
def test_read_only_device_is_refused_at_start(tmp_path: Path) -> None:
    with loop_device(tmp_path / "ro.img", 64 * MiB) as device:
        sh("blockdev", "--setro", device)
        printed = refused(tmp_path / "d", device, SSD)
    assert f"SSD path {device} is read-only" in printed, printed


@needs_root
def test_ssd_bytes_beyond_free_space_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    with ext4(tmp_path, 64 * MiB) as mount:
        path = mount / "l2" / "kvd-0.dat"
        printed = refused(tmp_path / "d", str(path), "200MiB")
        assert not path.exists(), f"{path} left behind: {path.stat().st_size} bytes"
        free_bytes = shutil.disk_usage(mount).free
        # An L2 file that already exists keeps its size and its bytes.
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * MiB)
        refused(tmp_path / "d2", str(path), "200MiB")
        assert path.read_bytes() == b"x" * MiB
    assert f"{path}" in printed and "free" in printed, printed
    assert f"{free_bytes} bytes free" in printed, printed


@needs_root
def test_device_switched_read_only_and_back(tmp_path: Path) -> None:
    """Write errors are counted by L2 (marker writes too), the daemon keeps
    serving, writes resume once the device is writable, and SIGTERM exits 0
    (write-back workers sleeping through the backoff raced for one entry)."""
    with loop_device(tmp_path / "rw.img", 64 * MiB) as device:
        daemon = start_on(tmp_path / "d", device)
        try:
            with Client(daemon.target, timeout_s=10) as client:
                # 7 records of 1 MiB (+64 KiB of header and padding) after
                # the segment's marker fill an 8 MiB segment: the next write
                # opens a new one, and its marker write is the first to fail.
                for i in range(7):
                    client.put(NS, b"before%d" % i, value_for(i))
                assert written_back(client, WRITE_BACK_WAIT_S)
                sh("blockdev", "--setro", device)
                # A put that fails, then one more while the tier backs off:
                # it wakes every idle worker, and they all sleep through the
                # backoff for two entries (a longer trickle would queue more
                # entries than there are workers and hide the race).
                for i in range(2):
                    client.put(NS, b"ro%da" % i, value_for(100 + i))
                    time.sleep(0.2)
                    client.put(NS, b"ro%db" % i, value_for(110 + i))
                    time.sleep(1.5)  # past the 1 s backoff
                stats = client.stats()
                # Only marker writes failed (appends waiting on a failed
                # opener share its one failed write, so the write-back count
                # is the larger).
                assert stats["l2_write_errors"] >= 1, stats
                assert stats["writeback_errors"] >= stats["l2_write_errors"], stats
                sh("blockdev", "--setrw", device)
                written = client.stats()["l2_writes"]
                for i in range(4):
                    client.put(NS, b"after%d" % i, value_for(200 + i))
                assert wait_until(lambda: client.stats()["l2_writes"] >= written + 4, 5), (
                    client.stats()
                )
                for i in range(4):
                    assert client.get(NS, b"after%d" % i) == value_for(200 + i)
        finally:
            code = daemon.stop()
        assert code == 0, "\n".join(daemon.log[-20:])
        assert not any("Traceback" in line for line in daemon.log), "\n".join(daemon.log[-20:])


# ---- in process: the rewrite credit --------------------------------------------------
# One pool page per value, and with its header one 64 KiB L2 record; 3 L2
# segments of 1 MiB (a marker and 15 records each) keep at most 45 records,
# fewer than the 64 values L1 holds.
SMALL_VALUE_BYTES = 40_000
POOL_PAGES = 64
STORE_WAIT_S = 10.0


async def test_rewrites_stay_within_credit_and_a_durable_put_rewrites(tmp_path: Path) -> None:
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    io = backend("threads")
    tier = L2Tier(devices, io)
    await tier.recover()
    pool = Pool(POOL_PAGES * PAGE_BYTES)
    store = Store(pool, StoreLimits.from_config(Config()), l2=tier)
    store.start()
    writeback = store.writeback
    assert writeback is not None
    try:
        keys = [b"c%03d" % i for i in range(POOL_PAGES)]
        for i, key in enumerate(keys):
            value = value_for(i, SMALL_VALUE_BYTES)
            await store.put(NS, key, value, checksum=checksum(value), hasher=checksum)
        assert await writeback.flush(STORE_WAIT_S) == 0
        stats = store.stats()
        assert stats["l2_reclaims"] >= 1 and stats["l2_rewrites_skipped"] >= 1, stats
        assert stats["l2_rewrite_bytes"] <= 0.5 * stats["l2_first_write_bytes"], stats
        # A value whose record went and was not rewritten is in L1 only ...
        index, key = next((i, k) for i, k in enumerate(keys) if tier.lookup(NS, k) is None)
        entry = store._l1(NS, key)
        assert entry is not None and entry.l2 is None and not entry.dirty
        # ... until a durable put of it, which must not return before it is on L2.
        value = value_for(index, SMALL_VALUE_BYTES)
        writes, reclaims = tier.counters.writes, tier.counters.reclaims
        result = await asyncio.wait_for(
            store.put(NS, key, value, hasher=checksum, durable=True),
            STORE_WAIT_S,
        )
        assert result.existed and tier.counters.writes == writes + 1
        assert tier.counters.reclaims == reclaims  # so nothing took the new record away
        assert tier.lookup(NS, key) is not None and entry.l2 is tier.lookup(NS, key)
    finally:
        await store.close(flush_s=1.0)
        tier.close()
        io.close()
        devices.close()
        pool.close()


def test_start_up_warning_names_l2_smaller_than_l1() -> None:
    assert l2_capacity_warning(GiB, 4 * GiB, 256 * MiB) is None  # the defaults
    warning = l2_capacity_warning(1200 * MiB, GiB, 256 * MiB)
    assert warning is not None and "dram_bytes 1200MiB" in warning and "ssd_bytes" in warning
