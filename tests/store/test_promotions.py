"""A batched get and a lookup's read-ahead of the same L2 value, both
waiting for room in L1: the first to get pages reads it, the other shares
that read. The batch used to register its read after its wait without
looking again, so two reads claimed the key and the second to end raised
KeyError (a batched get failed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.tier import L2Tier
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from tests.l2 import MiB, backend, open_devices
from tests.store.support import fetched, store_limits

VALUE = b"x" * 1000


async def _tier(path: Path) -> L2Tier:
    tier = L2Tier(open_devices([str(path)], segments=4, segment_bytes=MiB), backend("threads"))
    await tier.recover()
    return tier


async def test_a_batch_and_a_read_ahead_waiting_for_room_read_a_value_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ssd.dat"
    tier = await _tier(path)
    first = Store(Pool(8 * PAGE_BYTES), store_limits(), l2=tier)
    first.start()
    await first.put("ns", b"x", VALUE, checksum=checksum(VALUE), hasher=checksum, durable=True)
    await first.close()
    tier.close()
    tier.devices.close()  # its lock on the file goes with it

    tier = await _tier(path)  # x is on L2 only now
    store = Store(Pool(8 * PAGE_BYTES), store_limits(), l2=tier)
    try:
        for i in range(8):  # write-back not started: L1 is full of values it must keep
            await store.put("ns", b"k%d" % i, VALUE, hasher=checksum)
        record = tier.lookup("ns", b"x")
        assert record is not None and store.placement is not None
        batch = asyncio.create_task(store.fetch_many("ns", [b"x"]))
        ahead = asyncio.create_task(store.placement.prefetch(record))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not batch.done() and not ahead.done()  # both wait for room
        store.start()  # write-back cleans L1: room for both
        got, _ = await asyncio.wait_for(asyncio.gather(batch, ahead), 10)
        for reader in got.values():
            assert reader is not None
            assert b"".join(reader.views) == VALUE
            reader.close()
        assert await fetched(store, b"x") == VALUE
        assert not store.placement.promotions
        assert store.counters.promotions == 1  # one read of x, not two
    finally:
        await store.close()
        tier.close()
        tier.devices.close()
