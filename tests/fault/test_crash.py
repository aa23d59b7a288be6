"""Crash torture: SIGKILL the daemon during a put/get/delete storm, at random
times and at chosen points of the write path, restart it, and check every
key against an oracle of acknowledged operations.

After each restart every key is byte-identical or absent; absent is allowed
only for puts that were not acknowledged as durable (or were deleted);
nothing deleted comes back; nothing never written appears. Values are
derived from their keys, so checking needs no copy of them.

Loops: ``KVD_TEST_CRASH_LOOPS`` (10 in ``make test``, 100 in ``make test-fault``).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from kvd.client import Client, KvdError
from tests.support import DaemonProcess

LOOPS = int(os.environ.get("KVD_TEST_CRASH_LOOPS", "10"))
SIZES = (4096, 70_000, 300_000)
# Puts per storm thread per loop: bounds the L2 space used, so no segment is
# reclaimed and every durable put must come back.
STORM_PUTS_MAX = 60

pytestmark = pytest.mark.fault


def value_for(key: bytes, size: int) -> bytes:
    seed = int.from_bytes(key[-8:].rjust(8, b"\0"), "little")
    return random.Random(seed).randbytes(size)


class Oracle:
    def __init__(self) -> None:
        self.attempted: set[bytes] = set()
        self.durable: set[bytes] = set()
        self.deleting: set[bytes] = set()
        self.deleted: set[bytes] = set()
        self.wrong: list[str] = []
        self.sizes: dict[bytes, int] = {}  # the size each attempted key was put with
        self.lock = threading.Lock()

    def check_value(self, key: bytes, got: bytes | None) -> None:
        size = self.sizes.get(key)
        if got is not None and (size is None or got != value_for(key, size)):
            self.wrong.append(f"wrong bytes for {key!r}")


# L2 room for every loop's puts (3 threads x 60 puts of <= 300 KB, plus a
# segment's tail), so no segment is ever reclaimed: a reclaim may drop
# durable values legitimately, which would hide a real loss.
SSD_BYTES = max(256 << 20, LOOPS * (48 << 20))


def start(workdir: Path, *args: str) -> DaemonProcess:
    return DaemonProcess(
        workdir, ["--io-backend", "auto", *args], dram="16MiB", max_value="4MiB",
        ssd=str(SSD_BYTES), segment="8MiB",
    )  # fmt: skip


def storm(target: str, stop: threading.Event, oracle: Oracle, seed: int) -> None:
    rng = random.Random(seed)
    try:
        with Client(target, timeout_s=5) as client:
            for n in range(STORM_PUTS_MAX):
                if stop.is_set():
                    return
                key = b"s%d-%06d" % (seed, n)
                durable = rng.random() < 0.5
                size = rng.choice(SIZES)
                with oracle.lock:
                    oracle.attempted.add(key)
                    oracle.sizes[key] = size
                client.put("storm", key, value_for(key, size), durable=durable)
                if durable:
                    with oracle.lock:
                        oracle.durable.add(key)
                if rng.random() < 0.3:  # read back something acknowledged
                    with oracle.lock:
                        probe = rng.choice(sorted(oracle.durable)) if oracle.durable else key
                    oracle.check_value(probe, client.get("storm", probe))
                if durable and rng.random() < 0.1:
                    with oracle.lock:
                        oracle.deleting.add(key)
                    client.delete("storm", [key])
                    with oracle.lock:
                        oracle.deleted.add(key)
    except KvdError:
        pass  # the daemon died under us


# Keys read back per check, besides the last loop's: every key is read at
# the end and every tenth loop, so a check does not grow with the loops.
SAMPLE_KEYS = 300


def check(client: Client, oracle: Oracle, keys: list[bytes] | None = None) -> int:
    """Read back ``keys`` (default: every key ever attempted) against the oracle."""
    found = 0
    keys = sorted(oracle.attempted) if keys is None else keys
    for start in range(0, len(keys), 128):
        batch = keys[start : start + 128]
        for key, got in zip(batch, client.get_many("storm", batch), strict=True):
            if got is None:
                assert key not in oracle.durable or key in oracle.deleting, f"durable {key!r} lost"
                continue
            assert key not in oracle.deleted, f"deleted key {key!r} came back"
            oracle.check_value(key, got)
            found += 1
    never = [b"never-%d" % i for i in range(20)]
    assert client.exists("storm", never) == [False] * 20, "phantom key"
    assert not oracle.wrong, oracle.wrong[:3]
    return found


@pytest.mark.timeout(120 + LOOPS * 8)  # a loop: start, check every key, storm, kill
@pytest.mark.parametrize("point", ["random", "after_payload_write", "after_sync", "after_publish"])
def test_crash_torture(tmp_path: Path, point: str) -> None:
    oracle = Oracle()
    rng = random.Random(point)
    loops = LOOPS if point == "random" else max(2, LOOPS // 3)
    crashes = 0
    for loop in range(loops):
        args = [] if point == "random" else [
            "--test-crash-point", point, "--test-crash-after", str(rng.randrange(3, 40)),
        ]  # fmt: skip
        daemon = start(tmp_path, *args)
        try:
            crashes += run_storm(daemon, oracle, loop, point, rng)
        finally:
            daemon.kill()
    daemon = start(tmp_path)
    try:
        with Client(daemon.target, timeout_s=30) as client:
            found = check(client, oracle)
        assert found >= len(oracle.durable - oracle.deleting) > 0
        assert crashes >= loops // 2, f"only {crashes} of {loops} loops crashed"
    finally:
        daemon.stop()


def run_storm(
    daemon: DaemonProcess, oracle: Oracle, loop: int, point: str, rng: random.Random
) -> int:
    """Check the oracle, storm until the daemon dies; 1 if it died of SIGKILL."""
    with Client(daemon.target, timeout_s=30) as client:
        if loop % 10 == 0:
            check(client, oracle)
        else:
            last = tuple(b"s%d-" % ((loop - 1) * 10 + i) for i in range(3))  # storm seeds
            recent = sorted(k for k in oracle.attempted if k.startswith(last))
            older = sorted(oracle.attempted)
            sample = rng.sample(older, min(SAMPLE_KEYS, len(older)))
            check(client, oracle, recent + sample)
        # Free segments left after recovery: L2 never filled, nothing was reclaimed.
        assert client.stats()["l2_segments_free"] > 0
    stop = threading.Event()
    threads = [
        threading.Thread(target=storm, args=(daemon.target, stop, oracle, loop * 10 + i))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    if point == "random":
        time.sleep(rng.uniform(0.05, 0.6))
        daemon.kill()
    else:
        deadline = time.monotonic() + 20
        while daemon.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
    crashed = daemon.proc.poll() == -9
    stop.set()
    for t in threads:
        t.join(20)
    return int(crashed)
