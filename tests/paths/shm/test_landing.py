"""A batch region get copies each value its pool fetch brings into L1 into
its room as soon as it lands (``RegionOps._copy_landed``), in process. The
pool is played by the test: a ``fetch_many`` that stores each value here, as
the router does when a value comes from its owner, and says so with
``landed``. A batch that failed copies nothing that lands after it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator

import pytest

from kvd.paths.ops.items import RegionBatch, RegionItem
from kvd.wire.checksum import checksum
from tests.paths.shm.support import CALLER, Rig, region_rig

NS = "landing"
SIZE = 256 << 10


class Owners:
    """The pool's fetch of a batch's keys: each value stored here, in turn,
    then ``landed``; what the region held for it right after that call."""

    def __init__(self, rig: Rig, values: dict[bytes, bytes], fail_after: int = 0) -> None:
        self.rig = rig
        self.values = values
        self.fail_after = fail_after  # raise once this many landed, landing the rest later
        self.rooms: dict[bytes, bytes] = {}  # the room's bytes just after ``landed``
        self.offsets: dict[bytes, int] = {}
        self.late: asyncio.Task[None] | None = None

    async def fetch_many(
        self, namespace: str, keys: list[bytes], landed: Callable[[bytes], None] | None = None
    ) -> None:
        assert namespace == NS and landed is not None
        for count, key in enumerate(keys):
            if self.fail_after and count == self.fail_after:
                self.late = asyncio.create_task(self._land(keys[count:], landed))
                raise RuntimeError("a fetch failed")
            await self._land([key], landed)

    async def _land(self, keys: list[bytes], landed: Callable[[bytes], None]) -> None:
        for key in keys:
            value = self.values[key]
            await self.rig.ops.store.put(NS, key, value, checksum=checksum(value), hasher=checksum)
            landed(key)
            at = self.offsets[key]
            self.rooms[key] = bytes(self.rig.map[at : at + SIZE])


@pytest.fixture
def rig() -> Iterator[Rig]:
    with region_rig() as made:
        yield made


def _batch(rig: Rig, owners: Owners, keys: list[bytes]) -> RegionBatch:
    items = [RegionItem(key=key, offset=i * SIZE, length=SIZE) for i, key in enumerate(keys)]
    owners.offsets = {item.key: item.offset for item in items}
    return RegionBatch(rig.region.region_id, rig.region.token, NS, items)


def _pinned(rig: Rig) -> int:
    store = rig.ops.store
    return sum(entry.readers for ns in store.namespaces() for entry in ns.entries.values())


async def test_each_value_is_in_its_room_as_soon_as_it_lands(rig: Rig) -> None:
    values = {b"key-%d" % i: os.urandom(SIZE) for i in range(4)}
    owners = Owners(rig, values)
    rig.ops.values.pool = owners  # type: ignore[assignment]
    keys = list(values)
    results = await rig.ops.get_into_region(_batch(rig, owners, keys), CALLER)
    assert [result.code for result in results] == [0] * len(keys)
    # Each value was in its room before the next one landed, not only at the end.
    assert owners.rooms == values
    assert rig.map[: SIZE * len(keys)] == b"".join(values.values())
    # One hit each, given to the store (and its policy) by the batch.
    assert rig.ops.store.entries.namespace(NS).hits == len(keys)
    assert rig.ops.metrics.hits.labels("shm_get", "l1")._value.get() == len(keys)
    assert _pinned(rig) == 0 and rig.ops.inflight.bytes == 0


async def test_a_batch_that_failed_copies_nothing_that_lands_after_it(rig: Rig) -> None:
    values = {b"first": os.urandom(SIZE), b"later": os.urandom(SIZE)}
    owners = Owners(rig, values, fail_after=1)
    rig.ops.values.pool = owners  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="a fetch failed"):
        await rig.ops.get_into_region(_batch(rig, owners, list(values)), CALLER)
    assert owners.late is not None
    await owners.late  # "later" lands, and is said to have landed, after the batch ended
    assert owners.rooms[b"later"] == bytes(SIZE)  # its room untouched
    assert rig.ops.store.open(NS, b"later") is not None  # though it is in L1
    assert _pinned(rig) == 1  # that reader alone: the batch left none
    assert rig.ops.inflight.bytes == 0
