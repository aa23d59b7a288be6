"""Tests for ``L2Tier.append_many`` against real O_DIRECT files on both io
backends: a batch of records goes out in one submission, and a record that
fails (a write error, a record too large, no room) fails alone or with the
records after it, never taking the others' places or leaving them unwritten."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvd.io import faults
from kvd.io.backend import IoBackend, IoError, IoOp, OpKind
from kvd.l2 import tier as tier_module
from kvd.l2.records import Append, L2Full, L2Record
from kvd.l2.tier import L2Tier
from kvd.wire.checksum import checksum
from tests.l2 import BACKENDS, Env, KiB, get, padded, payload, put

SEGMENT_BYTES = 256 * KiB  # 1 path: a marker and three 64 KiB records
PAYLOAD_BYTES = 60 * KiB  # header + payload = exactly one 64 KiB record


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def small(tmp_path: Path, kind: str) -> AsyncIterator[Env]:
    """One path, 4 segments of 256 KiB: full after 12 records of 60 KiB."""
    env = Env(tmp_path, kind, paths=1, segments=4, segment_bytes=SEGMENT_BYTES)
    yield env
    env.close_all()


class CountedWrites:
    """An io backend that notes how many write ops each submission of writes carried."""

    def __init__(self, inner: IoBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.writes: list[int] = []

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        writes = sum(op.kind == OpKind.WRITE for op in ops)
        if writes:
            self.writes.append(writes)
        return await self.inner.submit_many(ops)

    async def read(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return await self.inner.read(fd, offset, bufs)

    async def write(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return await self.inner.write(fd, offset, bufs)

    async def fsync(self, fd: int, *, data_only: bool = False) -> None:
        await self.inner.fsync(fd, data_only=data_only)

    def close(self) -> None:
        self.inner.close()


async def append(tier: L2Tier, values: dict[bytes, bytes]) -> list[L2Record | IoError | L2Full]:
    """``values`` appended in one ``append_many`` call."""
    buffers = [padded(value) for value in values.values()]
    try:
        items = [
            Append("ns", key, b"", b"", len(value), checksum(value), [buffer.view])
            for (key, value), buffer in zip(values.items(), buffers, strict=True)
        ]
        return await tier.append_many(items)
    finally:
        for buffer in buffers:
            buffer.close()


def values_of(first: int, count: int, size: int = PAYLOAD_BYTES) -> dict[bytes, bytes]:
    return {b"k%03d" % i: payload(size, i) for i in range(first, first + count)}


async def test_a_batch_goes_out_in_one_submission(small: Env) -> None:
    counted: list[CountedWrites] = []
    tier = await small.open(lambda io: counted.append(CountedWrites(io)) or counted[0])
    values = values_of(0, 5)  # three to a segment: the batch opens two
    records = await append(tier, values)
    assert all(isinstance(r, L2Record) for r in records)
    assert len({(r.segment, r.offset) for r in records if isinstance(r, L2Record)}) == 5
    # The two segment markers, each written before its segment's first
    # record, then the five records together.
    assert counted[0].writes == [1, 1, 5]
    for record, value in zip(records, values.values(), strict=True):
        assert isinstance(record, L2Record)
        assert tier.lookup("ns", record.key) is record
        assert await get(tier, record) == value
    assert tier.stats()["l2_writes"] == 5


async def test_a_failed_write_fails_its_record_alone(small: Env) -> None:
    # Write op 1 is the first segment's marker; 2, 3 and 4 the records.
    tier = await small.open(lambda io: faults.wrap(io, "write:eio:nth=3"))
    values = values_of(0, 3)
    first, second, third = await append(tier, values)
    assert isinstance(second, IoError) and second.errno == errno.EIO
    assert tier.lookup("ns", b"k001") is None
    for record, key in ((first, b"k000"), (third, b"k002")):
        assert isinstance(record, L2Record) and tier.lookup("ns", key) is record
        assert await get(tier, record) == values[key]
    assert tier.stats()["l2_write_errors"] == 1


async def test_a_record_too_large_fails_alone(small: Env) -> None:
    tier = await small.open()
    values = values_of(0, 3)
    values[b"k001"] = bytes(SEGMENT_BYTES)
    first, big, third = await append(tier, values)
    assert isinstance(big, IoError) and big.errno == errno.EFBIG
    assert isinstance(first, L2Record) and isinstance(third, L2Record)
    assert await get(tier, third) == values[b"k002"]
    assert tier.lookup("ns", b"k001") is None


async def test_no_room_fails_the_rest_of_the_batch(
    small: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier_module, "RECLAIM_WAIT_S", 0.2)
    tier = await small.open()
    assert all(isinstance(r, L2Record) for r in await append(tier, values_of(0, 10)))
    for record in list(tier.index.values()):
        tier.pin(record)  # nothing may be reclaimed: room for two more records
    values = values_of(10, 4)
    outcomes = await append(tier, values)
    for record, (key, value) in zip(outcomes[:2], list(values.items())[:2], strict=True):
        assert isinstance(record, L2Record) and tier.lookup("ns", key) is record
        assert await get(tier, record) == value
    assert all(isinstance(outcome, L2Full) for outcome in outcomes[2:])
    assert tier.lookup("ns", b"k012") is None and tier.lookup("ns", b"k013") is None
    assert small.dropped == []


async def test_append_is_a_batch_of_one(small: Env) -> None:
    tier = await small.open()
    record = await put(tier, b"one", payload(PAYLOAD_BYTES, 1))
    assert await get(tier, record) == payload(PAYLOAD_BYTES, 1)
    with pytest.raises(IoError, match="larger than a segment"):
        await put(tier, b"big", bytes(SEGMENT_BYTES))
    assert await tier.append_many([]) == []
