"""L2 read throughput of the io backends, next to fio on the same file.

``measure`` reads random block-aligned runs of a file with O_DIRECT at a
fixed queue depth through each backend and reports GB/s per case;
``fio_randread`` runs fio's io_uring engine on the same file as the
ceiling. ``kvd bench`` builds on both; ``python -m kvd.tools.bench.backends FILE``
prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import random
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvd.io.backend import open_backend

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
BLOCK_BYTES_DEFAULT = (64 * KiB, MiB, 4 * MiB)
QUEUE_DEPTHS_DEFAULT = (1, 8, 32)
QUEUE_DEPTH_MAX = 256
CASE_SECONDS_MAX = 60.0
FIO_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class IoBenchResult:
    backend: str
    block_bytes: int
    queue_depth: int
    reads: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.reads * self.block_bytes / self.seconds / 1e9


def prepare_file(path: str, file_bytes: int) -> None:
    """Create (or extend) `path` to `file_bytes` of non-zero data with O_DIRECT writes."""
    chunk_bytes = 4 * MiB
    if file_bytes <= 0 or file_bytes % chunk_bytes:
        raise ValueError(f"file_bytes must be a positive multiple of {chunk_bytes}")
    if os.path.exists(path) and os.path.getsize(path) >= file_bytes:
        return
    with mmap.mmap(-1, chunk_bytes) as chunk:
        chunk.write(random.Random(0).randbytes(chunk_bytes))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            for offset in range(0, file_bytes, chunk_bytes):
                written = os.pwritev(fd, [chunk], offset)
                assert written == chunk_bytes, written
            os.fsync(fd)
        finally:
            os.close(fd)


async def _read_case(
    kind: str, fd: int, file_bytes: int, block_bytes: int, queue_depth: int, seconds: float
) -> IoBenchResult:
    backend = open_backend(kind, depth=queue_depth, threads=queue_depth)
    blocks = file_bytes // block_bytes
    reads = [0]
    with mmap.mmap(-1, block_bytes * queue_depth) as arena:
        view = memoryview(arena)

        async def worker(slot: int, deadline: float) -> None:
            rng = random.Random(slot)
            buf = view[slot * block_bytes : (slot + 1) * block_bytes]
            while time.monotonic() < deadline:
                offset = rng.randrange(blocks) * block_bytes
                got = await backend.read(fd, offset, [buf])
                if got != block_bytes:
                    raise OSError(f"short read at {offset}: {got} of {block_bytes}")
                reads[0] += 1
            buf.release()

        try:
            start = time.monotonic()
            await asyncio.gather(*(worker(i, start + seconds) for i in range(queue_depth)))
            elapsed = time.monotonic() - start
        finally:
            backend.close()
            view.release()
    return IoBenchResult(backend.name, block_bytes, queue_depth, reads[0], elapsed)


def measure(
    path: str,
    *,
    kinds: Sequence[str] = ("uring", "threads"),
    block_bytes: Sequence[int] = BLOCK_BYTES_DEFAULT,
    queue_depths: Sequence[int] = QUEUE_DEPTHS_DEFAULT,
    file_bytes: int = GiB,
    seconds_per_case: float = 1.0,
) -> list[IoBenchResult]:
    """Random O_DIRECT reads of each block size at each queue depth, per backend."""
    if not 0 < seconds_per_case <= CASE_SECONDS_MAX:
        raise ValueError(f"seconds_per_case must be in (0, {CASE_SECONDS_MAX}]")
    for qd in queue_depths:
        if not 1 <= qd <= QUEUE_DEPTH_MAX:
            raise ValueError(f"queue depth must be in 1..{QUEUE_DEPTH_MAX}, got {qd}")
    for bs in block_bytes:
        if bs < 64 * KiB or bs % (64 * KiB) or bs > file_bytes:
            raise ValueError(f"block size must be a multiple of 64 KiB <= file_bytes, got {bs}")
    prepare_file(path, file_bytes)
    results = []
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for kind in kinds:
            for bs in block_bytes:
                for qd in queue_depths:
                    results.append(
                        asyncio.run(_read_case(kind, fd, file_bytes, bs, qd, seconds_per_case))
                    )
    finally:
        os.close(fd)
    return results


def fio_randread(
    path: str,
    *,
    block_bytes: int = MiB,
    queue_depth: int = 32,
    seconds: float = 5.0,
    file_bytes: int = GiB,
    extra: Sequence[str] = (),
) -> float | None:
    """fio --ioengine=io_uring --direct=1 --rw=randread on `path`: GB/s, or None
    without fio. ``extra``: more of fio's options (its buffers' memory, say)."""
    return _fio(path, "randread", block_bytes, queue_depth, seconds, file_bytes, extra)


def fio_write(
    path: str,
    *,
    block_bytes: int = MiB,
    queue_depth: int = 4,
    seconds: float = 5.0,
    file_bytes: int = GiB,
    extra: Sequence[str] = (),
) -> float | None:
    """fio --ioengine=io_uring --direct=1 --rw=write (sequential, as write-back
    appends) on `path`, whose contents it overwrites: GB/s, or None without fio."""
    return _fio(path, "write", block_bytes, queue_depth, seconds, file_bytes, extra)


def fio_write_synced(
    path: str,
    *,
    block_bytes: int = MiB,
    queue_depth: int = 16,
    seconds: float = 5.0,
    file_bytes: int = GiB,
    extra: Sequence[str] = (),
) -> float | None:
    """``fio_write`` with an fdatasync after every ``queue_depth`` writes
    (``--fdatasync``): writes made durable in groups of the writers'
    number, as durable puts in flight together share one. GB/s, or None."""
    return _fio(path, "write", block_bytes, queue_depth, seconds, file_bytes,
                [f"--fdatasync={queue_depth}", *extra])  # fmt: skip


def fio_replay(
    log: str, *, queue_depth: int = 32, seconds: float = 5.0, extra: Sequence[str] = ()
) -> float | None:
    """fio replaying ``log`` (an iolog, version 2: each read's file, offset
    and length) as fast as it can, io_uring, O_DIRECT, ``queue_depth`` in
    flight, for at most ``seconds``: reads per second, or None without fio."""
    job = _fio_job("kvd-l2-replay", queue_depth, seconds,
                   [f"--read_iolog={log}", "--replay_no_stall=1", *extra])  # fmt: skip
    return None if job is None else float(job["read"]["iops"])


def _fio(
    path: str, rw: str, block_bytes: int, queue_depth: int, seconds: float, file_bytes: int,
    extra: Sequence[str] = (),
) -> float | None:  # fmt: skip
    options = [f"--filename={path}", f"--rw={rw}", f"--bs={block_bytes}",
               f"--size={file_bytes}", "--time_based", *extra]  # fmt: skip
    job = _fio_job("kvd-l2", queue_depth, seconds, options)
    if job is None:
        return None
    return float(job["read" if rw.endswith("read") else "write"]["bw_bytes"]) / 1e9


def _fio_job(
    name: str, queue_depth: int, seconds: float, options: Sequence[str]
) -> dict[str, Any] | None:
    """One fio job (io_uring, O_DIRECT, ``queue_depth`` in flight, at most
    ``seconds``) with ``options``: its JSON report, or None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    cmd = [fio, f"--name={name}", "--ioengine=io_uring", "--direct=1",
           f"--iodepth={queue_depth}", f"--runtime={max(1, round(seconds))}",
           "--output-format=json", *options]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=FIO_TIMEOUT_S)
    job: dict[str, Any] = json.loads(out.stdout)["jobs"][0]
    return job


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", help="file to read (created with random data if missing)")
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--kinds", default="uring,threads")
    args = parser.parse_args(argv)
    file_bytes = args.file_mib * MiB
    for r in measure(
        args.path, kinds=args.kinds.split(","), file_bytes=file_bytes, seconds_per_case=args.seconds
    ):
        print(
            f"{r.backend:8} bs={r.block_bytes // KiB:5d}KiB qd={r.queue_depth:3d} "
            f"{r.gb_per_s:6.2f} GB/s ({r.reads} reads)"
        )
    fio_gb_per_s = fio_randread(args.path, file_bytes=file_bytes, seconds=5 * args.seconds)
    if fio_gb_per_s is not None:
        print(f"fio      bs= 1024KiB qd= 32 {fio_gb_per_s:6.2f} GB/s (io_uring, direct)")


if __name__ == "__main__":
    main()
