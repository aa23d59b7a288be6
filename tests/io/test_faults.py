"""Tests for kvd.io.faults: the spec parser, each fault on raw ops, and the L2
tier driven through every fault. Whatever breaks, L2Tier.read either
returns the bytes that were stored or raises (IoError, ChecksumMismatch)."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvd.config.io_faults import FaultSpecError, parse
from kvd.io.backend import IoBackend, IoError, IoOp, OpKind
from kvd.io.faults import FaultyBackend, describe, wrap
from kvd.l2.records import ChecksumMismatch, L2Full
from kvd.l2.tier import L2Tier
from tests.l2 import BACKENDS, Aligned, Env, KiB, backend, get, payload, put, raw_read

SEGMENT_BYTES = 512 * KiB


# ---- the spec ----------------------------------------------------------------------
def test_parse_the_documented_example() -> None:
    rules = parse(
        "write:eio:nth=5, read:short:every=3 ,write:misdirect:nth=2:shift=128KiB,"
        "fsync:eio:nth=1,write:enospc:after_bytes=1MiB"
    )
    assert [str(r) for r in rules] == [
        "write:eio:nth=5",
        "read:short:every=3",
        "write:misdirect:nth=2:shift=131072",
        "fsync:eio:nth=1",
        "write:enospc:after_bytes=1048576",
    ]
    assert parse("") == [] and parse("   ") == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("wrote:eio:nth=1", "op must be one of"),
        ("write:eoi:nth=1", "fault must be one of"),
        ("write", "expected op:fault"),
        ("write:eio", "exactly one of"),
        ("write:eio:nth=1:every=2", "exactly one of"),
        ("write:eio:nth=1:nth=2", "given twice"),
        ("write:eio:nth=0", "must be in 1.."),
        ("write:eio:nth=-3", "must be in 1.."),
        ("write:eio:nth=x", "not a number"),
        ("write:eio:nth", "is not nth=N"),
        ("write:eio:when=3", "is not nth=N"),
        ("fsync:short:nth=1", "fsync moves no bytes"),
        ("fsync:misdirect:nth=1", "fsync moves no bytes"),
        ("fsync:eio:after_bytes=1", "counts read/write bytes"),
        ("write:eio:nth=1:shift=4KiB", "misdirect only"),
        ("write:misdirect:nth=1:shift=1000", "multiple of 4 KiB"),
        ("write:eio:nth=1,,read:eio:nth=1", "empty rule"),
        ("write:eio:nth=1,", "empty rule"),
        ("read:eio:after_bytes=2X", "not a number"),
        (",".join(["read:eio:nth=1"] * 65), "more than 64 rules"),
        ("x" * 5000, "longer than"),
    ],
)
def test_parse_errors_name_the_rule(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message):
        parse(spec)


async def test_wrap_empty_spec_is_the_backend_itself() -> None:
    io = backend("threads")
    try:
        assert wrap(io, "") is io
        assert describe(io) == ""
        faulty = wrap(io, "read:eio:nth=1")
        assert isinstance(faulty, FaultyBackend)
        assert faulty.name == "threads+faults"
        assert describe(faulty) == "read:eio:nth=1"
    finally:
        io.close()


# ---- each fault on raw ops ---------------------------------------------------------
@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def raw(tmp_path: Path, kind: str) -> AsyncIterator[tuple[IoBackend, int, str]]:
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.ftruncate(fd, 1024 * KiB)
    io = backend(kind)
    yield io, fd, path
    io.close()
    os.close(fd)


async def test_nth_and_every(raw: tuple[IoBackend, int, str]) -> None:
    io, fd, _ = raw
    faulty = wrap(io, "write:eio:nth=2,read:enospc:every=2")
    buf = Aligned(4 * KiB)
    ops = [IoOp(OpKind.WRITE, fd, i * 4 * KiB, [buf.view]) for i in range(4)]
    assert await faulty.submit_many(ops) == [4096, -errno.EIO, 4096, 4096]
    reads = [await faulty.submit_many([IoOp(OpKind.READ, fd, 0, [buf.view])]) for _ in range(4)]
    assert reads == [[4096], [-errno.ENOSPC], [4096], [-errno.ENOSPC]]
    assert await faulty.read(fd, 0, [buf.view]) == 4096
    with pytest.raises(IoError) as info:
        await faulty.read(fd, 0, [buf.view])  # the 6th read
    assert info.value.errno == errno.ENOSPC
    assert isinstance(faulty, FaultyBackend) and len(faulty.injected) == 4
    buf.close()


async def test_short_moves_half(raw: tuple[IoBackend, int, str]) -> None:
    io, fd, path = raw
    faulty = wrap(io, "write:short:nth=1,read:short:nth=1")
    buf = Aligned(16 * KiB)
    buf.view[:] = b"\xab" * len(buf.view)
    assert await faulty.write(fd, 0, [buf.view[: 8 * KiB], buf.view[8 * KiB :]]) == 8 * KiB
    assert raw_read(path, 0, 16 * KiB) == b"\xab" * 8 * KiB + bytes(8 * KiB)
    buf.view[:] = b"\xcd" * len(buf.view)
    assert await faulty.read(fd, 0, [buf.view]) == 8 * KiB
    assert bytes(buf.view) == b"\xab" * 8 * KiB + b"\xcd" * 8 * KiB
    one = Aligned(4 * KiB)
    faulty = wrap(io, "read:short:nth=1")
    assert await faulty.read(fd, 0, [one.view]) == 0  # half of 4 KiB is no whole block
    buf.close()
    one.close()


async def test_misdirect_lands_elsewhere_and_claims_success(
    raw: tuple[IoBackend, int, str],
) -> None:
    io, fd, path = raw
    faulty = wrap(io, "write:misdirect:nth=1:shift=128KiB,read:misdirect:nth=1")
    buf = Aligned(8 * KiB)
    buf.view[:] = b"\x11" * len(buf.view)
    assert await faulty.write(fd, 64 * KiB, [buf.view]) == 8 * KiB
    assert raw_read(path, 64 * KiB, 8 * KiB) == bytes(8 * KiB)
    assert raw_read(path, 192 * KiB, 8 * KiB) == b"\x11" * 8 * KiB
    # The misdirected read of 128 KiB fetches what lies at 192 KiB.
    buf.view[:] = bytes(len(buf.view))
    assert await faulty.read(fd, 128 * KiB, [buf.view]) == 8 * KiB
    assert bytes(buf.view) == b"\x11" * 8 * KiB
    buf.close()


async def test_enospc_after_bytes_and_fsync(raw: tuple[IoBackend, int, str]) -> None:
    io, fd, _ = raw
    faulty = wrap(io, "write:enospc:after_bytes=12KiB,fsync:eio:nth=1")
    buf = Aligned(8 * KiB)
    assert await faulty.write(fd, 0, [buf.view]) == 8 * KiB
    with pytest.raises(IoError) as info:
        await faulty.write(fd, 8 * KiB, [buf.view])  # would reach 16 KiB
    assert info.value.errno == errno.ENOSPC
    assert await faulty.write(fd, 8 * KiB, [buf.view[: 4 * KiB]]) == 4 * KiB  # fits exactly
    with pytest.raises(IoError):
        await faulty.write(fd, 12 * KiB, [buf.view[: 4 * KiB]])
    with pytest.raises(IoError) as info:
        await faulty.fsync(fd, data_only=True)
    assert info.value.errno == errno.EIO
    await faulty.fsync(fd)  # nth=1 fires once
    buf.close()


# ---- the L2 tier through faults ----------------------------------------------------
@pytest.fixture
async def env(tmp_path: Path, kind: str) -> AsyncIterator[Env]:
    env = Env(tmp_path, kind, paths=2, segments=4, segment_bytes=SEGMENT_BYTES // 2,
              stripe_bytes=32 * KiB)  # fmt: skip
    yield env
    env.close_all()


async def faulty_open(env: Env, spec: str) -> L2Tier:
    """A tier on blank files whose io breaks as ``spec`` says (no recovery reads)."""
    return await env.open(lambda io: wrap(io, spec), recover=False)


async def check_reads(tier: L2Tier, values: dict[bytes, bytes]) -> tuple[int, int]:
    """Read every indexed key: right bytes or an exception, never wrong bytes."""
    good = failed = 0
    for key, value in values.items():
        record = tier.lookup("ns", key)
        if record is None:
            continue
        try:
            data = await get(tier, record)
        except (IoError, ChecksumMismatch):
            failed += 1
            assert tier.lookup("ns", key) is None, "a failed read leaves the index"
            continue
        assert data == value, f"wrong bytes for {key!r}"
        good += 1
    return good, failed


async def test_write_eio_fails_the_append_only(env: Env) -> None:
    tier = await faulty_open(env, "write:eio:nth=3")  # marker, k0, then k1's write
    await put(tier, b"k0", b"a" * 5000)
    with pytest.raises(IoError) as info:
        await put(tier, b"k1", b"b" * 5000)
    assert info.value.errno == errno.EIO
    assert tier.lookup("ns", b"k1") is None
    assert tier.counters.write_errors == 1
    await put(tier, b"k2", b"c" * 5000)
    assert await check_reads(tier, {b"k0": b"a" * 5000, b"k2": b"c" * 5000}) == (2, 0)


async def test_failed_segment_marker_is_a_clean_error(env: Env) -> None:
    tier = await faulty_open(env, "write:enospc:nth=1")
    with pytest.raises(IoError) as info:
        await put(tier, b"k", b"v")
    assert info.value.errno == errno.ENOSPC
    record = await put(tier, b"k", b"v")  # the segment went back to the free list
    assert await get(tier, record) == b"v"


async def test_short_read_is_a_miss(env: Env) -> None:
    tier = await faulty_open(env, "read:short:nth=1")
    data = payload(100 * KiB, 1)
    record = await put(tier, b"k", data)
    with pytest.raises(IoError) as info:
        await get(tier, record)
    assert info.value.errno == errno.EIO
    assert tier.lookup("ns", b"k") is None
    assert tier.counters.read_errors == 1


async def test_read_eio_keeps_errno(env: Env) -> None:
    tier = await faulty_open(env, "read:eio:every=1")
    record = await put(tier, b"k", b"v" * 100)
    with pytest.raises(IoError) as info:
        await get(tier, record)
    assert info.value.errno == errno.EIO


async def test_misdirected_write_is_a_miss_not_wrong_bytes(env: Env) -> None:
    # The 3rd write (k1) lands 64 KiB further on, over k2's slot and beyond.
    tier = await faulty_open(env, "write:misdirect:nth=3")
    values = {b"k%d" % i: payload(60 * KiB, i) for i in range(4)}
    for key, value in values.items():
        await put(tier, key, value)
    good, failed = await check_reads(tier, values)
    assert failed >= 1 and good + failed == 4
    assert tier.counters.checksum_failures == failed
    # After a restart (no faults) every surviving record still reads right.
    env.shut(tier)
    fresh = await env.open()
    await check_reads(fresh, values)


async def test_misdirected_read_is_a_miss(env: Env) -> None:
    tier = await faulty_open(env, "read:misdirect:every=1")
    values = {b"k%d" % i: payload(60 * KiB, i) for i in range(3)}
    for key, value in values.items():
        await put(tier, key, value)
    record = tier.lookup("ns", b"k0")
    assert record is not None
    with pytest.raises(ChecksumMismatch):
        await get(tier, record)


async def test_fsync_eio_fails_sync(env: Env) -> None:
    tier = await faulty_open(env, "fsync:eio:nth=1")
    await put(tier, b"k", b"v")
    with pytest.raises(IoError) as info:
        await tier.sync()
    assert info.value.errno == errno.EIO
    await tier.sync()


async def test_enospc_after_bytes_stops_appends(env: Env) -> None:
    tier = await faulty_open(env, "write:enospc:after_bytes=300KiB")
    values: dict[bytes, bytes] = {}
    errors = 0
    for i in range(8):
        key, value = b"k%d" % i, payload(60 * KiB, i)
        try:
            await put(tier, key, value)
            values[key] = value
        except IoError as exc:
            assert exc.errno == errno.ENOSPC
            errors += 1
    assert values and errors
    assert await check_reads(tier, values) == (len(values), 0)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_mixed_faults_never_return_wrong_bytes(env: Env, seed: int) -> None:
    spec = (
        "write:eio:every=7,write:misdirect:every=5,write:short:every=11,"
        "read:short:every=6,read:misdirect:every=9,read:eio:every=13"
    )
    tier = await faulty_open(env, spec)
    rng = random.Random(seed)
    values: dict[bytes, bytes] = {}
    history: dict[bytes, list[bytes]] = {}
    for step in range(60):
        key = b"k%d" % rng.randrange(20)
        action = rng.random()
        if action < 0.5:
            value = payload(rng.randrange(0, 130 * KiB), step)
            values.pop(key, None)
            try:
                await tier.delete("ns", key)  # blocks are write-once; replace by delete
                history.setdefault(key, []).append(value)
                await put(tier, key, value)
                values[key] = value
            except (IoError, L2Full):
                pass
        elif action < 0.9:
            await check_reads(tier, {key: values.get(key, b"")})
        else:
            try:
                await tier.delete("ns", key)
            except IoError:
                pass
            values.pop(key, None)
    # After a restart without faults, a key whose tombstone was lost (failed
    # or misdirected) may come back with a value it held before; its bytes
    # are still bytes once stored under that key, never anything else.
    env.shut(tier)
    fresh = await env.open()
    for namespace, key in list(fresh.index):
        record = fresh.lookup(namespace, key)
        assert record is not None
        try:
            data = await get(fresh, record)
        except (IoError, ChecksumMismatch):
            continue
        assert data in history[key], f"bytes never stored under {key!r}"
