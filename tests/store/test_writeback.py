"""Write-back's durable puts fail with typed errors that keep the errno; the
error registry, not the store, gives them their codes. Exists finds values
written back and gone from L1."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvd.io import faults
from kvd.io.backend import IoError
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.records import Append, L2Full, L2Record
from kvd.l2.tier import L2Tier
from kvd.store.store import Store
from kvd.store.writeback import DurableNoRoom, DurableWriteFailed
from kvd.wire.checksum import checksum
from kvd.wire.errors import KvdError, error_number
from tests.l2 import MiB, backend, open_devices
from tests.store.support import store_limits


@pytest.mark.parametrize(
    ("spec", "error", "errno_code", "code"),
    [
        ("fsync:eio:nth=1", DurableWriteFailed, 5, 14),  # EIO -> UNAVAILABLE
        ("write:enospc:nth=1", DurableNoRoom, 28, 8),  # ENOSPC -> RESOURCE_EXHAUSTED
    ],
)
async def test_a_failed_durable_put_keeps_its_errno(
    tmp_path: Path, spec: str, error: type[Exception], errno_code: int, code: int
) -> None:
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    tier = L2Tier(devices, faults.wrap(backend("threads"), spec))
    await tier.recover()
    store = Store(Pool(16 * PAGE_BYTES), store_limits(), l2=tier)
    store.start()
    try:
        value = b"v" * 1000
        with pytest.raises(error) as raised:
            await store.put("ns", b"k", value, hasher=checksum, durable=True)
        assert getattr(raised.value, "errno", None) == errno_code
        assert isinstance(raised.value, KvdError) and error_number(raised.value) == code
        assert store.l1_size("ns", b"k") is None  # a failed durable put leaves nothing
    finally:
        await store.close()
        tier.close()


async def test_exists_finds_values_in_l1_and_on_l2(tmp_path: Path) -> None:
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    tier = L2Tier(devices, backend("threads"))
    await tier.recover()
    store = Store(Pool(16 * PAGE_BYTES), store_limits(), l2=tier)
    store.start()
    try:
        for key in (b"l1", b"l2", b"both"):
            await store.put("ns", key, key * 100, hasher=checksum, durable=True)
        assert store.evict("ns", b"l2")  # on L2 alone now
        keys = [b"l2", b"none", b"l1", b"both", b"l2", b"gone"]
        assert store.exists("ns", keys) == [True, False, True, True, True, False]
        assert store.exists("other", keys) == [False] * len(keys)
        assert tier.holds("ns", [b"l2", b"none"]) == [True, False]
    finally:
        await store.close()
        tier.close()


async def test_values_waiting_for_write_back_are_searched_once(tmp_path: Path) -> None:
    """A full L1 of values not yet on L2: a put that needs room looks at each
    of them once, not once per eviction (every put of an ingest burst
    walked the whole backlog); written, they go again."""
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    tier = L2Tier(devices, backend("threads"))
    await tier.recover()
    store = Store(Pool(8 * PAGE_BYTES), store_limits(), l2=tier)
    try:
        for i in range(8):  # write-back not started yet: all eight stay dirty
            await store.put("ns", b"k%d" % i, b"v" * 1000, hasher=checksum)
        looked: list[object] = []
        pinned = store.entries._pinned
        store.entries._pinned = lambda pk: looked.append(pk) or pinned(pk)  # type: ignore[method-assign]
        first = asyncio.create_task(store.put("ns", b"n0", b"v" * 1000, hasher=checksum))
        second = asyncio.create_task(store.put("ns", b"n1", b"v" * 1000, hasher=checksum))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not first.done() and not second.done()  # waiting for write-back
        assert sorted(looked) == sorted(set(looked)) and len(looked) == 8
        store.start()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        kept = [store.l1_size("ns", b"k%d" % i) for i in range(8)]
        assert kept.count(None) == 2
        assert store.l1_size("ns", b"n0") == store.l1_size("ns", b"n1") == 1000
    finally:
        await store.close()
        tier.close()


async def test_parked_values_may_go_once_write_back_fails(tmp_path: Path) -> None:
    """Values parked while waiting for write-back become evictable when the
    writes fail (L2 is failing: they may be dropped), so a put waiting for
    room gets it at once instead of after write-back's wait."""
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    tier = L2Tier(devices, faults.wrap(backend("threads"), "write:eio:every=1"))
    await tier.recover()
    store = Store(Pool(8 * PAGE_BYTES), store_limits(), l2=tier)
    try:
        for i in range(8):  # write-back not started yet: all eight stay dirty
            await store.put("ns", b"k%d" % i, b"v" * 1000, hasher=checksum)
        put = asyncio.create_task(store.put("ns", b"n", b"v" * 1000, hasher=checksum))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not put.done()  # the eight parked, waiting for write-back
        store.start()  # every write fails
        await asyncio.wait_for(put, 2)
        assert store.l1_size("ns", b"n") == 1000
        assert [store.l1_size("ns", b"k%d" % i) for i in range(8)].count(None) == 1
    finally:
        await store.close()
        tier.close()


async def _noted_tier(tmp_path: Path, spec: str, segment_bytes: int) -> tuple[L2Tier, list[int]]:
    """A recovered tier of 3 segments with io faults ``spec``, and the
    number of records in each of its ``append_many`` calls, as they come."""
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=segment_bytes)
    tier = L2Tier(devices, faults.wrap(backend("threads"), spec))
    await tier.recover()
    batches: list[int] = []
    append_many = tier.append_many

    async def noted(items: Sequence[Append]) -> list[L2Record | IoError | L2Full]:
        batches.append(len(items))
        return await append_many(items)

    tier.append_many = noted  # type: ignore[method-assign]
    return tier, batches


async def _written_back(
    tmp_path: Path, spec: str, sizes: list[int], pool_pages: int
) -> tuple[Store, L2Tier, list[int]]:
    """Values of ``sizes`` put while write-back is stopped, then written back
    to a tier with io faults ``spec``; the store, the tier and the number of
    values in each ``append_many`` call write-back made."""
    tier, batches = await _noted_tier(tmp_path, spec, 8 * MiB)
    store = Store(Pool(pool_pages * PAGE_BYTES), store_limits(max_value_bytes=8 * MiB), l2=tier)
    for i, size in enumerate(sizes):
        await store.put("ns", b"k%d" % i, bytes([i]) * size, hasher=checksum)
    store.start()
    writeback = store.writeback
    assert writeback is not None
    async with asyncio.timeout(10.0):  # flush stops while L2 is failing: wait that out
        while await writeback.flush(0.1):
            await asyncio.sleep(0.05)
    return store, tier, batches


async def test_write_back_appends_what_is_queued_together(tmp_path: Path) -> None:
    store, tier, batches = await _written_back(tmp_path, "", [1000] * 10, 16)
    try:
        assert batches == [10]
        assert tier.holds("ns", [b"k%d" % i for i in range(10)]) == [True] * 10
    finally:
        await store.close()
        tier.close()


async def test_a_write_back_batch_holds_at_most_its_bytes(tmp_path: Path) -> None:
    sizes = [MiB] * 5 + [5 * MiB, MiB]  # batches are cut at 4 MiB, one value at least
    store, tier, batches = await _written_back(tmp_path, "", sizes, 200)
    try:
        assert batches == [4, 1, 1, 1]
        assert tier.holds("ns", [b"k%d" % i for i in range(7)]) == [True] * 7
    finally:
        await store.close()
        tier.close()


async def test_a_failed_write_in_a_batch_is_written_again_alone(tmp_path: Path) -> None:
    # Write op 1 is the segment marker, 2-5 the first batch's four records.
    store, tier, batches = await _written_back(tmp_path, "write:eio:nth=3", [1000] * 4, 16)
    try:
        assert batches == [4, 1]
        assert store.writeback is not None and store.writeback.errors == 1
        assert tier.holds("ns", [b"k%d" % i for i in range(4)]) == [True] * 4
        assert store.stats()["l1_dropped_unwritten"] == 0
    finally:
        await store.close()
        tier.close()


async def _durable_store(
    tmp_path: Path, spec: str = "", **limits: int
) -> tuple[Store, L2Tier, list[int]]:
    """A started store over a tier with io faults ``spec``; the sizes of
    the ``append_many`` calls made, noted."""
    tier, batches = await _noted_tier(tmp_path, spec, MiB)
    store = Store(Pool(32 * PAGE_BYTES), store_limits(**limits), l2=tier)
    store.start()
    return store, tier, batches


async def test_durable_puts_at_once_are_appended_and_synced_together(tmp_path: Path) -> None:
    store, tier, batches = await _durable_store(tmp_path)
    try:
        puts = [
            store.put("ns", b"d%d" % i, b"v" * 1000, hasher=checksum, durable=True)
            for i in range(8)
        ]
        await asyncio.wait_for(asyncio.gather(*puts), 10)
        assert batches == [8]
        assert tier.counters.syncs == 1
        assert tier.holds("ns", [b"d%d" % i for i in range(8)]) == [True] * 8
    finally:
        await store.close()
        tier.close()


async def test_a_durable_put_over_its_quota_fails_alone(tmp_path: Path) -> None:
    store, tier, batches = await _durable_store(tmp_path, namespace_l2_quota_bytes=256 * 1024)
    try:
        small = [
            store.put("ns", b"s%d" % i, b"v" * 1000, hasher=checksum, durable=True)
            for i in range(3)
        ]
        big = store.put("ns", b"big", b"v" * 300_000, hasher=checksum, durable=True)
        outcomes = await asyncio.wait_for(asyncio.gather(*small, big, return_exceptions=True), 10)
        assert not any(isinstance(o, BaseException) for o in outcomes[:3])
        assert isinstance(outcomes[3], KvdError) and error_number(outcomes[3]) == 8
        assert batches == [3]
        assert tier.holds("ns", [b"s0", b"s1", b"s2", b"big"]) == [True, True, True, False]
        assert store.l1_size("ns", b"big") is None  # a failed durable put leaves nothing
    finally:
        await store.close()
        tier.close()


async def test_a_failed_durable_write_fails_its_put_alone(tmp_path: Path) -> None:
    # Write op 1 is the segment marker, 2-4 the three records.
    store, tier, _ = await _durable_store(tmp_path, "write:eio:nth=3")
    try:
        puts = [
            store.put("ns", b"d%d" % i, b"v" * 1000, hasher=checksum, durable=True)
            for i in range(3)
        ]
        outcomes = await asyncio.wait_for(asyncio.gather(*puts, return_exceptions=True), 10)
        assert outcomes[0] is not None and outcomes[2] is not None
        assert not isinstance(outcomes[0], BaseException)
        assert not isinstance(outcomes[2], BaseException)
        assert isinstance(outcomes[1], DurableWriteFailed) and outcomes[1].errno == 5
        assert tier.holds("ns", [b"d0", b"d1", b"d2"]) == [True, False, True]
    finally:
        await store.close()
        tier.close()


async def test_a_value_over_its_namespace_quota_stays_in_l1_only(tmp_path: Path) -> None:
    """Write-back of a value larger than its namespace's L2 quota (nothing
    to drop for it) leaves it in L1 only, and write-back goes on: such
    values once ended the workers that met them, one each."""
    store, tier, _ = await _durable_store(tmp_path, namespace_l2_quota_bytes=128 * 1024)
    writeback = store.writeback
    assert writeback is not None
    try:
        for i in range(6):
            await store.put("ns", b"big%d" % i, b"v" * 200_000, hasher=checksum)
        await store.put("ns", b"small", b"v" * 1000, hasher=checksum)
        assert await writeback.flush(5.0) == 0
        assert tier.holds("ns", [b"small", b"big0"]) == [True, False]
        assert writeback.over_quota == 6
        assert store.l1_size("ns", b"big5") == 200_000  # still served from L1
    finally:
        await store.close()
        tier.close()
