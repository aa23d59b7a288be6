"""Tests for kvd.l2.tier against real O_DIRECT files on both io backends:
round trips, corruption, reclaim (with pins and reads in flight), tombstones,
and recovery after clean and torn shutdowns."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvd.io.backend import IoBackend, IoOp, OpKind, RecordDone, RecordRead, StripeLayout
from kvd.l2 import tier as tier_module
from kvd.l2.format import RECORD_ALIGN_BYTES
from kvd.l2.records import ChecksumMismatch, L2Full, SegmentState
from kvd.l2.tier import L2Tier
from tests.l2 import (
    SMALL_PAYLOAD_BYTES,
    SMALL_SEGMENT_BYTES,
    Aligned,
    Env,
    KiB,
    MiB,
    PassThrough,
    get,
    payload,
    put,
    raw_write,
)

TEST_TIMEOUT_S = 30.0


async def fill(tier: L2Tier, count: int, start: int = 0) -> dict[bytes, bytes]:
    values = {}
    for i in range(start, start + count):
        key = b"k%03d" % i
        values[key] = payload(SMALL_PAYLOAD_BYTES, i)
        await put(tier, key, values[key])
    return values


# ---- round trips -------------------------------------------------------------------
SIZES = [0, 1, 4095, 4096, 64 * KiB, MiB + 3]


@pytest.mark.parametrize("paths", [1, 3])
async def test_round_trip_sizes(tmp_path: Path, kind: str, paths: int) -> None:
    env = Env(tmp_path, kind, paths=paths, segments=3,
              segment_bytes=2 * MiB + 64 * KiB if paths == 1 else MiB)  # fmt: skip
    try:
        tier = await env.open()
        records = {}
        for size in SIZES:
            data = payload(size, size)
            record = await put(tier, b"key-%d" % size, data, meta=b"m" * (size % 7))
            assert (record.size, record.live, record.pins) == (size, True, 0)
            assert record.offset % RECORD_ALIGN_BYTES == 0
            records[size] = (record, data)
        for size, (record, data) in records.items():
            assert tier.lookup("ns", b"key-%d" % size) is record
            assert await get(tier, record) == data
        stats = tier.stats()
        assert stats["l2_entries"] == len(SIZES)
        assert stats["l2_writes"] == len(SIZES) and stats["l2_reads"] == len(SIZES)
        assert stats["l2_read_bytes"] == stats["l2_write_bytes"] == sum(SIZES)
        assert stats["checksum_failures"] == stats["l2_read_errors"] == 0
    finally:
        env.close_all()


async def test_record_larger_than_a_segment_is_refused(small: Env) -> None:
    tier = await small.open()
    with pytest.raises(OSError, match="larger than a segment"):
        await put(tier, b"big", bytes(SMALL_SEGMENT_BYTES))
    assert tier.lookup("ns", b"big") is None


async def test_concurrent_appends_all_land(small: Env) -> None:
    tier = await small.open()
    values = {b"c%02d" % i: payload(SMALL_PAYLOAD_BYTES - i * 4 * KiB, i) for i in range(9)}
    records = await asyncio.wait_for(
        asyncio.gather(*(put(tier, k, v) for k, v in values.items())), TEST_TIMEOUT_S
    )
    places = {(r.segment, r.offset) for r in records}
    assert len(places) == len(records), "two records at one place"
    for record, (key, value) in zip(records, values.items(), strict=True):
        assert record.key == key
        assert await get(tier, record) == value


# ---- corruption --------------------------------------------------------------------
@pytest.mark.parametrize("where", ["first", "last", "middle"])
async def test_corrupted_payload_is_a_miss(small: Env, where: str) -> None:
    tier = await small.open()
    data = payload(SMALL_PAYLOAD_BYTES - 100, 9)
    record = await put(tier, b"victim", data)
    other = await put(tier, b"bystander", data)
    at = {"first": 0, "last": len(data) - 1, "middle": len(data) // 2}[where]
    small.flip(record, record.header_bytes + at)
    with pytest.raises(ChecksumMismatch):
        await get(tier, record)
    assert tier.lookup("ns", b"victim") is None
    assert record.live is False
    assert small.dropped == [record]
    assert tier.counters.checksum_failures == 1
    assert tier.stats()["checksum_failures"] == 1
    assert await get(tier, other) == data


@pytest.mark.parametrize("where", ["magic", "seq", "key", "header_checksum"])
async def test_damaged_header_is_a_miss(small: Env, where: str) -> None:
    tier = await small.open()
    data = payload(SMALL_PAYLOAD_BYTES - 100, 9)
    record = await put(tier, b"victim", data)
    other = await put(tier, b"bystander", data)
    # Header offsets (kvd/l2/format.py): the key follows 64 fixed bytes and "ns".
    at = {"magic": 0, "seq": 24, "key": 66, "header_checksum": record.header_bytes - 1}[where]
    small.flip(record, at)
    with pytest.raises(ChecksumMismatch, match="header"):
        await get(tier, record)
    assert record.live is False
    assert small.dropped == [record]
    assert tier.counters.checksum_failures == 1
    assert await get(tier, other) == data


async def test_read_that_lands_on_another_record_is_a_miss(small: Env) -> None:
    # Same bytes under two keys: only the header tells the records apart.
    tier = await small.open()
    data = payload(SMALL_PAYLOAD_BYTES, 3)
    first = await put(tier, b"first", data)
    second = await put(tier, b"second", data)
    misdirected = dataclasses.replace(first, offset=second.offset)
    with pytest.raises(ChecksumMismatch, match="header"):
        await get(tier, misdirected)
    assert await get(tier, second) == data


async def test_read_of_a_deleted_record_is_a_miss(small: Env) -> None:
    tier = await small.open()
    data = payload(SMALL_PAYLOAD_BYTES, 4)
    record = await put(tier, b"gone", data)
    await tier.delete_record(record)  # its tombstone overwrites the header
    with pytest.raises(ChecksumMismatch, match="header"):
        await get(tier, record)


async def test_concurrent_reads_go_out_as_one_batch(small: Env) -> None:
    tier = await small.open()
    values = await fill(tier, 6)
    records = [tier.lookup("ns", key) for key in values]
    batches: list[int] = []
    run = tier.reads._run

    async def counted(
        layout: StripeLayout, batch: Sequence[RecordRead], on_done: RecordDone
    ) -> None:
        batches.append(len(batch))
        await run(layout, batch, on_done)

    tier.reads._run = counted
    got = await asyncio.gather(*(get(tier, r) for r in records if r is not None))
    assert got == list(values.values())
    assert batches == [6]


async def test_read_many_reports_each_record(small: Env) -> None:
    tier = await small.open()
    values = await fill(tier, 5)
    found = [tier.lookup("ns", key) for key in values]
    records = [r for r in found if r is not None]
    good, flipped, deleted, _, last = records
    small.flip(flipped, flipped.header_bytes + 10)
    await tier.delete_record(deleted)
    # The slot after the last record was never written.
    blank = dataclasses.replace(last, offset=last.offset + RECORD_ALIGN_BYTES)
    wanted = [good, flipped, deleted, blank, last]
    buffers = [Aligned(r.read_bytes) for r in wanted]
    items = [(r, [b.view]) for r, b in zip(wanted, buffers, strict=True)]
    try:
        errors = await tier.read_many(items)
        assert errors[0] is None and errors[4] is None
        assert isinstance(errors[1], ChecksumMismatch) and "checksum" in str(errors[1])
        assert isinstance(errors[2], ChecksumMismatch) and "header" in str(errors[2])
        assert isinstance(errors[3], ChecksumMismatch) and "header" in str(errors[3])
        assert bytes(buffers[0].view[: good.size]) == values[b"k000"]
        assert bytes(buffers[4].view[: last.size]) == values[b"k004"]
        # The deleted record is a miss, not damage: the flipped one and the blank slot count.
        assert tier.counters.reads == 5 and tier.counters.checksum_failures == 2
        assert not flipped.live and last.live
        assert await tier.read_many([]) == []
    finally:
        items.clear()
        for buffer in buffers:
            buffer.close()


async def test_striped_reads_go_out_together(tmp_path: Path, kind: str) -> None:
    """A value striped over three paths is one record read of three ops, and
    concurrent reads of such values share one backend call."""
    env = Env(tmp_path, kind, paths=3, segments=3, segment_bytes=MiB)
    try:
        tier = await env.open()
        values = {b"s%d" % i: payload(MiB - 8 * KiB, i) for i in range(2)}
        records = [await put(tier, key, data) for key, data in values.items()]
        calls: list[list[int]] = []
        run = tier.reads._run

        async def counted(
            layout: StripeLayout, batch: Sequence[RecordRead], on_done: RecordDone
        ) -> None:
            calls.append([len({op.fd for op in layout.ops(
                OpKind.READ, r.segment, r.offset, [memoryview(bytes(r.header_bytes)), *r.payload]
            )}) for r in batch])  # fmt: skip
            await run(layout, batch, on_done)

        tier.reads._run = counted
        got = await asyncio.gather(*(get(tier, r) for r in records))
        assert got == list(values.values())
        assert calls == [[3, 3]]  # one call; each record one op per path
    finally:
        env.close_all()


async def test_flip_in_padding_is_harmless(small: Env) -> None:
    # Bytes after the payload (inside its last 4 KiB block) are not part of it.
    tier = await small.open()
    data = payload(5000, 1)
    record = await put(tier, b"k", data)
    small.flip(record, record.header_bytes + 6000)
    assert await get(tier, record) == data


# ---- reclaim -----------------------------------------------------------------------
async def test_full_tier_reclaims_the_oldest_segment(small: Env) -> None:
    tier = await small.open()
    values = await fill(tier, 12)
    assert tier.stats()["l2_segments_free"] == 0
    assert small.dropped == []
    oldest = {r.key for r in tier.index.values() if r.segment == tier.lookup("ns", b"k000").segment}  # type: ignore[union-attr]
    assert oldest == {b"k000", b"k001", b"k002"}
    await fill(tier, 1, start=12)
    assert sorted(r.key for r in small.dropped) == sorted(oldest)
    assert all(not r.live for r in small.dropped)
    assert tier.counters.reclaims == 1 and tier.counters.reclaimed_records == 3
    for key in oldest:
        assert tier.lookup("ns", key) is None
    values[b"k012"] = payload(SMALL_PAYLOAD_BYTES, 12)
    for key, value in values.items():
        if key not in oldest:
            record = tier.lookup("ns", key)
            assert record is not None
            assert await get(tier, record) == value


async def test_pinned_segment_is_skipped(small: Env) -> None:
    tier = await small.open()
    values = await fill(tier, 12)
    pinned = tier.lookup("ns", b"k001")
    assert pinned is not None
    tier.pin(pinned)
    await fill(tier, 1, start=12)
    assert sorted(r.key for r in small.dropped) == [b"k003", b"k004", b"k005"]
    assert await get(tier, pinned) == values[b"k001"]
    tier.unpin(pinned)
    await fill(tier, 3, start=13)  # the next reclaim takes the unpinned oldest
    assert b"k001" in {r.key for r in small.dropped}


async def test_all_segments_pinned_is_l2_full(small: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_module, "RECLAIM_WAIT_S", 0.2)
    tier = await small.open()
    await fill(tier, 12)
    for record in list(tier.index.values()):
        tier.pin(record)
    with pytest.raises(L2Full):
        await fill(tier, 1, start=12)
    assert small.dropped == []
    assert len(tier.index) == 12


class GatedReads(PassThrough):
    """An io backend whose reads wait at a gate: holds a read in flight on purpose."""

    def __init__(self, inner: IoBackend) -> None:
        super().__init__(inner)
        self.armed = False
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        if self.armed and any(op.kind == OpKind.READ for op in ops) and not self.gate.is_set():
            self.entered.set()
            await self.gate.wait()
        return await self.inner.submit_many(ops)


async def test_segment_with_a_read_in_flight_is_not_reclaimed(small: Env) -> None:
    gated: list[GatedReads] = []

    def gate(io: IoBackend) -> GatedReads:
        gated.append(GatedReads(io))
        return gated[0]

    tier = await small.open(gate)
    values = await fill(tier, 12)
    reading = tier.lookup("ns", b"k000")
    assert reading is not None
    gated[0].armed = True
    task = asyncio.create_task(get(tier, reading))
    await asyncio.wait_for(gated[0].entered.wait(), TEST_TIMEOUT_S)
    await fill(tier, 1, start=12)  # must reclaim the second oldest segment
    assert sorted(r.key for r in small.dropped) == [b"k003", b"k004", b"k005"]
    gated[0].gate.set()
    assert await asyncio.wait_for(task, TEST_TIMEOUT_S) == values[b"k000"]


# ---- delete ------------------------------------------------------------------------
async def test_delete_survives_restart(small: Env) -> None:
    tier = await small.open()
    values = await fill(tier, 5)
    assert await tier.delete("ns", b"k002") is True
    assert await tier.delete("ns", b"k002") is False
    assert await tier.delete("other-ns", b"k001") is False
    assert tier.lookup("ns", b"k002") is None
    assert tier.counters.tombstones == 1
    await tier.sync()
    small.shut(tier)
    fresh = await small.open()
    assert len(fresh.index) == 4
    assert fresh.lookup("ns", b"k002") is None
    for key in values.keys() - {b"k002"}:
        record = fresh.lookup("ns", key)
        assert record is not None and await get(fresh, record) == values[key]


@pytest.mark.parametrize("same_segment", [True, False])
async def test_newer_record_of_a_key_wins_on_recover(small: Env, same_segment: bool) -> None:
    tier = await small.open()
    await put(tier, b"k", b"old" * 1000)
    assert await tier.delete("ns", b"k")
    if not same_segment:
        await fill(tier, 3)
    await put(tier, b"k", b"new" * 2000)
    # And a key written twice without a delete: the higher sequence wins too.
    await put(tier, b"twice", b"first")
    await put(tier, b"twice", b"second")
    small.shut(tier)
    fresh = await small.open()
    record = fresh.lookup("ns", b"k")
    assert record is not None and await get(fresh, record) == b"new" * 2000
    record = fresh.lookup("ns", b"twice")
    assert record is not None and await get(fresh, record) == b"second"


# ---- recovery ----------------------------------------------------------------------
@pytest.mark.parametrize("paths", [1, 3])
async def test_recover_after_clean_close(tmp_path: Path, kind: str, paths: int) -> None:
    segment_bytes = MiB if paths == 1 else 384 * KiB
    env = Env(tmp_path, kind, paths=paths, segments=4, segment_bytes=segment_bytes)
    try:
        tier = await env.open()
        values: dict[bytes, bytes] = {}
        metas: dict[bytes, bytes] = {}
        for i in range(40):  # several segment uses: the first ones are reclaimed
            key = b"r%02d" % i
            values[key] = payload((i * 37 * KiB + i) % (300 * KiB), i)
            metas[key] = b"meta-%d" % i
            await put(tier, key, values[key], namespace=f"ns{i % 2}", meta=metas[key])
        live = {(r.namespace, r.key) for r in tier.index.values()}
        assert tier.counters.reclaims > 0
        await tier.sync()
        env.shut(tier)
        fresh = await env.open()
        assert len(fresh.index) == len(live)
        assert {(r.namespace, r.key) for r in fresh.index.values()} == live
        for namespace, key in live:
            record = fresh.lookup(namespace, key)
            assert record is not None
            assert record.meta == metas[key]
            assert await get(fresh, record) == values[key]
        assert fresh.used_bytes == tier.used_bytes
        # Appends carry on after recovery, and a second recovery sees both.
        # Recovery seals every used segment; with none free, the first append
        # reclaims the oldest one.
        env.dropped.clear()
        await put(fresh, b"after", b"x" * 10)
        live -= {(r.namespace, r.key) for r in env.dropped}
        live.add(("ns", b"after"))
        assert {(r.namespace, r.key) for r in fresh.index.values()} == live
        env.shut(fresh)
        third = await env.open()
        assert len(third.index) == len(live)
        record = third.lookup("ns", b"after")
        assert record is not None and await get(third, record) == b"x" * 10
    finally:
        env.close_all()


@pytest.mark.parametrize("damage", ["header", "payload", "truncate-payload", "truncate-header"])
async def test_recover_after_a_torn_tail(small: Env, damage: str) -> None:
    tier = await small.open()
    values = await fill(tier, 4)  # the last one opens segment 2
    last = tier.lookup("ns", b"k003")
    assert last is not None
    small.shut(tier)
    path, header_at = small.location(last, 0)
    if damage == "header":
        raw_write(path, header_at + 100, b"\xff" * 50)
    elif damage == "payload":
        raw_write(path, header_at + last.header_bytes + 10 * KiB, bytes(8 * KiB))
    else:
        cut = header_at + (last.header_bytes + 100 if damage == "truncate-payload" else 1000)
        os.truncate(path, cut)  # the reopen extends the file with zeros
    fresh = await small.open()
    found = len(fresh.index)
    for key in [b"k000", b"k001", b"k002"]:
        record = fresh.lookup("ns", key)
        assert record is not None and await get(fresh, record) == values[key]
    torn = fresh.lookup("ns", b"k003")
    if torn is None:
        assert found == 3
    else:  # the header survived: the payload check turns it into a miss
        with pytest.raises(ChecksumMismatch):
            await get(fresh, torn)
        assert fresh.lookup("ns", b"k003") is None
    if damage in ("header", "truncate-header"):
        assert torn is None
    # The newest segment is reopened where its last valid record ends: the
    # torn bytes are overwritten, not skipped for the rest of the segment.
    reopened = fresh.segments[last.segment]
    assert reopened.state is SegmentState.OPEN and reopened.write_pos == reopened.tail
    await put(fresh, b"next", b"n")
    record = fresh.lookup("ns", b"next")
    assert record is not None and record.segment == last.segment


async def test_recover_skips_a_hole_in_a_segment(small: Env) -> None:
    # A write that failed mid-segment leaves a bad record between good ones.
    tier = await small.open()
    values = await fill(tier, 3)
    middle = tier.lookup("ns", b"k001")
    assert middle is not None
    small.shut(tier)
    small.flip(middle, 8)  # garble its header's generation
    fresh = await small.open()
    assert len(fresh.index) == 2
    for key in (b"k000", b"k002"):
        record = fresh.lookup("ns", key)
        assert record is not None and await get(fresh, record) == values[key]


async def test_recover_on_blank_files(small: Env) -> None:
    tier = await small.open(recover=False)
    assert await tier.recover() == 0
    assert tier.stats()["l2_segments_free"] == small.segments
    await fill(tier, 2)
    assert len(tier.index) == 2


async def test_blank_tier_appends_without_recover(small: Env) -> None:
    tier = await small.open(recover=False)
    record = await put(tier, b"k", b"v")
    assert await get(tier, record) == b"v"
