"""Semantics of the store's eviction policies (kvd.store.eviction)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvd.store.eviction.chains import PARK, heap_entries_max
from kvd.store.eviction.hazard import _AGE_EDGES, HazardPolicy, turn_class
from kvd.store.eviction.lru import GdfPolicy, LruPolicy
from kvd.store.eviction.policy import (
    DEFAULT_POLICY,
    POLICIES,
    EvictionPolicy,
    UnknownPolicyError,
    make_policy,
)
from kvd.store.eviction.pred import PredPolicy
from tests.store.eviction.support import drain, insert_chain, never


def test_policies_listed_and_made() -> None:
    assert "lru" in POLICIES
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.name == name
        assert len(policy) == 0
        assert policy.victim(never) is None
    with pytest.raises(UnknownPolicyError, match="nope"):
        make_policy("nope")


@pytest.mark.parametrize("name", POLICIES)
def test_touch_many_is_a_touch_of_each_key_in_order(name: str) -> None:
    """A lookup's hits go to the policy in one ``touch_many``; the policy
    must end where a ``touch`` per key leaves it: same victims, same order."""
    rng = random.Random(7)
    policies = [make_policy(name), make_policy(name)]
    chains = [[(c, i) for i in range(rng.randrange(1, 40))] for c in range(30)]
    for policy in policies:
        for chain in chains:
            insert_chain(policy, chain)
    for step in range(300):
        # Touches of blocks looked up before and never, and of a key never
        # inserted (ignored); a lookup of another chain every other step.
        touched = rng.sample(chains, 2)
        keys = [*touched[0][: rng.randrange(40)], (99, step), *touched[1]]
        policies[0].touch_many(keys)
        for key in keys:
            policies[1].touch(key)
        if step % 2:
            chain = chains[rng.randrange(len(chains))]
            for policy in policies:
                policy.on_lookup(chain, len(chain) // 2)
    assert drain(policies[0]) == drain(policies[1])


def test_lru_order_among_unrelated_blocks() -> None:
    policy = LruPolicy[str]()
    for key in "abcd":
        policy.insert(key, None)
    policy.touch("a")
    policy.touch("c")
    assert drain(policy) == ["b", "d", "a", "c"]


@pytest.mark.parametrize("name", POLICIES)
def test_chain_is_evicted_tail_first(name: str) -> None:
    policy = make_policy(name)
    chain = [("ns", i) for i in range(5)]
    insert_chain(policy, chain)
    policy.touch(chain[0])  # the head is the most recently used block
    assert drain(policy) == list(reversed(chain))


def test_lru_evicts_leaves_before_older_ancestors() -> None:
    policy = LruPolicy[str]()
    policy.insert("root", None)
    policy.insert("x", "root")
    policy.insert("y", "root")
    policy.insert("lone", None)
    policy.touch("lone")
    # root is the oldest block, but it has resident children: the leaves go first
    # in LRU order (x, y, then lone, which was touched last but root only became a
    # leaf after x and y left and is older).
    assert drain(policy) == ["x", "y", "root", "lone"]


def test_leaf_order_is_by_last_access_within_leaves() -> None:
    policy = LruPolicy[str]()
    policy.insert("a", None)
    policy.insert("a1", "a")
    policy.insert("b", None)
    policy.insert("b1", "b")
    policy.touch("a")
    policy.touch("a1")
    assert drain(policy) == ["b1", "b", "a1", "a"]


@pytest.mark.parametrize("name", POLICIES)
def test_skip_is_respected_and_pinned_keys_stay_tracked(name: str) -> None:
    policy = make_policy(name)
    for key in range(6):
        policy.insert(key, None)
    pinned = {0, 2, 4}
    order = drain(policy, pinned.__contains__)
    assert sorted(order) == [1, 3, 5]
    assert len(policy) == 3
    assert sorted(drain(policy)) == [0, 2, 4]  # still tracked once unpinned


@pytest.mark.parametrize("name", POLICIES)
def test_interior_blocks_go_only_when_every_leaf_is_pinned(name: str) -> None:
    policy = make_policy(name)
    policy.insert("head", None)
    policy.insert("mid", "head")
    policy.insert("tail", "mid")
    assert policy.victim(lambda key: key != "head") == "head"
    # the only leaf is pinned: an unpinned interior block is offered rather than
    # stalling the store
    assert policy.victim(lambda key: key == "tail") in ("head", "mid")
    assert policy.victim(lambda key: True) is None
    assert len(policy) == 3


@pytest.mark.parametrize("name", POLICIES)
def test_remove_unknown_key_is_a_no_op(name: str) -> None:
    policy = make_policy(name)
    policy.insert("a", None)
    policy.remove("missing")
    policy.remove("missing")
    assert len(policy) == 1
    assert policy.victim(never) == "a"
    policy.remove("a")
    policy.remove("a")
    assert len(policy) == 0
    policy.touch("a")  # touching an unknown key is ignored as well
    assert policy.victim(never) is None


@pytest.mark.parametrize("name", POLICIES)
def test_child_inserted_before_parent_is_adopted(name: str) -> None:
    policy = make_policy(name)
    policy.insert("child", "parent")
    policy.insert("parent", None)
    policy.touch("parent")
    # parent is newer, but it has a resident child, so the child goes first
    assert drain(policy) == ["child", "parent"]


@pytest.mark.parametrize("name", POLICIES)
def test_removed_parent_frees_its_child_to_be_a_root(name: str) -> None:
    policy = make_policy(name)
    policy.insert("p", None)
    policy.insert("c", "p")
    policy.remove("p")  # a delete, not an eviction
    assert policy.victim(never) == "c"
    policy.remove("c")
    assert len(policy) == 0


def test_gdf_keeps_hit_blocks_over_newer_unhit_ones() -> None:
    policy = GdfPolicy[str]()
    policy.insert("hot", None)
    for _ in range(3):
        policy.touch("hot")
    policy.insert("cold", None)
    assert policy.victim(never) == "cold"


def test_gdf_remembers_hits_of_evicted_blocks() -> None:
    policy = GdfPolicy[str]()
    policy.insert("a", None)
    policy.touch("a")
    policy.touch("a")
    assert policy.victim(never) == "a"
    policy.remove("a")
    assert policy.ghost_len == 1
    policy.insert("a", None)  # comes back with its two hits
    policy.insert("b", None)
    assert policy.victim(never) == "b"
    assert policy.ghost_len == 0


def test_gdf_ghost_and_heaps_stay_bounded() -> None:
    policy = GdfPolicy[int]()
    capacity = 50
    for key in range(20_000):
        policy.insert(key, key - 1 if key % 10 else None)
        policy.touch(key)
        if key % 3 == 0 and key >= 3:
            policy.touch(key - 3)
        while len(policy) > capacity:
            victim = policy.victim(never)
            assert victim is not None
            policy.remove(victim)
        assert policy.ghost_len <= len(policy) + 1024
        # rebuilt when a push finds more than 4x the live entries + 1024
        heaps = len(policy._leaf_heap) + len(policy._inner_heap)
        assert heaps <= heap_entries_max(capacity + 1)
    assert len(policy) == capacity


def test_lru_heaps_stay_bounded_under_touches() -> None:
    policy = LruPolicy[int]()
    for key in range(100):
        policy.insert(key, None)
    for step in range(50_000):
        policy.touch(step % 100)
    assert len(policy._leaf_heap) + len(policy._inner_heap) <= heap_entries_max(100)
    assert drain(policy)[:3] == [0, 1, 2]


def _reread_hits(name: str) -> int:
    """Chains of 4 blocks, each re-read (all but its partial last block) 15
    chains later, in a cache of 100 blocks: the hits of the re-reads."""
    policy = make_policy(name)
    hits_total = 0

    def put(chain: list[tuple[int, int]], hits: int) -> None:
        parent = chain[hits - 1] if hits else None
        for key in chain[hits:]:
            while len(policy) >= 100:
                victim = policy.victim(lambda k: k in chain)
                assert victim is not None
                policy.remove(victim)
            policy.insert(key, parent)
            parent = key

    for conversation in range(400):
        chain = [(conversation, i) for i in range(4)]
        policy.on_lookup(chain, 0)
        put(chain, 0)
        if conversation >= 15:
            old = [(conversation - 15, i) for i in range(3)] + [(conversation - 15, 9)]
            resident = set(tracked(policy))
            hits = 0
            while hits < 4 and old[hits] in resident:
                policy.touch(old[hits])
                hits += 1
            policy.on_lookup(old, hits)
            put(old, hits)
            hits_total += hits
    return hits_total


def tracked(policy: EvictionPolicy[Any]) -> list[Any]:
    return list(policy._nodes)


def test_pred_learns_that_last_keys_are_never_reread() -> None:
    # A step puts 8 blocks (4 new, 4 re-put), 6 of them full: LRU holds 12.5
    # steps, so it misses nearly every re-read 15 steps back; pred learns that
    # last keys are never re-read, evicts them first and holds 16.6 steps.
    lru_hits, pred_hits = _reread_hits("lru"), _reread_hits("pred")
    assert lru_hits < 100
    assert pred_hits > 600


def test_pred_protects_a_chain_being_put_until_its_child_arrives() -> None:
    policy = make_policy("pred")
    policy.insert("other", None)
    chain = ["a", "b", "c"]
    policy.on_lookup(chain, 0)
    policy.insert("a", None)
    # "a" is a leaf whose child is announced: "other" goes first even though
    # it would otherwise be evicted after "a" (inserted earlier, same class).
    assert policy.victim(never) == "other"
    policy.remove("other")
    # With nothing else left, a protected leaf still gives way.
    assert policy.victim(never) == "a"


def test_pred_learns_reuse_per_class_and_credits_returning_chains() -> None:
    policy = PredPolicy[tuple[str, int]]()
    for conversation in range(50):
        chain = [("c", conversation * 10 + i) for i in range(4)]
        policy.on_lookup(chain, 0)
        insert_chain(policy, chain)
        policy.on_lookup(chain[:3], 3)  # the next turn re-reads all but the last
    fresh = policy._pending  # nothing announced stays pending once put
    assert not fresh
    rates = [policy.reuse_rate(k) for k in range(65)]
    assert rates[64] < 0.3 < max(rates)  # last keys: never re-read; the rest: always
    while len(policy):
        victim = policy.victim(never)
        assert victim is not None
        policy.remove(victim)
    assert policy.ghost_len <= 2 * len(policy) + 1024


def test_pred_pending_and_filling_stay_bounded() -> None:
    policy = PredPolicy[int]()
    for start in range(0, 200_000, 100):
        policy.on_lookup(list(range(start, start + 100)), 0)  # announced, never put
    assert len(policy._pending) <= 1 << 16
    for key in range(3000):
        policy.on_lookup([key, key + 1_000_000], 0)
        policy.insert(key, None)  # the chain never goes on
    assert len(policy._filling) <= 1024


def test_default_policy_is_density_and_the_config_default() -> None:
    from kvd.config.settings import Config
    from kvd.store.eviction.density import DensityPolicy

    assert DEFAULT_POLICY == "density" and DEFAULT_POLICY in POLICIES
    assert isinstance(make_policy(DEFAULT_POLICY), DensityPolicy)
    assert Config().eviction_policy == DEFAULT_POLICY


def test_the_settings_offer_exactly_the_policies_of_the_table() -> None:
    from kvd.config.settings import EVICTION_POLICIES

    assert EVICTION_POLICIES == POLICIES


def test_hazard_without_lookups_evicts_exactly_as_lru() -> None:
    rng = random.Random(7)
    lru, hazard = LruPolicy[int](), HazardPolicy[int]()
    pinned: set[int] = set()
    victims = 0
    for _ in range(5000):
        draw = rng.random()
        key = rng.randrange(300)
        if draw < 0.5:
            parent = key - 1 if key % 6 else None
            lru.insert(key, parent)
            hazard.insert(key, parent)
        elif draw < 0.75:
            lru.touch(key)
            hazard.touch(key)
        elif draw < 0.8:
            pinned ^= {key}
        else:
            victim = lru.victim(pinned.__contains__)
            assert hazard.victim(pinned.__contains__) == victim
            if victim is not None:
                assert victim not in pinned
                lru.remove(victim)
                hazard.remove(victim)
                victims += 1
    assert victims > 500 and len(lru) == len(hazard)
    assert drain(hazard) == drain(lru)


def _two_kinds(name: str) -> tuple[int, EvictionPolicy[Any]]:
    """Per cycle: a fresh 4-block chain, the next turn (3 blocks re-read + 2
    new) of the short chain from 20 cycles ago, and a fresh 80-block chain
    that never continues; 86 blocks put per cycle, cache of 400 blocks. The
    hits of the next turns (3 each at most)."""
    policy = make_policy(name)
    hits_total = 0

    def turn(chain: list[tuple[str, int, int]]) -> int:
        hits = 0
        while hits < len(chain) and chain[hits] in policy._nodes:  # type: ignore[attr-defined]
            policy.touch(chain[hits])
            hits += 1
        policy.on_lookup(chain, hits)
        parent = chain[hits - 1] if hits else None
        for key in chain[hits:]:
            while len(policy) >= 400:
                victim = policy.victim(lambda k: k in chain)
                assert victim is not None and victim not in chain
                policy.remove(victim)
            policy.insert(key, parent)
            parent = key
        return hits

    for cycle in range(600):
        turn([("short", cycle, i) for i in range(4)])
        if cycle >= 20:
            old = cycle - 20
            hits_total += turn(
                [("short", old, i) for i in range(3)] + [("next", old, 0), ("next", old, 1)]
            )
        turn([("long", cycle, i) for i in range(80)])
    return hits_total, policy


def test_hazard_learns_which_turns_come_back_and_keeps_those() -> None:
    lru_hits, _ = _two_kinds("lru")
    hazard_hits, policy = _two_kinds("hazard")
    assert isinstance(policy, HazardPolicy)
    short, long_ = turn_class(0, 4, 4), turn_class(0, 80, 80)
    assert policy.reuse_share(short) > 0.8  # every short turn is continued
    assert policy.reuse_share(long_) == 0.0
    assert policy.retention(short) > policy.retention(long_) == 0
    # LRU holds 400 / 86 < 5 cycles and misses every next turn; the hazard
    # policy keeps the short chains (~6 blocks a cycle) for the 20 cycles.
    assert lru_hits == 0
    assert hazard_hits > 0.8 * 3 * 580
    again, _ = _two_kinds("hazard")
    assert again == hazard_hits  # deterministic


def test_hazard_sees_the_next_turn_of_an_evicted_chain() -> None:
    policy = HazardPolicy[int]()
    first = [1, 2, 3, 4]
    policy.on_lookup(first, 0)
    insert_chain(policy, first)
    for key in reversed(first):
        policy.remove(key)
    assert policy.reuse_share(turn_class(0, 4, 4)) == 0.0
    # The next turn re-reads 1-2-3 (none resident) and adds 2 blocks: it is a
    # continuation (depth 1, 2 new blocks), and the first turn was reused.
    policy.on_lookup([1, 2, 3, 9, 10], 0)
    assert policy.reuse_share(turn_class(0, 4, 4)) == 1.0
    policy.insert(1, None)
    node = policy._nodes[1]
    assert node.klass == turn_class(1, 2, 5)  # type: ignore[attr-defined]
    assert node.depth == 1  # type: ignore[attr-defined]


def test_hazard_gives_a_chains_last_block_no_retention() -> None:
    policy = HazardPolicy[str]()
    policy.insert("older", None)
    chain = ["a", "b", "c"]
    policy.on_lookup(chain, 0)
    for key, parent in zip(chain, [None, "a", "b"], strict=True):
        policy.insert(key, parent)
    # "c" is the partial last block: deadline now + 0, and it is a leaf.
    assert policy.victim(never) == "older"
    policy.remove("older")
    assert drain(policy) == ["c", "b", "a"]


def test_hazard_state_stays_bounded() -> None:
    policy = HazardPolicy[int]()
    lookups = _AGE_EDGES[-1] + 2000
    for start in range(0, 2 * lookups, 2):
        policy.on_lookup([start, start + 1], 0)  # announced, never put
    assert policy.turns_len <= _AGE_EDGES[-1]
    assert policy.pending_len <= 1 << 16
    for key in range(3000):
        policy.on_lookup([key, key + 1_000_000], 0)
        policy.insert(key, None)  # the chain never goes on
    assert len(policy._filling) <= 1024
    for step in range(20_000):
        policy.touch(step % 3000)
    assert len(policy._leaf_heap) + len(policy._inner_heap) <= heap_entries_max(len(policy))


def test_hazard_same_chain_looked_up_again_is_not_a_deeper_turn() -> None:
    policy = HazardPolicy[int]()
    chain = [1, 2, 3, 4]
    policy.on_lookup(chain, 0)
    insert_chain(policy, chain)
    first = turn_class(0, 4, 4)
    for _ in range(3):  # one request looked up again and again (or retried)
        policy.on_lookup(chain, 4)
        node = policy._nodes[1]
        assert (node.depth, node.klass) == (0, first)  # type: ignore[attr-defined]
    assert policy.reuse_share(first) > 0.0  # the blocks were re-read all the same
    # A next turn that still fits the last block changes that block's key.
    policy.on_lookup([1, 2, 3, 5], 3)
    node = policy._nodes[1]
    assert (node.depth, node.klass) == (1, turn_class(1, 1, 4))  # type: ignore[attr-defined]


def test_hazard_hit_never_shortens_a_deadline() -> None:
    policy = HazardPolicy[int]()
    kept, brief = turn_class(0, 3, 3), turn_class(1, 2, 4)
    policy._retention[kept] = 1000
    policy._retention[brief] = 0
    policy.on_lookup([1, 2, 3], 0)
    insert_chain(policy, [1, 2, 3])
    planned = policy._nodes[1].priority
    assert int(planned) >> 64 == 1 + 1000
    # The next turn re-reads 1-2 as a class with no retention: the blocks keep
    # the deadline the first turn planned, with a newer access order.
    policy.on_lookup([1, 2, 7, 8], 2)
    policy.touch(1)
    node = policy._nodes[1]
    assert node.klass == brief  # type: ignore[attr-defined]
    assert int(node.priority) >> 64 == 1 + 1000 and node.priority > planned
    # A new block of the brief class goes first, as it would without the hit.
    policy.insert(7, 2)
    policy.remove(3)
    assert drain(policy) == [7, 2, 1]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_parked_key_is_not_searched_again_until_unparked(name: str) -> None:
    """A key the search was told to PARK is held out of later searches, then
    comes back where it was: the victims are those of a search that only
    stepped over it."""
    keys = [("k", i) for i in range(12)]

    def victims(park: bool) -> list[Any]:
        policy = make_policy(name)
        for key in keys:
            policy.insert(key, None)
        dirty = set(keys[:5])
        asked: list[Any] = []

        def skip(key: Any) -> int:
            asked.append(key)
            return (PARK if park else True) if key in dirty else False

        out = []
        for _ in range(3):  # the dirty keys are visited by the first search only
            out.append(policy.victim(skip))
            policy.remove(out[-1])
        if park:
            assert sorted(asked.count(key) for key in dirty) == [1] * 5
        for key in keys[:3]:  # written: evictable again
            dirty.discard(key)
            policy.unpark(key)
        policy.remove(keys[3])  # a parked key deleted
        for _ in range(3):
            out.append(policy.victim(skip))
            policy.remove(out[-1])
        dirty.clear()
        policy.unpark_all()
        while (key := policy.victim(skip)) is not None:
            out.append(key)
            policy.remove(key)
        return out

    assert victims(park=True) == victims(park=False)
