"""L2 cold-read throughput of the store, next to fio on the same file.

The store's whole read path is measured in-process (no transport): a
fresh daemon-like store recovers the L2 index from disk (L1 empty), then
``depth`` concurrent gets of random keys each read a record into pool pages
(O_DIRECT, striped), verify its checksum and link it into L1. L1 is kept
far smaller than the data, so nearly every get is an L2 read; only bytes
read from L2 are counted. fio (io_uring, O_DIRECT, random reads of the
same block size at the same depth, on the same file) is the ceiling.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvd.bench_io import fio_randread
from kvd.checksum import checksum
from kvd.iobackend import native_available, open_backend
from kvd.l2 import DeviceSet, L2Tier
from kvd.pool import Pool
from kvd.store import Store, StoreLimits

MiB = 1 << 20
SEGMENT_BYTES = 64 * MiB
STRIPE_BYTES = 256 << 10
DATA_BYTES = 512 * MiB
CASE_SECONDS = 2.0
BLOCKS_BYTES = (64 << 10, MiB, 4 * MiB)
DEPTHS = (1, 8, 32)


@dataclass
class Row:
    backend: str
    block_bytes: int
    depth: int
    kvd_gbps: float
    fio_gbps: float | None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["vs_fio"] = self.kvd_gbps / self.fio_gbps if self.fio_gbps else None
        return out


def _key(i: int) -> bytes:
    return b"blk%08d" % i


def _open(path: Path, backend: str, pool_bytes: int) -> tuple[Store, L2Tier]:
    # 64 KiB values take 128 KiB on disk (a 4 KiB header tips them into a second page).
    devices = DeviceSet([str(path)], 3 * DATA_BYTES, SEGMENT_BYTES, STRIPE_BYTES)
    tier = L2Tier(devices, open_backend(backend, depth=128))
    store = Store(Pool(pool_bytes), StoreLimits(max_value_bytes=8 * MiB), l2=tier)
    return store, tier


async def _close(store: Store, tier: L2Tier) -> None:
    await store.close(flush_s=60.0)
    tier.close()
    tier.io.close()
    tier.devices.close()
    store.pool.close()


async def _fill(path: Path, block_bytes: int) -> int:
    store, tier = _open(path, "threads", 64 * MiB)
    store.start()
    count = DATA_BYTES // block_bytes
    value = random.Random(block_bytes).randbytes(block_bytes)
    try:
        for i in range(count):
            await store.put("bench", _key(i), value, hasher=checksum)
    finally:
        await _close(store, tier)
    return count


async def _read(path: Path, backend: str, block_bytes: int, count: int, depth: int) -> float:
    store, tier = _open(path, backend, max(64 * MiB, 2 * depth * block_bytes))
    await tier.recover()
    store.start()
    read_bytes = 0
    deadline = time.perf_counter() + CASE_SECONDS

    async def worker(seed: int) -> None:
        nonlocal read_bytes
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            key = _key(rng.randrange(count))
            reader = await store.fetch("bench", key)
            assert reader is not None, "a stored block is missing"
            if reader.tier == 2:
                read_bytes += reader.size
            reader.close()
            store.evict("bench", key)  # keep every read cold

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(depth)))
    finally:
        elapsed = time.perf_counter() - start
        await _close(store, tier)
    return read_bytes / elapsed / 1e9


def run(workdir: Path, progress: Callable[[str], None] = print) -> list[Row]:
    backends = ["uring", "threads"] if native_available()[0] else ["threads"]
    rows = []
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "l2-bench.dat"
    for block_bytes in BLOCKS_BYTES:
        path.unlink(missing_ok=True)
        progress(f"l2 read: filling {DATA_BYTES >> 20} MiB of {block_bytes >> 10} KiB blocks")
        count = asyncio.run(_fill(path, block_bytes))
        for depth in DEPTHS:
            fio = fio_randread(
                str(path), block_bytes=block_bytes, queue_depth=depth,
                seconds=CASE_SECONDS, file_bytes=DATA_BYTES,
            )  # fmt: skip
            for backend in backends:
                progress(f"l2 read: {backend} {block_bytes >> 10} KiB qd {depth}")
                gbps = asyncio.run(_read(path, backend, block_bytes, count, depth))
                rows.append(Row(backend, block_bytes, depth, gbps, fio))
    path.unlink(missing_ok=True)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| backend | block | QD | kvd L2 read GB/s | fio GB/s | kvd/fio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        fio = f"{r.fio_gbps:.2f}" if r.fio_gbps else "n/a"
        ratio = f"{r.kvd_gbps / r.fio_gbps:.2f}" if r.fio_gbps else "n/a"
        size = (
            f"{r.block_bytes >> 20} MiB" if r.block_bytes >= MiB else f"{r.block_bytes >> 10} KiB"
        )
        lines.append(f"| {r.backend} | {size} | {r.depth} | {r.kvd_gbps:.2f} | {fio} | {ratio} |")
    return "\n".join(lines)
