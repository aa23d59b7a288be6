"""``l2_admission``: with ``twice`` a put reaches L2 only once a second
request references it (a get, a lookup that finds it, a put again), or at
once when its key was put lately; a value used once is evicted unwritten
and gone; durable puts are written whatever the rule; ``all`` writes
every put. Against a real tier on a file with O_DIRECT."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.tier import L2Tier
from kvd.store.admission import Admission, Sightings
from kvd.store.index import StoreCounters
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from tests.l2 import MiB, backend, open_devices
from tests.store.support import fetched, store_limits

PAGES = 8  # L1 holds eight values of VALUE_BYTES (one page each)
VALUE_BYTES = 1000


@asynccontextmanager
async def _store(tmp_path: Path, admission: str = "twice") -> AsyncIterator[Store]:
    """A started store of PAGES pages (LRU) over a recovered 4 MiB tier."""
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=4, segment_bytes=MiB)
    tier = L2Tier(devices, backend("threads"))
    await tier.recover()
    store = Store(Pool(PAGES * PAGE_BYTES), store_limits(l2_admission=admission), l2=tier)
    store.start()
    try:
        yield store
    finally:
        await store.close()
        tier.close()


def _value(key: bytes) -> bytes:
    return (key * VALUE_BYTES)[:VALUE_BYTES]


async def _put(store: Store, key: bytes, durable: bool = False) -> None:
    value = _value(key)
    await store.put("ns", key, value, checksum=checksum(value), hasher=checksum, durable=durable)


async def _written(store: Store) -> list[bytes]:
    """The keys on L2 once write-back has written what it was given."""
    assert store.writeback is not None and store.l2 is not None
    assert await store.writeback.flush(5.0) == 0
    keys = [b"k%d" % i for i in range(32)]
    return [key for key, held in zip(keys, store.l2.holds("ns", keys), strict=True) if held]


async def _fill(store: Store, first: int) -> None:
    """PAGES more puts (keys from k<first>): every older value leaves L1."""
    for i in range(first, first + PAGES):
        await _put(store, b"k%d" % i)


async def test_a_value_used_once_is_never_written(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        await _put(store, b"k0")
        assert await _written(store) == []
        await _fill(store, 10)
        assert store.l1_size("ns", b"k0") is None  # evicted unwritten: gone
        assert await fetched(store, b"k0") is None
        assert await _written(store) == []
        assert store.counters.l2_held_back == 1 + PAGES
        assert store.counters.l2_never_written == 1
        assert store.counters.l2_admitted == 0
        assert store.writeback is not None and store.writeback.dropped_unwritten == 0


async def _get_again(store: Store, key: bytes) -> None:
    assert await fetched(store, key) == _value(key)


async def _look_up_again(store: Store, key: bytes) -> None:
    assert store.lookup("ns", [key]).l1_hits == 1


async def _put_again(store: Store, key: bytes) -> None:
    await _put(store, key)


@pytest.mark.parametrize("reference", [_get_again, _look_up_again, _put_again])
async def test_a_second_reference_writes_it(
    tmp_path: Path, reference: Callable[[Store, bytes], Awaitable[None]]
) -> None:
    async with _store(tmp_path) as store:
        await _put(store, b"k0")
        await _put(store, b"k1")
        await reference(store, b"k0")
        assert await _written(store) == [b"k0"]
        assert store.counters.l2_admitted == 1
        await _fill(store, 10)  # k0 leaves L1 for L2 alone, k1 is gone
        assert store.l1_size("ns", b"k0") is None
        assert await fetched(store, b"k0") == _value(b"k0")  # read back from L2
        assert await fetched(store, b"k1") is None
        assert store.counters.l2_never_written >= 1


async def test_a_key_put_again_after_its_eviction_is_written_at_once(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        await _put(store, b"k0")
        await _fill(store, 10)
        assert store.l1_size("ns", b"k0") is None
        held = store.counters.l2_held_back
        await _put(store, b"k0")  # put lately: this put is its second reference
        assert store.counters.l2_held_back == held
        assert b"k0" in await _written(store)
        assert store.counters.l2_admitted == 0  # admitted at its put, not later


async def test_a_durable_put_is_written_whatever_the_rule(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        await _put(store, b"k0", durable=True)
        await _put(store, b"k1")
        await _put(store, b"k1", durable=True)  # held back, then put again durable
        assert store.l2 is not None and store.l2.holds("ns", [b"k0", b"k1"]) == [True, True]
        assert store.counters.l2_held_back == store.counters.l2_admitted == 1


async def test_all_writes_every_put(tmp_path: Path) -> None:
    async with _store(tmp_path, "all") as store:
        for i in range(3):
            await _put(store, b"k%d" % i)
        assert await _written(store) == [b"k0", b"k1", b"k2"]
        assert store.counters.l2_held_back == 0


def test_sightings_remember_the_latest_keys_within_their_bound() -> None:
    sightings = Sightings(capacity=4)
    assert not any(sightings.seen(1, b"k%d" % i) for i in range(10))
    assert len(sightings) <= 4
    assert sightings.seen(1, b"k9") and sightings.seen(1, b"k8")  # the latest stay
    assert not sightings.seen(1, b"k0")  # the oldest went
    assert not sightings.seen(2, b"k9")  # keys are per namespace


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="l2_admission 'often'"):
        Admission("often", lambda entry: None, StoreCounters())
