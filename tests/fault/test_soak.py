"""Soak: a bounded run of mixed operations over a working set larger than L1
(so values keep moving between L1 and L2), checking that the daemon stays
flat: resident memory grows less than 1% after warm-up, open fds do not
grow, the index stays bounded by what L1 and L2 can hold, and no operation
fails or returns wrong bytes. Reports operations per second.

``KVD_TEST_SOAK_S``: 20 s here (the whole fault suite must stay short on two
CI cores), 600 s in ``make test-fault``. The first ``WARMUP_SHARE`` of the
run (at least 3 s) is warm-up: the pool is touched at start, but allocator
arenas, gRPC buffers and the L2 index settle while the working set first
cycles through.
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

pytestmark = pytest.mark.fault

SOAK_S = float(os.environ.get("KVD_TEST_SOAK_S", "20"))
WARMUP_SHARE = 0.3
THREADS = 2
NS = "soak"
DRAM_BYTES = 16 << 20
KEYS = 320  # 320 x 128 KiB = 40 MiB: 2.5x L1
VALUE_SIZES = (4096, 64 << 10, 128 << 10, 200_000)
RSS_GROWTH_MAX = 0.01
LEASE_MS = 200


def value_for(key: bytes, generation: int) -> bytes:
    rng = random.Random(key + b"/%d" % generation)
    return rng.randbytes(rng.choice(VALUE_SIZES))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    """Worker threads doing mixed operations; each key's current generation
    (bumped by a delete) says which bytes a get must return."""

    def __init__(self, target: str, stop_at: float) -> None:
        self.target = target
        self.stop_at = stop_at
        self.generation = [0] * KEYS
        self.locks = [threading.Lock() for _ in range(KEYS)]
        self.ops = 0
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []
        self.wrong = 0
        self.lock = threading.Lock()

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        counts: dict[str, int] = {}
        try:
            with Client(self.target, timeout_s=10) as client:
                while time.monotonic() < self.stop_at and not self.errors:
                    op = self.one(client, rng)
                    counts[op] = counts.get(op, 0) + 1
        except KvdError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        with self.lock:
            for op, n in counts.items():
                self.counts[op] = self.counts.get(op, 0) + n
                self.ops += n

    def one(self, client: Client, rng: random.Random) -> str:
        i = rng.randrange(KEYS)
        key = b"key-%05d" % i
        roll = rng.random()
        with self.locks[i]:  # one key's put/get/delete stay in order; keys run in parallel
            generation = self.generation[i]
            if roll < 0.5:
                got = client.get(NS, key)
                if got is None:
                    client.put(NS, key, value_for(key, generation))
                elif got != value_for(key, generation):
                    self.wrong += 1
                return "get"
            if roll < 0.7:
                client.put(NS, key, value_for(key, generation))
                return "put"
            if roll < 0.8:
                chain = [b"key-%05d" % ((i + j) % KEYS) for j in range(8)]
                client.exists(NS, chain)
                return "exists"
            if roll < 0.95:
                chain = [b"key-%05d" % ((i + j) % KEYS) for j in range(8)]
                result = client.lookup_ex(NS, chain, lease_ms=LEASE_MS)
                if result.lease_id and rng.random() < 0.5:
                    client.release(NS, result.lease_id)  # the rest expire
                return "lookup"
            client.delete(NS, [key])
            self.generation[i] += 1
            return "delete"


@pytest.mark.timeout(SOAK_S + 300)
def test_soak(tmp_path: Path) -> None:
    daemon = DaemonProcess(
        tmp_path, [], dram=f"{DRAM_BYTES}B", max_value="4MiB", ssd="256MiB", segment="16MiB"
    )
    try:
        pid = daemon.proc.pid
        started = time.monotonic()
        warm_at = started + max(3.0, SOAK_S * WARMUP_SHARE)
        load = Load(daemon.target, started + SOAK_S)
        threads = [threading.Thread(target=load.run, args=(seed,)) for seed in range(THREADS)]
        for t in threads:
            t.start()
        rss: list[tuple[float, int]] = []
        fds: list[int] = []
        entries: list[tuple[int, int]] = []
        with Client(daemon.target, timeout_s=10) as watcher:
            while any(t.is_alive() for t in threads):
                time.sleep(0.5)
                now = time.monotonic()
                if now >= warm_at:
                    rss.append((now, rss_bytes(pid)))
                    fds.append(open_fds(pid))
                    stats = watcher.stats()
                    entries.append((stats["entries"], stats.get("l2_entries", 0)))
                if now > started + SOAK_S + 60:
                    break
            final = watcher.stats()
        for t in threads:
            t.join(30)
        elapsed = time.monotonic() - started
        assert not load.errors, load.errors[:3]
        assert load.wrong == 0, f"{load.wrong} gets returned wrong bytes"
        assert rss and fds, "the run ended before warm-up did"
        growth = (rss[-1][1] - rss[0][1]) / rss[0][1]
        print(
            f"\nsoak {elapsed:.0f} s: {load.ops} ops, {load.ops / elapsed:.0f} ops/s, "
            f"{load.counts}, RSS {rss[0][1] >> 20} -> {rss[-1][1] >> 20} MiB "
            f"({100 * growth:+.2f}% after warm-up, max {max(r for _, r in rss) >> 20} MiB), "
            f"fds {fds[0]} -> {fds[-1]}, L1 entries max {max(e for e, _ in entries)}, "
            f"L2 entries max {max(e for _, e in entries)}, evictions {final['evictions']}, "
            f"promotions {final['promotions']}, wrong 0, errors 0"
        )
        assert growth < RSS_GROWTH_MAX, f"RSS grew {100 * growth:.2f}% after warm-up"
        assert max(fds) <= fds[0], f"fds grew: {fds[0]} -> {max(fds)}"
        assert max(e for e, _ in entries) <= DRAM_BYTES // (64 << 10)
        assert max(e for _, e in entries) <= KEYS
        assert final["evictions"] > 0 and final["promotions"] > 0, "L1 never overflowed"
        assert final["checksum_failures"] == 0 and final["writeback_errors"] == 0
    finally:
        daemon.stop()
