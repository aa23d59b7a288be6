"""``kvd fsck``: check the L2 files of a stopped daemon, optionally repair them.

    kvd fsck [--config FILE] [--ssd-path P ...] [--ssd-bytes SIZE]
             [--ssd-segment-bytes SIZE] [--ssd-stripe-bytes SIZE]
             [--io-backend auto|uring|threads] [--repair] [--json]

Geometry comes from the flags, else from ``--config``, else from the
settings table's defaults, so a bare ``kvd fsck`` checks what a bare
``kvd serve`` writes. fsck takes the same exclusive lock as the daemon (see
``kvd.l2.devices.lock_paths``), so it refuses to run while a daemon has the
files, and it never creates or grows a path: a missing path or a file smaller
than ``ssd_bytes`` stops it (that is a wrong flag, not damage).

What it does, in order:

1. Recovery, exactly as the daemon runs it at start (``L2Tier.recover``).
2. Its own walk over every used segment's headers, to count tombstones and
   find *bad headers*: blocks that carry the record magic but fail to verify,
   inside the written part of a segment or right after its last record (a
   torn append). Older uses of a segment beyond that point are free space.
3. Reads every live record's payload through the tier's verified read path.

With ``--repair`` every record whose payload failed (checksum or read error)
gets a tombstone written over its header, the files are synced, and a second
recovery confirms none of them comes back. Bad headers need no repair:
recovery already skips them.

Exit status: 0 clean; 1 problems found (repaired or not); 2 could not run
(bad usage, missing or short path, the files are in use, I/O setup failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvd.config.loading import load_config
from kvd.config.settings import SETTINGS_BY_NAME, ConfigError
from kvd.config.sizes import SizeError, format_size, parse_size
from kvd.io.backend import IoBackend, IoError, OpKind, open_backend
from kvd.l2.devices import AlignedBuffer, DeviceError, DeviceSet
from kvd.l2.format import (
    BLOCK_BYTES,
    FLAG_SEGMENT,
    FLAG_TOMBSTONE,
    HEADER_BYTES_MAX,
    RECORD_ALIGN_BYTES,
    RecordHeader,
)
from kvd.l2.records import ChecksumMismatch, L2Record, SegmentState
from kvd.l2.scan import header_at
from kvd.l2.tier import L2Tier

EXIT_CLEAN = 0
EXIT_PROBLEMS = 1
EXIT_CANNOT_RUN = 2

# Reads in flight while verifying payloads; each holds a buffer as large as
# the largest record it has read (a segment at most), so 4 bounds memory to
# 4 logical segments.
PARALLEL_READS = 4
PARALLEL_SEGMENT_WALKS = 16  # header walks at once: one 4 KiB read each step
PROBLEMS_LISTED_MAX = 1000  # the counts stay exact past it


@dataclass
class Report:
    paths: list[str]
    segment_bytes: int  # per path
    segments: int = 0
    segments_used: int = 0
    segments_free: int = 0
    records: int = 0  # live after recovery (tombstoned and superseded ones excluded)
    record_bytes: int = 0  # payload bytes of the live records
    tombstones: int = 0
    bad_headers: int = 0
    checksum_failures: int = 0
    read_errors: int = 0
    verified: int = 0
    repaired: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.bad_headers or self.checksum_failures or self.read_errors)

    def add_problem(self, **problem: Any) -> None:
        if len(self.problems) < PROBLEMS_LISTED_MAX:
            self.problems.append(problem)


class CannotRun(Exception):
    """fsck cannot look at the files (the message says why)."""


def _precheck(paths: Sequence[str], bytes_per_path: int) -> None:
    """Refuse paths that DeviceSet would create or grow: fsck changes nothing unasked."""
    for path in paths:
        try:
            info = os.stat(path)
        except OSError as exc:
            raise CannotRun(f"{path}: {exc.strerror}") from None
        if stat.S_ISREG(info.st_mode) and info.st_size < bytes_per_path:
            raise CannotRun(
                f"{path} holds {info.st_size} bytes, less than ssd_bytes "
                f"({format_size(bytes_per_path)}): wrong --ssd-bytes, or not a kvd file"
            )
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISBLK(info.st_mode)):
            raise CannotRun(f"{path} is neither a file nor a block device")


async def _header_at(
    devices: DeviceSet, io: IoBackend, buffer: AlignedBuffer, segment: int, offset: int
) -> tuple[RecordHeader | None, bool]:
    """The verified header at a logical offset (or None), and whether the magic is there."""
    found = await header_at(devices, io, buffer, segment, offset)
    if found is None:
        raise IoError(5, f"reading the header at segment {segment} offset {offset}")
    return found


async def _walk(
    devices: DeviceSet, io: IoBackend, tier: L2Tier, segment: int, report: Report
) -> None:
    """Count tombstones and bad headers of one used segment, as recovery walks it."""
    buffer = AlignedBuffer(HEADER_BYTES_MAX)
    try:
        generation = tier.segments[segment].generation
        end = devices.logical_segment_bytes
        offset = live_end = RECORD_ALIGN_BYTES
        suspects: list[int] = []
        tombstones = 0
        while offset + BLOCK_BYTES <= end:
            header, magic = await _header_at(devices, io, buffer, segment, offset)
            if (
                header is not None
                and header.generation == generation
                and not header.flags & FLAG_SEGMENT
                and offset + header.record_bytes <= end
            ):
                tombstones += bool(header.flags & FLAG_TOMBSTONE)
                offset += header.record_bytes
                live_end = offset
                continue
            if header is None and magic:
                suspects.append(offset)
            offset += RECORD_ALIGN_BYTES
        report.tombstones += tombstones
        for position in suspects:
            if position <= live_end:
                report.bad_headers += 1
                report.add_problem(kind="bad header", segment=segment, offset=position)
    finally:
        buffer.close()


async def _verify(tier: L2Tier, report: Report) -> list[L2Record]:
    """Read every live record through the tier; the ones that failed."""
    records = sorted(tier.index.values(), key=lambda r: (r.segment, r.offset))
    failed: list[L2Record] = []
    queue = iter(records)

    async def worker() -> None:
        buffer: AlignedBuffer | None = None
        try:
            for record in queue:
                need = record.read_bytes
                if need and (buffer is None or len(buffer.view) < need):
                    if buffer is not None:
                        buffer.close()
                    buffer = AlignedBuffer(need)
                views = [buffer.view[:need]] if need and buffer is not None else []
                try:
                    await tier.read(record, views)
                except ChecksumMismatch:
                    report.checksum_failures += 1
                    failed.append(record)
                    report.add_problem(kind="checksum", **_describe(record))
                except IoError as exc:
                    report.read_errors += 1
                    failed.append(record)
                    report.add_problem(kind="read error", error=str(exc), **_describe(record))
                else:
                    report.verified += 1
                finally:
                    views.clear()
        finally:
            if buffer is not None:
                buffer.close()

    await asyncio.gather(*(worker() for _ in range(PARALLEL_READS)))
    return failed


def _describe(record: L2Record) -> dict[str, Any]:
    return {
        "segment": record.segment,
        "offset": record.offset,
        "namespace": record.namespace,
        "key": record.key.hex(),
        "bytes": record.size,
        "seq": record.seq,
    }


async def _repair(devices: DeviceSet, io: IoBackend, tier: L2Tier, bad: list[L2Record]) -> None:
    """Write a tombstone over each record's header (what L2Tier.delete writes)."""
    buffer = AlignedBuffer(HEADER_BYTES_MAX)
    try:
        for record in bad:
            tomb = RecordHeader(
                record.namespace, record.key, record.parent, record.meta,
                tier.segments[record.segment].generation, record.seq, record.size,
                record.checksum, FLAG_TOMBSTONE,
            )  # fmt: skip
            encoded = tomb.encode()
            view = buffer.view[: len(encoded)]
            view[:] = encoded
            ops = devices.ops(OpKind.WRITE, record.segment, record.offset, [view])
            results = await io.submit_many(ops)
            del view
            if results != [sum(len(b) for b in op.bufs) for op in ops]:
                raise IoError(5, f"writing a tombstone at segment {record.segment}")
    finally:
        buffer.close()
    await asyncio.gather(*(io.fsync(fd, data_only=True) for fd in devices.fds()))


async def check(
    paths: Sequence[str],
    bytes_per_path: int,
    segment_bytes: int,
    stripe_bytes: int,
    *,
    repair: bool = False,
    io_backend: str = "auto",
) -> Report:
    """Run the checks (and repairs) on the files; CannotRun if they cannot be opened."""
    _precheck(paths, bytes_per_path)
    try:
        devices = DeviceSet(paths, bytes_per_path, segment_bytes, stripe_bytes)
    except DeviceError as exc:
        raise CannotRun(str(exc)) from None
    report = Report(list(paths), segment_bytes)
    try:
        io = open_backend(io_backend)
    except (RuntimeError, ValueError) as exc:
        devices.close()
        raise CannotRun(str(exc)) from None
    try:
        tier = L2Tier(devices, io)
        try:
            await tier.recover()
            report.segments = devices.segment_count
            used = [s.index for s in tier.segments if s.state is not SegmentState.FREE]
            report.segments_used = len(used)
            report.segments_free = report.segments - len(used)
            report.records = len(tier.index)
            report.record_bytes = sum(r.size for r in tier.index.values())
            walks = asyncio.Semaphore(PARALLEL_SEGMENT_WALKS)

            async def walk(segment: int) -> None:
                async with walks:
                    await _walk(devices, io, tier, segment, report)

            await asyncio.gather(*(walk(s) for s in used))
            failed = await _verify(tier, report)
            if repair and failed:
                await _repair(devices, io, tier, failed)
                report.repaired = len(failed)
                again = L2Tier(devices, io)
                try:
                    await again.recover()
                    back = [r for r in failed if (r.namespace, r.key) in again.index
                            and again.index[(r.namespace, r.key)].seq == r.seq]  # fmt: skip
                finally:
                    again.close()
                assert not back, f"repaired records came back: {back[:3]}"
        finally:
            tier.close()
    finally:
        io.close()
        devices.close()
    return report


def _default(name: str, fallback: int) -> int:
    setting = SETTINGS_BY_NAME.get(name)
    return int(setting.default) if setting is not None else fallback


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd fsck", description="Check (and repair) the L2 files of a stopped kvd."
    )
    parser.add_argument("--config", metavar="FILE", help="take paths and sizes from this file")
    parser.add_argument("--ssd-path", action="append", metavar="PATH", help="repeat for each path")
    parser.add_argument("--ssd-bytes", metavar="SIZE", help="L2 space per path")
    parser.add_argument("--ssd-segment-bytes", metavar="SIZE", help="segment size per path")
    parser.add_argument("--ssd-stripe-bytes", metavar="SIZE", help="stripe size")
    parser.add_argument("--io-backend", default="auto", choices=("auto", "uring", "threads"))
    parser.add_argument("--repair", action="store_true", help="tombstone records that fail")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _settings(args: argparse.Namespace) -> tuple[list[str], int, int, int]:
    config = load_config(args.config) if args.config else None

    def size(flag: str | None, name: str, fallback: int) -> int:
        if flag is not None:
            try:
                return parse_size(flag)
            except SizeError as exc:
                raise CannotRun(f"--{name.replace('_', '-')}: {exc}") from None
        if config is not None:
            return int(getattr(config, name))
        return _default(name, fallback)

    if args.ssd_path:
        paths = list(args.ssd_path)
    elif config is not None:
        paths = list(config.ssd_path)
    else:
        setting = SETTINGS_BY_NAME.get("ssd_path")
        paths = list(setting.default) if setting is not None else []
    if not paths:
        raise CannotRun("no SSD path: give --ssd-path")
    return (
        paths,
        size(args.ssd_bytes, "ssd_bytes", 4 << 30),
        size(args.ssd_segment_bytes, "ssd_segment_bytes", 64 << 20),
        size(args.ssd_stripe_bytes, "ssd_stripe_bytes", 256 << 10),
    )


def _print_text(report: Report) -> None:
    print(
        f"{len(report.paths)} path(s), {report.segments} segments of "
        f"{format_size(report.segment_bytes)} per path: "
        f"{report.segments_used} used, {report.segments_free} free"
    )
    print(
        f"records {report.records} ({report.record_bytes} bytes), verified {report.verified}, "
        f"tombstones {report.tombstones}"
    )
    print(
        f"bad headers {report.bad_headers}, checksum failures {report.checksum_failures}, "
        f"read errors {report.read_errors}"
    )
    for problem in report.problems:
        print("problem: " + " ".join(f"{k}={v}" for k, v in problem.items()))
    if report.repaired:
        print(f"repaired: {report.repaired} record(s) tombstoned")
    print("clean" if report.clean else "PROBLEMS FOUND")


def main(args: list[str]) -> int:
    parsed = _parser().parse_args(args)
    try:
        paths, bytes_per_path, segment_bytes, stripe_bytes = _settings(parsed)
        report = asyncio.run(
            check(paths, bytes_per_path, segment_bytes, stripe_bytes,
                  repair=parsed.repair, io_backend=parsed.io_backend)
        )  # fmt: skip
    except (CannotRun, ConfigError) as exc:
        print(f"kvd fsck: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except IoError as exc:
        print(f"kvd fsck: I/O error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if parsed.json:
        print(json.dumps({**asdict(report), "clean": report.clean}, sort_keys=True))
    else:
        _print_text(report)
    return EXIT_CLEAN if report.clean else EXIT_PROBLEMS
