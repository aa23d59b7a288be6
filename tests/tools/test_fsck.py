"""Tests for kvd.tools.fsck (``kvd fsck``) on real L2 files written by L2Tier."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvd import cli
from kvd.config.settings import SETTINGS_BY_NAME
from kvd.io.backend import open_backend
from kvd.l2.devices import DeviceSet, lock_paths
from kvd.l2.records import L2Record
from kvd.l2.tier import L2Tier
from kvd.tools import fsck
from tests.l2 import KiB, get, payload, put, raw_read, raw_write

SSD_BYTES = 4 * 512 * KiB  # per path
SEGMENT_BYTES = 512 * KiB
STRIPE_BYTES = 64 * KiB
RECORDS = 10


def flags(paths: list[str], *more: str) -> list[str]:
    out = [arg for path in paths for arg in ("--ssd-path", path)]
    return [*out, "--ssd-bytes", str(SSD_BYTES), "--ssd-segment-bytes", "512KiB",
            "--ssd-stripe-bytes", "64KiB", "--io-backend", "threads", *more]  # fmt: skip


async def populate(
    paths: list[str],
    deleted: int = 1,
    ssd_bytes: int = SSD_BYTES,
    segment_bytes: int = SEGMENT_BYTES,
) -> dict[bytes, L2Record]:
    """RECORDS records (minus ``deleted`` tombstoned) over the files; closes all."""
    devices = DeviceSet(paths, ssd_bytes, segment_bytes, STRIPE_BYTES)
    io = open_backend("threads", depth=8, threads=2)
    tier = L2Tier(devices, io)
    try:
        await tier.recover()
        records = {}
        for i in range(RECORDS):
            key = b"key-%d" % i
            records[key] = await put(tier, key, payload(i * 20 * KiB + i, i), meta=b"m")
        for i in range(deleted):
            assert await tier.delete("ns", b"key-%d" % i)
            del records[b"key-%d" % i]
        await tier.sync()
        return records
    finally:
        tier.close()
        io.close()
        devices.close()


def run(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, dict[str, Any]]:
    """fsck's exit status and JSON report ({} when it printed none); stderr stays readable."""
    code = fsck.main([*args, "--json"])
    captured = capsys.readouterr()
    sys.stderr.write(captured.err)
    return code, json.loads(captured.out) if captured.out.strip() else {}


def location(paths: list[str], record: L2Record, at: int) -> tuple[str, int]:
    logical = record.offset + at
    stripe = logical // STRIPE_BYTES
    return paths[stripe % len(paths)], (
        record.segment * SEGMENT_BYTES + (stripe // len(paths)) * STRIPE_BYTES
        + logical % STRIPE_BYTES
    )  # fmt: skip


@pytest.fixture(params=[1, 3])
def paths(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    return [str(tmp_path / f"ssd{i}.dat") for i in range(int(request.param))]


def test_clean_files(paths: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    records = asyncio.run(populate(paths))
    code, report = run(capsys, flags(paths))
    assert code == fsck.EXIT_CLEAN
    assert report["clean"] is True
    assert report["records"] == report["verified"] == RECORDS - 1
    assert report["tombstones"] == 1
    assert report["record_bytes"] == sum(r.size for r in records.values())
    assert report["segments"] == 4
    assert report["segments_used"] >= 1
    assert report["segments_used"] + report["segments_free"] == 4
    assert report["bad_headers"] == report["checksum_failures"] == report["read_errors"] == 0
    # The text form says the same.
    assert fsck.main(flags(paths)) == 0
    out = capsys.readouterr().out
    assert f"records {RECORDS - 1}" in out and out.strip().endswith("clean")


def test_checksum_failure_then_repair(paths: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    records = asyncio.run(populate(paths))
    victim = records[b"key-5"]
    path, offset = location(paths, victim, victim.header_bytes + 1234)
    raw_write(path, offset, bytes([raw_read(path, offset, 1)[0] ^ 1]))
    before = [raw_read(p, 0, SSD_BYTES) for p in paths]
    code, report = run(capsys, flags(paths))
    assert code == fsck.EXIT_PROBLEMS and report["clean"] is False
    assert report["checksum_failures"] == 1 and report["verified"] == RECORDS - 2
    problems = report["problems"]
    assert isinstance(problems, list)
    assert problems[0]["kind"] == "checksum" and problems[0]["key"] == b"key-5".hex()
    assert [raw_read(p, 0, SSD_BYTES) for p in paths] == before, "fsck wrote without --repair"

    code, report = run(capsys, flags(paths, "--repair"))
    assert code == fsck.EXIT_PROBLEMS and report["repaired"] == 1
    code, report = run(capsys, flags(paths))
    assert code == fsck.EXIT_CLEAN
    assert report["records"] == RECORDS - 2 and report["tombstones"] == 2

    # The daemon's recovery does not index the repaired key either.
    async def reopen() -> tuple[set[bytes], bytes]:
        devices = DeviceSet(paths, SSD_BYTES, SEGMENT_BYTES, STRIPE_BYTES)
        io = open_backend("threads", depth=8, threads=2)
        tier = L2Tier(devices, io)
        try:
            await tier.recover()
            other = tier.lookup("ns", b"key-6")
            assert other is not None
            return {key for _, key in tier.index}, await get(tier, other)
        finally:
            tier.close()
            io.close()
            devices.close()

    keys, data = asyncio.run(reopen())
    assert b"key-5" not in keys and b"key-6" in keys
    assert data == payload(6 * 20 * KiB + 6, 6)


def test_bad_header_is_reported(paths: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    records = asyncio.run(populate(paths, deleted=0))
    victim = records[b"key-3"]
    path, offset = location(paths, victim, 200)
    raw_write(path, offset, b"\xff" * 16)  # inside the header: its checksum fails
    code, report = run(capsys, flags(paths))
    assert code == fsck.EXIT_PROBLEMS
    assert report["bad_headers"] == 1 and report["records"] == RECORDS - 1
    problems = report["problems"]
    assert isinstance(problems, list)
    assert problems[0] == {"kind": "bad header", "segment": victim.segment, "offset": victim.offset}
    # Nothing to repair (recovery skips it); the report stays the same.
    code, report = run(capsys, flags(paths, "--repair"))
    assert code == fsck.EXIT_PROBLEMS and report["repaired"] == 0


def test_refuses_files_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(tmp_path / "ssd.dat")]
    asyncio.run(populate(paths))
    held = lock_paths(paths)
    try:
        code, report = run(capsys, flags(paths))
    finally:
        for fd in held:
            os.close(fd)
    assert code == fsck.EXIT_CANNOT_RUN and report == {}
    assert "in use" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ssd-bytes", "4MiB"], "less than ssd_bytes"),
        (["--ssd-bytes", "lots"], "--ssd-bytes"),
        (["--ssd-stripe-bytes", "96KiB"], "multiple of stripe"),
    ],
)
def test_refuses_wrong_geometry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    paths = [str(tmp_path / "ssd.dat")]
    asyncio.run(populate(paths))
    size = os.path.getsize(paths[0])
    assert fsck.main([*flags(paths), *extra]) == fsck.EXIT_CANNOT_RUN
    assert message in capsys.readouterr().err
    assert os.path.getsize(paths[0]) == size


def test_missing_path_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.dat")
    assert fsck.main(flags([missing])) == fsck.EXIT_CANNOT_RUN
    assert "No such file" in capsys.readouterr().err
    assert not os.path.exists(missing)


def test_config_file_and_cli_dispatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(tmp_path / "a.dat"), str(tmp_path / "b.dat")]
    asyncio.run(populate(paths, ssd_bytes=4 << 20, segment_bytes=1 << 20))
    config = tmp_path / "kvd.toml"
    config.write_text(
        f'ssd_path = {json.dumps(paths)}\nssd_bytes = "4MiB"\n'
        'ssd_segment_bytes = "1MiB"\nssd_stripe_bytes = "64KiB"\nmax_value_bytes = "1MiB"\n'
    )
    assert cli.main(["fsck", "--config", str(config), "--io-backend", "threads", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == RECORDS - 1 and report["paths"] == paths


def test_defaults_follow_the_settings_table() -> None:
    args = fsck._parser().parse_args(["--ssd-path", "x"])
    _, ssd_bytes, segment_bytes, stripe_bytes = fsck._settings(args)
    assert ssd_bytes == SETTINGS_BY_NAME["ssd_bytes"].default
    assert segment_bytes == SETTINGS_BY_NAME["ssd_segment_bytes"].default
    assert stripe_bytes == SETTINGS_BY_NAME["ssd_stripe_bytes"].default
