"""L2 cold-read throughput and CPU cost, next to fio on the same device(s).

Two read paths are measured in-process (no transport), each at queue depth
``depth`` (that many concurrent readers) for each block size:

* ``store``: the store's whole get path. A fresh daemon-like store recovers
  the L2 index from disk (L1 empty), then each reader gets random keys: an
  L2 read into pool pages (O_DIRECT, striped), header and checksum checks,
  a link into L1, and an evict to keep the next read cold. L1 is far
  smaller than the data, so nearly every get is an L2 read; only bytes
  read from L2 are counted.
* ``tier``: ``L2Tier.read`` alone, into fixed pages: the L2 read path
  without the store's index and pool work (each read its own coroutine;
  the reads of one loop turn still go out as one batch).
* ``batch``: ``L2Tier.read_many``: two readers each hand the tier half the
  depth's worth of records at a time, so the Python work is per batch, not
  per read (what a batched get of many keys can use).
* ``store-batch``: the store's batched get (``Store.fetch_many``, what a
  shm batch get of a chain runs): two readers each get half the depth's
  worth of distinct random keys at a time, then evict them as ``store`` does.

Filling the device is measured too (path ``put``, at the write-back's
``WORKERS`` appends in flight): the store's puts of every value, fresh
keys through an L1 of ``FILL_POOL_BYTES`` (far smaller than the data, so
L1 is full of values waiting for write-back most of the time), until the
last is on L2, next to fio's sequential writes of the same block size.
And durable puts (path ``put-durable``): ``DURABLE_WRITERS`` writers each
putting fresh values with ``durable`` (on L2 and synced before each
answer) into a store whose L1 holds them all, next to fio's sequential
writes at that depth with an fdatasync after every ``DURABLE_WRITERS``
writes.

Besides GB/s, each case reports the process's CPU time (all threads, user
and kernel) per read, which noise from other processes on the machine moves
far less than throughput. fio (io_uring, O_DIRECT, random reads of the same
block size at the same depth over the same device(s), across the span the
records take) is the ceiling: the mean of one run before and one after each
depth's kvd cases (``Row.fio_runs``), since a VM disk's rate moved by a
quarter within minutes here, and one run before them favoured whichever side
met the faster minute. Every byte of that span holds data before
either reads: the records' tail padding is never written, and a read of
never-written blocks costs a device less (a VM disk's unwritten extents are
not read at all, a loop device on tmpfs zero-fills holes instead of copying),
so over a fresh span half of fio's 64 KiB reads landed mostly in padding
and its ceiling stood 1.3-1.9x above what the device reads of data.

fio's buffers sit on huge pages, as kvd's L1 does, where the bench can
reserve them (root; kvd.tools.bench.hugetlb; ``Row.fio_huge_pages``): on
this VM's disk fio reading into 4 KiB pages did half as much.

A second ceiling, ``replay``, is fio replaying reads exactly as the tier
makes them (an iolog of random records of the run's values: each record's
header and payload in one read, 68 KiB for a 64 KiB value, cut per device
as the tier cuts it), at the same depth, bracketed the same way, counted
as value bytes (reads per second times the block size). fio's random reads
of the block size are not quite the tier's reads: those are a header
longer, and records start 128 KiB apart for 64 KiB values.

The target is a directory (a file in it), one or more devices (striped like
the daemon stripes ``ssd_path`` entries; their contents are overwritten), or
RAM-backed loop devices made for the run (kvd.tools.bench.ramdisk).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import mmap
import os
import random
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvd.config.settings import Config
from kvd.io.backend import native_available, open_backend
from kvd.io.ops import OpKind
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2 import DeviceSet, L2Tier
from kvd.l2.format import BLOCK_BYTES, RECORD_ALIGN_BYTES, align_up
from kvd.store.eviction.policy import make_policy
from kvd.store.index import StoreLimits
from kvd.store.store import Store
from kvd.store.writeback import WORKERS
from kvd.tools.bench.backends import fio_randread, fio_replay, fio_write, fio_write_synced
from kvd.tools.bench.hugetlb import HugeBuffers, fio_huge_buffers
from kvd.wire.checksum import checksum

MiB = 1 << 20
SEGMENT_BYTES = 64 * MiB
STRIPE_BYTES = 256 << 10
DATA_BYTES = 512 * MiB
CASE_SECONDS = 2.0
CASE_SECONDS_MAX = 30.0
BLOCKS_BYTES = (64 << 10, MiB, 4 * MiB)
DEPTHS = (1, 8, 32)
DEPTH_MAX = 256
READ_PATHS = ("store", "tier", "batch", "store-batch")
BATCH_READERS = 2  # batch path: one batch in flight while the other's results are handled
# Random choices drawn before the clock starts (this many reads' worth,
# shared out among the readers) and then cycled: drawn per read, Python's
# random cost ~1.5 us of a 64 KiB read's ~13 us of CPU, work fio does not
# do. Reads through a cycle again stay cold: O_DIRECT reads cache nothing,
# and the store cases evict what they read.
DRAWS = 1 << 17
IO_DEPTH = 128  # the io backend's depth: above every reader depth benched by default
DATA_FILE = "l2-bench.dat"
LAY_OUT_BYTES = 4 * MiB  # one write of the lay-out
FILL_POOL_BYTES = 64 * MiB  # L1 of the fill's store: an eighth of the data
DURABLE_WRITERS = 16  # durable puts in flight at once
DURABLE_BYTES = 128 * MiB  # put durably per block size, at most
# Reads in fio's replay log (random records, drawn with replacement): more
# than a case's seconds take on these devices, so fio stops at the clock.
REPLAY_READS = 1 << 18


@dataclass
class Row:
    backend: str
    path: str
    devices: int
    block_bytes: int
    depth: int
    kvd_gbps: float
    cpu_us_per_read: float
    fio_gbps: float | None
    # The fio runs whose mean ``fio_gbps`` is (reads: one before and one after
    # the depth's kvd cases, so a device whose rate drifts is met halfway).
    fio_runs: tuple[float, ...] = ()
    # fio replaying the tier's own reads (module doc), as ``fio_gbps``.
    replay_gbps: float | None = None
    replay_runs: tuple[float, ...] = ()
    # fio's buffers on huge pages, as kvd's L1 (kvd.tools.bench.hugetlb).
    fio_huge_pages: bool = False

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["vs_fio"] = self.kvd_gbps / self.fio_gbps if self.fio_gbps else None
        out["vs_replay"] = self.kvd_gbps / self.replay_gbps if self.replay_gbps else None
        return out


@dataclass(frozen=True)
class Target:
    """Where the bench reads: data files, or block devices (overwritten)."""

    paths: tuple[str, ...]
    block_devices: bool
    data_bytes: int = DATA_BYTES  # values stored and read at random

    @classmethod
    def of(
        cls, dirs: Sequence[str], devices: Sequence[str], data_bytes: int = DATA_BYTES
    ) -> Target:
        if devices:
            for device in devices:
                if not stat.S_ISBLK(os.stat(device).st_mode):
                    raise ValueError(f"{device} is not a block device")
            return cls(tuple(devices), True, data_bytes)
        return cls(tuple(str(Path(d) / DATA_FILE) for d in dirs), False, data_bytes)


@dataclass
class Case:
    gbps: float
    cpu_us_per_read: float


def _key(i: int) -> bytes:
    return b"blk%08d" % i


def _draws(
    seed: int, count: int, per: int, readers: int, distinct: bool = False
) -> list[list[int]]:
    """One reader's share of DRAWS: groups of ``per`` random indexes below
    ``count`` (distinct within a group when asked), drawn with ``seed``."""
    rng = random.Random(seed)
    groups = max(1, DRAWS // (per * readers))
    if distinct:
        return [rng.sample(range(count), per) for _ in range(groups)]
    return [[rng.randrange(count) for _ in range(per)] for _ in range(groups)]


def _bytes_per_path(target: Target) -> int:
    # 64 KiB values take 128 KiB on disk (a 4 KiB header tips them into a second page).
    return max(3 * target.data_bytes // len(target.paths), 2 * SEGMENT_BYTES)


def _devices(target: Target) -> DeviceSet:
    return DeviceSet(list(target.paths), _bytes_per_path(target), SEGMENT_BYTES, STRIPE_BYTES)


def _open(target: Target, backend: str, pool_bytes: int) -> tuple[Store, L2Tier]:
    tier = L2Tier(_devices(target), open_backend(backend, depth=IO_DEPTH))
    config = Config()
    limits = replace(StoreLimits.from_config(config), max_value_bytes=8 * MiB)
    # The daemon's default eviction policy: its calls are part of each get.
    store = Store(Pool(pool_bytes), limits, make_policy(config.eviction_policy), l2=tier)
    return store, tier


async def _close(store: Store, tier: L2Tier) -> None:
    await store.close(flush_s=60.0)
    tier.close()
    tier.io.close()
    tier.devices.close()
    store.pool.close()


def _wipe(target: Target) -> None:
    """Remove the data files of a directory target (devices keep what is on
    them: ``_lay_out`` overwrites it before the next fill)."""
    if not target.block_devices:
        for path in target.paths:
            Path(path).unlink(missing_ok=True)


def _lay_out(target: Target) -> None:
    """Write every byte the records may take on each path (random bytes, 4 MiB
    at a time), as an SSD in use holds data in every block; what was there
    before is gone, and no segment marker is left valid. The paths are opened
    as the tier opens them: a file is created and reserved (refused on a file
    system without room for it), a device is used up to its size."""
    devices = _devices(target)
    try:
        span = devices.segment_count * devices.segment_bytes
        with mmap.mmap(-1, LAY_OUT_BYTES) as data:
            data.write(random.Random(0).randbytes(LAY_OUT_BYTES))
            for device in devices.devices:
                for offset in range(0, span, LAY_OUT_BYTES):
                    size = min(LAY_OUT_BYTES, span - offset)
                    os.pwritev(device.fd, [memoryview(data)[:size]], offset)
                os.fsync(device.fd)
    finally:
        devices.close()


async def _write_replay_log(target: Target, log: Path) -> None:
    """fio's iolog (version 2) of REPLAY_READS reads of random records of the
    run's values (namespace ``bench``), each cut per device as the tier cuts
    its read of the record's header and payload."""
    devices = _devices(target)
    io = open_backend("threads", depth=8)
    tier = L2Tier(devices, io)
    try:
        await tier.recover()
        records = [r for r in tier.index.values() if r.namespace == "bench"]
        paths = {device.fd: device.path for device in devices.devices}
        longest = max(r.header_bytes + r.read_bytes for r in records)
        blank = memoryview(bytearray(longest))
        picks = random.Random(len(records)).choices(records, k=REPLAY_READS)
        with log.open("w") as out:
            out.write("fio version 2 iolog\n")
            for path in paths.values():
                out.write(f"{path} add\n{path} open\n")
            for record in picks:
                view = blank[: record.header_bytes + record.read_bytes]
                for op in devices.ops(OpKind.READ, record.segment, record.offset, [view]):
                    length = sum(len(buf) for buf in op.bufs)
                    out.write(f"{paths[op.fd]} read {op.offset} {length}\n")
            for path in paths.values():
                out.write(f"{path} close\n")
    finally:
        tier.close()
        io.close()
        devices.close()


async def _fill(target: Target, backend: str, block_bytes: int) -> tuple[int, Case]:
    """Put ``target.data_bytes`` of fresh values; their count, and the rate
    from the first put until the last value is on L2."""
    store, tier = _open(target, backend, FILL_POOL_BYTES)
    store.start()
    count = target.data_bytes // block_bytes
    value = random.Random(block_bytes).randbytes(block_bytes)
    cpu_before, start = time.process_time(), time.perf_counter()
    try:
        for i in range(count):
            await store.put("bench", _key(i), value, hasher=checksum)
    finally:
        await _close(store, tier)  # flushes write-back
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_before
    return count, Case(count * block_bytes / elapsed / 1e9, cpu / count * 1e6)


async def _durable(target: Target, backend: str, block_bytes: int) -> Case:
    """``DURABLE_WRITERS`` writers putting fresh values durably, up to
    ``DURABLE_BYTES`` or a quarter of the data (L1 holds them all); the
    rate and CPU per put."""
    count = max(DURABLE_WRITERS, min(DURABLE_BYTES, target.data_bytes // 4) // block_bytes)
    store, tier = _open(target, backend, count * align_up(block_bytes, PAGE_BYTES) + 64 * MiB)
    await tier.recover()
    store.start()
    value = random.Random(block_bytes).randbytes(block_bytes)
    keys = iter(range(count))

    async def writer() -> None:
        for i in keys:
            await store.put("durable", _key(i), value, hasher=checksum, durable=True)

    cpu_before, start = time.process_time(), time.perf_counter()
    try:
        await asyncio.gather(*(writer() for _ in range(DURABLE_WRITERS)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_before
    finally:
        await _close(store, tier)
    return Case(count * block_bytes / elapsed / 1e9, cpu / count * 1e6)


async def _read_store(
    target: Target, backend: str, block_bytes: int, count: int, depth: int, seconds: float,
    batched: bool = False,
) -> Case:  # fmt: skip
    store, tier = _open(target, backend, max(64 * MiB, 2 * depth * block_bytes))
    await tier.recover()
    store.start()
    read_bytes = 0
    readers = min(depth, BATCH_READERS)
    shares = [depth // readers + (i < depth % readers) for i in range(readers)]
    if batched:
        draws = [[[_key(i) for i in group] for group in _draws(seed, count, n, readers, True)]
                 for seed, n in enumerate(shares)]  # fmt: skip
    else:
        draws = [[[_key(i)] for (i,) in _draws(seed, count, 1, depth)] for seed in range(depth)]
    deadline = time.perf_counter() + seconds

    async def worker(seed: int) -> None:
        nonlocal read_bytes
        keys = itertools.cycle(draws[seed])
        while time.perf_counter() < deadline:
            (key,) = next(keys)
            reader = await store.fetch("bench", key)
            assert reader is not None, "a stored block is missing"
            if reader.tier == 2:
                read_bytes += reader.size
            reader.close()
            store.evict("bench", key)  # keep every read cold

    async def batch_worker(seed: int) -> None:
        nonlocal read_bytes
        groups = itertools.cycle(draws[seed])
        while time.perf_counter() < deadline:
            keys = next(groups)
            readers = await store.fetch_many("bench", keys)
            for i, key in enumerate(keys):
                reader = readers.get(i)
                if reader is None:  # in L1 (the other reader's batch) or being read
                    reader = await store.fetch("bench", key)
                assert reader is not None, "a stored block is missing"
                if reader.tier == 2:
                    read_bytes += reader.size
                reader.close()
                store.evict("bench", key)

    reads_before = tier.counters.reads
    cpu_before, start = time.process_time(), time.perf_counter()
    try:
        if batched:
            await asyncio.gather(*(batch_worker(i) for i in range(readers)))
        else:
            await asyncio.gather(*(worker(i) for i in range(depth)))
    finally:
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_before
        reads = tier.counters.reads - reads_before
        await _close(store, tier)
    return Case(read_bytes / elapsed / 1e9, cpu / max(reads, 1) * 1e6)


async def _read_tier(
    target: Target, backend: str, depth: int, seconds: float, batched: bool = False
) -> Case:
    tier = L2Tier(_devices(target), open_backend(backend, depth=IO_DEPTH))
    try:
        await tier.recover()
        records = list(tier.index.values())
        read_bytes = records[0].read_bytes
        # Pool pages, as the store reads into (touched, huge pages where the
        # kernel has them): fresh 4 KiB pages cost the kernel more per read.
        pool = Pool(depth * align_up(read_bytes, PAGE_BYTES))
        runs = pool.alloc(pool.capacity_bytes)
        view = pool.views(runs, pool.capacity_bytes)[0]
        done_bytes = 0
        readers = min(depth, BATCH_READERS)
        shares = [depth // readers + (i < depth % readers) for i in range(readers)]
        firsts = [sum(shares[:i]) for i in range(readers)]
        # Per reader (batched) or per slot: groups of records to read at once.
        per = list(enumerate(shares)) if batched else [(slot, 1) for slot in range(depth)]
        draws = [[[records[i] for i in group] for group in _draws(seed, len(records), n, len(per))]
                 for seed, n in per]  # fmt: skip
        deadline = time.perf_counter() + seconds

        async def worker(slot: int) -> None:
            nonlocal done_bytes
            page = view[slot * read_bytes : (slot + 1) * read_bytes]
            picks = itertools.cycle(draws[slot])
            while time.perf_counter() < deadline:
                (record,) = next(picks)
                await tier.read(record, [page])
                done_bytes += record.size
            page.release()

        async def batch_worker(reader: int, first: int, count: int) -> None:
            nonlocal done_bytes
            pages = [
                [view[i * read_bytes : (i + 1) * read_bytes]] for i in range(first, first + count)
            ]
            picks = itertools.cycle(draws[reader])
            while time.perf_counter() < deadline:
                batch = next(picks)
                errors = await tier.read_many(list(zip(batch, pages, strict=True)))
                assert not any(errors), errors
                done_bytes += sum(r.size for r in batch)
            for page in pages:
                page[0].release()

        cpu_before, start = time.process_time(), time.perf_counter()
        try:
            if batched:
                at = zip(firsts, shares, strict=True)
                await asyncio.gather(*(batch_worker(r, f, n) for r, (f, n) in enumerate(at)))
            else:
                await asyncio.gather(*(worker(i) for i in range(depth)))
        finally:
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_before
            view.release()
            pool.close()  # unmapped now, or with the last slice a finished op kept
        return Case(done_bytes / elapsed / 1e9, cpu / max(tier.counters.reads, 1) * 1e6)
    finally:
        tier.close()
        tier.io.close()
        tier.devices.close()


def run(
    target: Target,
    progress: Callable[[str], None] = print,
    *,
    blocks_bytes: Sequence[int] = BLOCKS_BYTES,
    depths: Sequence[int] = DEPTHS,
    read_paths: Sequence[str] = READ_PATHS,
    seconds: float = CASE_SECONDS,
) -> list[Row]:
    if not 0 < seconds <= CASE_SECONDS_MAX:
        raise ValueError(f"seconds per case must be in (0, {CASE_SECONDS_MAX}]")
    for depth in depths:
        if not 1 <= depth <= DEPTH_MAX:
            raise ValueError(f"depth must be in 1..{DEPTH_MAX}, got {depth}")
    for block_bytes in blocks_bytes:
        if block_bytes < 4096 or block_bytes % 4096 or block_bytes > 8 * MiB:
            raise ValueError(f"block size must be a multiple of 4 KiB up to 8 MiB: {block_bytes}")
    for read_path in read_paths:
        if read_path not in READ_PATHS:
            raise ValueError(f"read path must be one of {READ_PATHS}, got {read_path!r}")
    for path in target.paths:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    # fio's buffers: its deepest case's reads or writes, a header longer (replays).
    deepest = max(*depths, WORKERS, DURABLE_WRITERS)
    with fio_huge_buffers(deepest * (max(blocks_bytes) + 64 * 1024)) as buffers:
        if buffers.why_not:
            progress(f"l2 read: fio's buffers on 4 KiB pages ({buffers.why_not})")
        for block_bytes in blocks_bytes:
            rows += _block_rows(target, block_bytes, depths, read_paths, seconds, progress,
                                buffers)  # fmt: skip
    _wipe(target)  # the data files; devices keep the last fill
    return rows


def _block_rows(
    target: Target, block_bytes: int, depths: Sequence[int], read_paths: Sequence[str],
    seconds: float, progress: Callable[[str], None], buffers: HugeBuffers,
) -> list[Row]:  # fmt: skip
    """Every case of one block size: the fill, the durable puts, and the
    reads at each depth, each beside fio on the same paths."""
    backends = ["uring", "threads"] if native_available()[0] else ["threads"]
    n, paths, huge = len(target.paths), ":".join(target.paths), buffers.path is not None
    fio_args = buffers.fio_args()
    count = target.data_bytes // block_bytes
    # fio reads the span the records take (a 64 KiB value's record is
    # 128 KiB), not just the data's size: a VM disk cached by its host
    # answers a smaller span faster.
    span_bytes = count * align_up(BLOCK_BYTES + block_bytes, RECORD_ALIGN_BYTES)
    fio_write_gbps = fio_write(paths, block_bytes=block_bytes, queue_depth=WORKERS,
                               seconds=seconds, file_bytes=span_bytes, extra=fio_args)  # fmt: skip
    fio_synced_gbps = fio_write_synced(
        paths, block_bytes=block_bytes, queue_depth=DURABLE_WRITERS, seconds=seconds,
        file_bytes=span_bytes, extra=fio_args,
    )  # fmt: skip
    _lay_out(target)  # also forgets earlier runs: no segment marker stays valid
    mib, kib = target.data_bytes >> 20, block_bytes >> 10
    progress(f"l2 read: {backends[0]} put: filling {mib} MiB of {kib} KiB blocks")
    count, fill = asyncio.run(_fill(target, backends[0], block_bytes))
    rows = [Row(backends[0], "put", n, block_bytes, WORKERS, fill.gbps, fill.cpu_us_per_read,
                fio_write_gbps, fio_huge_pages=huge)]  # fmt: skip
    progress(f"l2 read: {backends[0]} put-durable: {DURABLE_WRITERS} writers, {kib} KiB")
    durable = asyncio.run(_durable(target, backends[0], block_bytes))
    rows.append(Row(backends[0], "put-durable", n, block_bytes, DURABLE_WRITERS, durable.gbps,
                    durable.cpu_us_per_read, fio_synced_gbps, fio_huge_pages=huge))  # fmt: skip
    replay_log = Path(tempfile.mkdtemp(prefix="kvd-l2-replay-")) / "reads.iolog"
    try:
        asyncio.run(_write_replay_log(target, replay_log))
        for depth in depths:
            fio_reads = functools.partial(
                fio_randread, paths, block_bytes=block_bytes, queue_depth=depth,
                seconds=seconds, file_bytes=span_bytes, extra=fio_args,
            )  # fmt: skip
            replays = functools.partial(fio_replay, str(replay_log), queue_depth=depth,
                                        seconds=seconds, extra=fio_args)  # fmt: skip
            before, replay_before = fio_reads(), replays()
            cases = []
            for read_path in read_paths:
                for backend in backends:
                    progress(f"l2 read: {backend} {read_path} {kib} KiB qd {depth}")
                    if read_path in ("store", "store-batch"):
                        case = asyncio.run(
                            _read_store(target, backend, block_bytes, count, depth, seconds,
                                        batched=read_path == "store-batch")
                        )  # fmt: skip
                    else:
                        batched = read_path == "batch"
                        case = asyncio.run(_read_tier(target, backend, depth, seconds, batched))
                    cases.append((backend, read_path, case))
            runs = tuple(gbps for gbps in (before, fio_reads()) if gbps is not None)
            fio = sum(runs) / len(runs) if runs else None
            replay_runs = tuple(
                reads * block_bytes / 1e9
                for reads in (replay_before, replays())
                if reads is not None
            )
            replay = sum(replay_runs) / len(replay_runs) if replay_runs else None
            rows += [Row(backend, read_path, n, block_bytes, depth, case.gbps,
                         case.cpu_us_per_read, fio, runs, replay, replay_runs, huge)
                     for backend, read_path, case in cases]  # fmt: skip
    finally:
        shutil.rmtree(replay_log.parent, ignore_errors=True)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| backend | path | devices | block | QD | kvd GB/s | CPU µs/op | fio GB/s | kvd/fio "
        "| replay GB/s | kvd/replay |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def figures(ceiling: float | None, kvd: float) -> str:
        return f"{ceiling:.2f} | {kvd / ceiling:.2f}" if ceiling else "n/a | n/a"

    for r in rows:
        size = (
            f"{r.block_bytes >> 20} MiB" if r.block_bytes >= MiB else f"{r.block_bytes >> 10} KiB"
        )
        lines.append(
            f"| {r.backend} | {r.path} | {r.devices} | {size} | {r.depth} | {r.kvd_gbps:.2f} "
            f"| {r.cpu_us_per_read:.1f} | {figures(r.fio_gbps, r.kvd_gbps)} "
            f"| {figures(r.replay_gbps, r.kvd_gbps)} |"
        )
    return "\n".join(lines)
