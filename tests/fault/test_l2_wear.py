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

import re
import time
import urllib.request
from pathlib import Path

import pytest

from kvd.bench.daemon import SpawnedDaemon
from kvd.client import Client

pytestmark = pytest.mark.fault

MiB = 1 << 20
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


def value_for(i: int, size: int = VALUE_BYTES) -> bytes:
    return (b"%08d" % i) * (size // 8)


def metric(daemon: SpawnedDaemon, name: str) -> float:
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
    daemon = SpawnedDaemon(tmp_path, [], dram=DRAM, max_value="4MiB", ssd=SSD, segment=SEGMENT)
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
