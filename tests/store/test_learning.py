"""A lookup's learning, told to the policy after the answer (kvd.store.learning):
the policy sees the same calls in the same order as if the lookup had made
them, so a store that defers evicts exactly what one that does not evicts;
the queue runs when the loop is free and is bounded."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.store.eviction.policy import make_policy
from kvd.store.learning import PENDING_KEYS_MAX, DeferredPolicy
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from tests.store.support import Recorded, put, read, store_limits


def test_queued_calls_reach_the_policy_before_any_other() -> None:
    recorded = Recorded(make_policy("lru"))
    deferred = DeferredPolicy(recorded)
    deferred.insert("a", None)
    deferred.insert("b", "a")
    deferred.defer_lookup(["a", "b"], ["a", "b", "c"], 2)
    assert recorded.calls[-1] == ("insert", "b", "a")  # nothing told yet
    deferred.insert("c", "b")
    assert recorded.calls[2:] == [
        ("touch", "a"),
        ("touch", "b"),
        ("on_lookup", ("a", "b", "c"), 2),
        ("insert", "c", "b"),
    ]
    deferred.defer_lookup(["a"], ["a", "x"], 1)
    assert deferred.victim(lambda key: False) == "c"  # the touches came first
    assert recorded.calls[-3:] == [("touch", "a"), ("on_lookup", ("a", "x"), 1), ("victim", "c")]
    deferred.defer_lookup(["c"], ["c"], 1)
    assert len(deferred) == 3
    assert recorded.calls[-1] == ("on_lookup", ("c",), 1)


def test_untold_lookups_reach_the_policy_first_as_empty_ones() -> None:
    """A pool member's clock moves by the lookups it was not told of before
    the chain it is told of; a plan is adopted after the queue."""
    recorded = Recorded(make_policy("density"))
    deferred = DeferredPolicy(recorded)
    deferred.defer_lookup(["a"], ["a", "b"], 1, untold=3)
    assert deferred.shared_plan() is None  # nothing planned yet; the queue ran
    assert recorded.calls == [
        ("on_lookup", (), 0),
        ("on_lookup", (), 0),
        ("on_lookup", (), 0),
        ("touch", "a"),
        ("on_lookup", ("a", "b"), 1),
    ]
    deferred.defer_lookup([], ["c"], 0, untold=1)
    assert not deferred.adopt_plan(b"no plan")
    assert recorded.calls[-3:] == [
        ("on_lookup", (), 0),
        ("on_lookup", ("c",), 0),
        ("adopt_plan", 7),
    ]


def test_the_queue_is_bounded() -> None:
    recorded = Recorded(make_policy("lru"))
    deferred = DeferredPolicy(recorded)
    chain = list(range(4096))
    lookups = 0
    while not recorded.calls:
        deferred.defer_lookup([], chain, 0)
        lookups += 1
    assert lookups == PENDING_KEYS_MAX // len(chain) + 1
    assert len(recorded.calls) == lookups  # all of them, in order, at once


async def test_the_loop_runs_the_queue_after_the_answer() -> None:
    store = Store(Pool(64 * PAGE_BYTES), store_limits())
    store.start()
    for key in (b"a", b"b"):
        await store.put("ns", key, key, checksum=checksum(key), hasher=checksum)
    assert store.lookup("ns", [b"a", b"b", b"c"]).prefix_len == 2
    assert store.learning._pending  # the answer is out, the learning not yet
    await asyncio.sleep(0)
    assert not store.learning._pending
    await store.close()


@pytest.mark.parametrize("name", ["lru", "density", "hazard", "pred"])
def test_a_deferring_store_evicts_what_an_eager_one_does(name: str) -> None:
    """Two stores, one settling its policy after every lookup as the store
    did before it deferred, one leaving it queued: the same values stay,
    op for op, through puts, lookups, gets and evictions."""
    eager = Store(Pool(24 * PAGE_BYTES), store_limits(), make_policy(name))
    lazy = Store(Pool(24 * PAGE_BYTES), store_limits(), make_policy(name))
    rng = random.Random(7)
    chains = [[b"c%d-%d" % (c, i) for i in range(rng.randint(2, 9))] for c in range(40)]
    for _ in range(600):
        chain = rng.choice(chains)
        for store in (eager, lazy):
            found = store.lookup("ns", chain).prefix_len
            if store is eager:
                store.learning.settle()
            for key in chain[:found]:
                assert read(store, key) == key
            parent = chain[found - 1] if found else None
            for key in chain[found:]:
                put(store, key, key, parent=parent)
                parent = key
        assert _resident(eager, chains) == _resident(lazy, chains)
    assert eager.counters.evictions == lazy.counters.evictions > 100


def _resident(store: Store, chains: list[list[bytes]]) -> set[bytes]:
    return {key for chain in chains for key in chain if store.entries.get("ns", key) is not None}
