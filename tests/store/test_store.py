"""Store: write-once puts, pinned readers, leases, eviction under pressure."""

from __future__ import annotations

import random

import pytest

from kvd.config.settings import Config
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.store.index import PutResult, PutTicket, StoreLimits
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from kvd.wire.errors import AlreadyExists, DataLoss, InvalidArgument, ResourceExhausted
from tests.store.support import make_store, put, read, run, store_limits


def test_put_get_round_trip_and_miss() -> None:
    store, _ = make_store()
    value = random.Random(1).randbytes(3 * PAGE_BYTES + 17)
    result = put(store, b"k", value)
    assert result == PutResult(existed=False, checksum=checksum(value))
    assert read(store, b"k") == value
    assert read(store, b"other") is None
    assert read(store, b"k", ns="unknown") is None
    assert store.counters.misses == 2


def test_write_once_same_content_is_noop_other_content_rejected() -> None:
    store, _ = make_store()
    put(store, b"k", b"one")
    assert put(store, b"k", b"one").existed
    with pytest.raises(AlreadyExists):
        put(store, b"k", b"two")
    assert read(store, b"k") == b"one"
    assert store.pool.used_bytes == PAGE_BYTES  # the refused puts left no pages behind


def test_concurrent_puts_of_one_key_first_finisher_wins() -> None:
    store, _ = make_store()
    t1 = run(store.begin_put("ns", b"k", 3))
    t2 = run(store.begin_put("ns", b"k", 3))
    assert isinstance(t1, PutTicket) and isinstance(t2, PutTicket)
    t1.views[0][:] = b"abc"
    t2.views[0][:] = b"xyz"
    store.finish_put(t2, checksum(b"xyz"))
    with pytest.raises(AlreadyExists):
        store.finish_put(t1, checksum(b"abc"))
    assert read(store, b"k") == b"xyz"
    assert store.pool.used_bytes == PAGE_BYTES


def test_checksum_mismatch_is_data_loss_and_leaves_nothing() -> None:
    store, _ = make_store()
    with pytest.raises(DataLoss):
        run(store.put("ns", b"k", b"abc", checksum=checksum(b"abd"), hasher=checksum))
    assert read(store, b"k") is None
    assert store.pool.used_bytes == 0


def test_aborted_put_is_invisible_and_frees_pages() -> None:
    store, _ = make_store()
    ticket = run(store.begin_put("ns", b"k", 2 * PAGE_BYTES))
    assert isinstance(ticket, PutTicket)
    assert store.exists("ns", [b"k"]) == [False]
    store.abort_put(ticket)
    store.abort_put(ticket)  # idempotent
    assert store.pool.used_bytes == 0


@pytest.mark.parametrize(
    ("ns", "key", "size", "meta", "match"),
    [
        ("", b"k", 1, b"", "namespace is empty"),
        ("ns", b"", 1, b"", "key is empty"),
        ("ns", b"x" * 65, 1, b"", "longer than 64"),
        ("ns", b"k", 1, b"m" * 4097, "meta"),
        ("ns", b"k", 1 << 40, b"", "max_value_bytes"),
        ("ns", b"k", 17 * PAGE_BYTES, b"", "larger than the pool"),
    ],
)
def test_bad_input(ns: str, key: bytes, size: int, meta: bytes, match: str) -> None:
    store, _ = make_store(16, max_value_bytes=1 << 30)
    if size == 1 << 40:
        store, _ = make_store(16, max_value_bytes=1 << 20)
    with pytest.raises(InvalidArgument, match=match):
        run(store.begin_put(ns, key, size, meta))


def test_eviction_makes_room_and_counts() -> None:
    store, _ = make_store(pages=8)
    for i in range(20):
        put(store, b"k%d" % i, bytes([i]) * PAGE_BYTES)
    assert store.entry_count == 8
    assert store.counters.evictions == 12
    for i in range(20):
        value = read(store, b"k%d" % i)
        assert value is None or value == bytes([i]) * PAGE_BYTES


def test_reader_pins_entry_against_eviction_and_delete() -> None:
    store, _ = make_store(pages=2)
    put(store, b"a", b"A" * PAGE_BYTES)
    reader = store.open("ns", b"a")
    assert reader is not None
    put(store, b"b", b"B" * PAGE_BYTES)
    with pytest.raises(ResourceExhausted):  # a is pinned, b is the only victim, then nothing
        put(store, b"c", b"C" * PAGE_BYTES)
        put(store, b"d", b"D" * (2 * PAGE_BYTES))
    assert run(store.delete("ns", [b"a"])) == 1
    assert store.exists("ns", [b"a"]) == [False]
    assert b"".join(reader.views) == b"A" * PAGE_BYTES  # pages stay until the reader closes
    used = store.pool.used_bytes
    reader.close()
    reader.close()
    assert store.pool.used_bytes == used - PAGE_BYTES


def test_room_without_waiting_and_what_is_full_when_there_is_none() -> None:
    """begin_put_now evicts what can go at once and gives None, not an error,
    when the rest is pinned; the waiting begin_put then names the limit hit."""
    store, _ = make_store(pages=4, namespace_l1_quota_bytes=2 * PAGE_BYTES)
    put(store, b"a", b"A" * PAGE_BYTES)
    put(store, b"b", b"B" * PAGE_BYTES)
    ticket = store.begin_put_now("ns", b"c", PAGE_BYTES)  # evicts a, under the quota
    assert isinstance(ticket, PutTicket) and store.exists("ns", [b"a"]) == [False]
    store.abort_put(ticket)
    readers = [store.open("ns", b"b")]
    put(store, b"c", b"C" * PAGE_BYTES)
    readers.append(store.open("ns", b"c"))
    assert store.begin_put_now("ns", b"d", PAGE_BYTES) is None  # quota: b and c pinned
    with pytest.raises(ResourceExhausted, match="L1 quota"):
        run(store.begin_put("ns", b"d", PAGE_BYTES))
    for other in (b"x", b"y"):  # the other namespace fills the pool
        put(store, other, b"X" * PAGE_BYTES, ns="other")
        readers.append(store.open("other", other))
    assert store.begin_put_now("third", b"e", PAGE_BYTES) is None
    with pytest.raises(ResourceExhausted, match="pool full"):
        run(store.begin_put("third", b"e", PAGE_BYTES))
    assert store.counters.eviction_failures == 2
    for reader in readers:
        assert reader is not None
        reader.close()
    assert isinstance(run(store.begin_put("third", b"e", PAGE_BYTES)), PutTicket)


def test_lookup_prefix_and_lease_protects_from_eviction() -> None:
    store, clock = make_store(pages=4)
    chain = [b"c0", b"c1", b"c2"]
    for i, key in enumerate(chain):
        put(store, key, b"x" * PAGE_BYTES, parent=chain[i - 1] if i else None)
    assert store.lookup("ns", [*chain, b"c3"]).prefix_len == 3
    assert store.lookup("ns", [b"zz", *chain]).prefix_len == 0
    result = store.lookup("ns", chain, lease_ms=1000)
    assert result.lease_id and result.lease_ms == 1000
    put(store, b"other", b"o" * PAGE_BYTES)
    with pytest.raises(ResourceExhausted):
        put(store, b"big", b"b" * (2 * PAGE_BYTES))
    assert store.lookup("ns", chain).prefix_len == 3
    clock.now += 1.001
    put(store, b"big", b"b" * (2 * PAGE_BYTES))  # the lease expired: room again
    assert store.lookup("ns", chain).prefix_len < 3


def test_lease_more_pins_keys_held_past_a_prefix_under_one_lease() -> None:
    """A pool's lookup leases the keys it holds past its local prefix with
    the prefix (or in a lease of their own where there is none)."""
    store, clock = make_store(pages=3)
    for key in (b"a", b"b", b"c"):
        put(store, key, key * PAGE_BYTES)
    lease = store.lookup("ns", [b"a", b"gone"], lease_ms=1000).lease_id
    assert store.lease_more("ns", [b"b", b"absent"], 1000, lease) == lease
    assert store.lease_more("ns", [b"absent"], 1000, lease) == lease  # nothing to pin
    assert store.lease_more("ns", [b"c"], 0) == 0  # no lease asked for
    put(store, b"d", b"d" * PAGE_BYTES)  # evicts c, the one value not leased
    with pytest.raises(ResourceExhausted):
        put(store, b"big", b"x" * (2 * PAGE_BYTES))  # a and b stay
    assert store.exists("ns", [b"a", b"b", b"c"]) == [True, True, False]
    assert store.release(lease)  # both pins end with it
    put(store, b"big", b"x" * (2 * PAGE_BYTES))
    # Under a lease that ended (or none), a lease of their own.
    own = store.lease_more("ns", [b"big"], 1000, lease)
    assert own not in (0, lease)
    clock.now += 1.001
    assert store.active_leases == 0


def test_hold_pins_a_value_without_serving_it() -> None:
    store, _ = make_store(pages=2)
    put(store, b"a", b"a" * PAGE_BYTES)
    hits, bytes_out = store.counters.hits, store.counters.bytes_out
    held = store.hold("ns", b"a")
    assert held is not None and held.size == PAGE_BYTES
    assert (store.counters.hits, store.counters.bytes_out) == (hits, bytes_out)
    assert store.hold("ns", b"absent") is None
    put(store, b"b", b"b" * PAGE_BYTES)
    put(store, b"c", b"c" * PAGE_BYTES)  # evicts b: a is held
    assert store.exists("ns", [b"a", b"b", b"c"]) == [True, False, True]
    held.close()
    put(store, b"d", b"d" * PAGE_BYTES)
    put(store, b"e", b"e" * PAGE_BYTES)
    assert not store.exists("ns", [b"a"])[0]


def test_release_ends_lease_once() -> None:
    store, _ = make_store(pages=2)
    put(store, b"a", b"a")
    lease = store.lookup("ns", [b"a"], lease_ms=60_000).lease_id
    assert store.release(lease)
    assert not store.release(lease)
    assert not store.release(12345)
    assert store.active_leases == 0


def test_lookup_limits() -> None:
    store, _ = make_store(max_lookup_keys=4, lease_ms_max=100)
    with pytest.raises(InvalidArgument, match="no keys"):
        store.lookup("ns", [])
    with pytest.raises(InvalidArgument, match="max_lookup_keys"):
        store.lookup("ns", [b"k"] * 5)
    with pytest.raises(InvalidArgument, match="lease_ms_max"):
        store.lookup("ns", [b"k"], lease_ms=101)


def test_lease_count_is_bounded() -> None:
    store, _ = make_store(max_leases=2)
    put(store, b"a", b"a")
    store.lookup("ns", [b"a"], lease_ms=1000)
    store.lookup("ns", [b"a"], lease_ms=1000)
    with pytest.raises(ResourceExhausted, match="max_leases"):
        store.lookup("ns", [b"a"], lease_ms=1000)


def test_namespaces_are_isolated_and_delete_namespace() -> None:
    store, _ = make_store()
    put(store, b"k", b"in-a", ns="a")
    put(store, b"k", b"in-b", ns="b")
    assert read(store, b"k", ns="a") == b"in-a"
    assert read(store, b"k", ns="b") == b"in-b"
    assert run(store.delete_namespace("a")) == 1
    assert read(store, b"k", ns="a") is None
    assert read(store, b"k", ns="b") == b"in-b"


def test_prefix_aware_eviction_takes_chain_tails_first() -> None:
    store, _ = make_store(pages=6)
    chain = [b"h0", b"h1", b"h2", b"h3", b"h4"]
    for i, key in enumerate(chain):
        put(store, key, b"x", parent=chain[i - 1] if i else None)
    store.lookup("ns", chain)  # touches head first, tail last
    put(store, b"n0", b"y")  # fills the pool
    put(store, b"n1", b"z")  # one eviction
    put(store, b"n2", b"z")  # two evictions
    # whatever was evicted, the chain's stored part is still a prefix
    present = store.exists("ns", chain)
    assert present == sorted(present, reverse=True)
    assert present[0]


def test_working_set_four_times_the_pool_never_returns_wrong_bytes() -> None:
    store, _ = make_store(pages=32)
    rng = random.Random(3)
    values = {b"k%d" % i: rng.randbytes(rng.randrange(1, 3 * PAGE_BYTES)) for i in range(64)}
    for _ in range(2000):
        key = rng.choice(list(values))
        if rng.random() < 0.5:
            put(store, key, values[key])
        else:
            got = read(store, key)
            assert got is None or got == values[key]
    assert store.pool.used_bytes <= store.pool.capacity_bytes


def test_store_uses_the_policy_it_is_given_even_while_empty() -> None:
    from kvd.store.eviction.policy import make_policy

    policy = make_policy("pred")
    assert len(policy) == 0  # an empty policy is falsy: the store must not replace it
    store = Store(Pool(4 * PAGE_BYTES), store_limits(), policy)
    assert store.policy is policy


def test_release_needs_the_lease_namespace() -> None:
    store, _ = make_store(pages=2)
    put(store, b"a", b"a")
    lease = store.lookup("ns", [b"a"], lease_ms=60_000).lease_id
    assert not store.release(lease, "other")
    assert store.release(lease, "ns")


def test_store_limits_have_no_defaults_but_the_settings() -> None:
    config = Config()
    limits = StoreLimits.from_config(config)
    assert limits.max_value_bytes == config.max_value_bytes == 64 << 20
    assert limits.max_lookup_keys == config.max_lookup_keys
    assert limits.uploads_max_bytes == config.dram_bytes // 2  # the setting's 0
    with pytest.raises(TypeError):
        StoreLimits()  # type: ignore[call-arg]
