"""The op layer's value ops (``kvd.paths.ops.values.ValueOps``) in process:
a fetch counts its time by tier and a miss, never a hit (the transport
counts that once it serves the value); a batch get answers a value with no
room in the answer RESOURCE_EXHAUSTED and keeps going; a batch put fails
item by item and counts the bytes of each item answered OK; a lookup counts its hits by
tier and a miss when it stops short."""

from __future__ import annotations

from kvd.config.settings import Config
from kvd.l1.pool import Pool
from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import ServiceLimits
from kvd.paths.ops.items import NOT_FOUND, RESOURCE_EXHAUSTED, PutItem
from kvd.paths.ops.values import ValueOps
from kvd.store.index import TIER_L1, StoreLimits
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from kvd.wire.errors import CODE_NUMBERS

NS = "values"


def _ops() -> ValueOps:
    store = Store(Pool(4 << 20), StoreLimits.from_config(Config()))
    return ValueOps(store, ServiceLimits.from_config(Config()), Metrics())


def _counter(counter: object) -> float:
    return float(counter._value.get())  # type: ignore[attr-defined]


async def test_a_fetch_counts_its_tier_and_a_miss_but_no_hit() -> None:
    ops = _ops()
    await ops.put_many("batch_put", NS, [PutItem(b"k", b"v" * 100)], chained=False, durable=False)
    reader = await ops.fetch("get", NS, b"k")
    assert reader is not None and reader.tier == TIER_L1
    reader.close()
    assert await ops.fetch("get", NS, b"gone") is None
    metrics = ops.metrics
    assert metrics.fetch_latency.labels("get", "l1")._sum.get() > 0
    assert metrics.fetch_latency.labels("get", "miss")._sum.get() > 0
    assert _counter(metrics.misses.labels("get")) == 1
    assert _counter(metrics.hits.labels("get", "l1")) == 0


async def test_a_batch_get_refuses_what_does_not_fit_and_goes_on() -> None:
    ops = _ops()
    items = [PutItem(b"big", b"b" * 1000), PutItem(b"small", b"s" * 10)]
    await ops.put_many("batch_put", NS, items, chained=False, durable=False)
    got = await ops.get_many("batch_get", NS, [b"big", b"small", b"none"], 500, 500)
    assert [v.code for v in got] == [RESOURCE_EXHAUSTED, 0, NOT_FOUND]
    assert got[1].value == b"s" * 10 and got[1].checksum == checksum(b"s" * 10)
    assert _counter(ops.metrics.hits.labels("batch_get", "l1")) == 1
    assert _counter(ops.metrics.bytes.labels("batch_get", "out")) == 10


async def test_a_batch_put_fails_item_by_item() -> None:
    ops = _ops()
    items = [PutItem(b"a", b"1" * 10, checksum=checksum(b"other")), PutItem(b"b", b"2" * 10)]
    results = await ops.put_many("batch_put", NS, items, chained=False, durable=False)
    assert results[0].code == CODE_NUMBERS["DATA_LOSS"] and results[0].message
    assert results[1].code == 0 and results[1].checksum == checksum(b"2" * 10)
    again = await ops.put_many("batch_put", NS, items[1:], chained=False, durable=False)
    assert again[0].existed
    # Bytes in count every item answered OK, one that already held them too.
    assert _counter(ops.metrics.bytes.labels("batch_put", "in")) == 20


async def test_a_lookup_counts_hits_by_tier_and_a_miss_when_short() -> None:
    ops = _ops()
    items = [PutItem(b"1", b"x"), PutItem(b"2", b"y")]
    await ops.put_many("batch_put", NS, items, chained=True, durable=False)
    result = await ops.lookup("lookup", NS, [b"1", b"2", b"3"], 0)
    assert (result.prefix_len, result.l1_hits) == (2, 2)
    assert _counter(ops.metrics.hits.labels("lookup", "l1")) == 2
    assert _counter(ops.metrics.misses.labels("lookup")) == 1
    assert await ops.exists(NS, [b"1", b"3"]) == [True, False]
    assert await ops.delete(NS, [b"1"], all_keys=False) == 1
