"""Tests for ``L2Tier.append_many`` against real O_DIRECT files on both io
backends: a batch of records goes out in one submission, and a record that
fails (a write error, a record too large, no room) fails alone or with the
records after it, never taking the others' places or leaving them unwritten."""

from __future__ import annotations

import errno
from collections.abc import Sequence

import pytest

from kvd.io import faults
from kvd.io.backend import IoBackend, IoError, IoOp, OpKind
from kvd.l2 import tier as tier_module
from kvd.l2.records import Append, L2Full, L2Record
from kvd.l2.tier import L2Tier
from kvd.wire.checksum import checksum
from tests.l2 import (
    SMALL_PAYLOAD_BYTES,
    SMALL_SEGMENT_BYTES,
    Env,
    PassThrough,
    get,
    padded,
    payload,
    put,
)


class CountedWrites(PassThrough):
    """An io backend that notes how many write ops each submission of writes carried."""

    def __init__(self, inner: IoBackend) -> None:
        super().__init__(inner)
        self.writes: list[int] = []

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        writes = sum(op.kind == OpKind.WRITE for op in ops)
        if writes:
            self.writes.append(writes)
        return await self.inner.submit_many(ops)


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


def values_of(first: int, count: int, size: int = SMALL_PAYLOAD_BYTES) -> dict[bytes, bytes]:
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
    values[b"k001"] = bytes(SMALL_SEGMENT_BYTES)
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
    record = await put(tier, b"one", payload(SMALL_PAYLOAD_BYTES, 1))
    assert await get(tier, record) == payload(SMALL_PAYLOAD_BYTES, 1)
    with pytest.raises(IoError, match="larger than a segment"):
        await put(tier, b"big", bytes(SMALL_SEGMENT_BYTES))
    assert await tier.append_many([]) == []
