"""The ``density`` and ``s3fifo`` eviction policies (kvd.store.eviction.density,
kvd.store.eviction.s3fifo); the contract every policy keeps is tested in
tests/store/eviction/test_eviction.py."""

from __future__ import annotations

import random
import struct
from typing import Any

from kvd.store.eviction.chains import heap_entries_max
from kvd.store.eviction.density import (
    _AGE_EDGES,
    _CLASSES,
    _LAST,
    _PLAN_FRESH,
    _REFRESH,
    DensityPolicy,
    _DensityNode,
    reference_class,
)
from kvd.store.eviction.lru import LruPolicy
from kvd.store.eviction.policy import make_policy
from kvd.store.eviction.s3fifo import S3FifoPolicy
from tests.store.eviction.support import drain, insert_chain, never, planned


def test_density_without_lookups_evicts_exactly_as_lru() -> None:
    rng = random.Random(11)
    lru, density = LruPolicy[int](), DensityPolicy[int]()
    pinned: set[int] = set()
    victims = 0
    for _ in range(5000):
        draw = rng.random()
        key = rng.randrange(300)
        if draw < 0.5:
            parent = key - 1 if key % 6 else None
            lru.insert(key, parent)
            density.insert(key, parent)
        elif draw < 0.75:
            lru.touch(key)
            density.touch(key)
        elif draw < 0.8:
            pinned ^= {key}
        else:
            victim = lru.victim(pinned.__contains__)
            assert density.victim(pinned.__contains__) == victim
            if victim is not None:
                lru.remove(victim)
                density.remove(victim)
                victims += 1
    assert victims > 500
    assert drain(density) == drain(lru)


def replay(name: str, cycles: int = 600) -> tuple[int, Any]:
    """Per cycle: a 6-block head shared by every cycle's question with a
    2-block fresh tail, and a fresh 60-block one-shot chain; the cache holds
    200 blocks (3 cycles of one-shots). The hits of the shared questions."""
    policy = make_policy(name)
    hits_total = 0

    def request(chain: list[tuple[str, int]]) -> int:
        hits = 0
        while hits < len(chain) and chain[hits] in policy._nodes:
            policy.touch(chain[hits])
            hits += 1
        policy.on_lookup(chain, hits)
        parent = chain[hits - 1] if hits else None
        for key in chain[hits:]:
            while len(policy) >= 200:
                victim = policy.victim(lambda k: k in chain)
                assert victim is not None and victim not in chain
                policy.remove(victim)
            policy.insert(key, parent)
            parent = key
        return hits

    for cycle in range(cycles):
        if cycle % 7 == 0:
            # Every 7th cycle the head is read (the rest of the time it waits
            # longer than LRU keeps it: 7 x 62 blocks put > 200).
            hits_total += request([("head", i) for i in range(6)] + [("q", cycle), ("t", cycle)])
        request([("scan", cycle * 100 + i) for i in range(60)])
    return hits_total, policy


def test_density_learns_to_keep_what_comes_back_through_one_shot_scans() -> None:
    lru_hits, _ = replay("lru")
    density_hits, policy = replay("density")
    assert isinstance(policy, DensityPolicy)
    assert lru_hits == 0  # 7 cycles put 434 blocks: LRU forgets the head
    # The head's blocks are re-read every 7 cycles (8 lookups later, count
    # rising); one-shot scan blocks never are: those get no retention, and
    # a scan's last block is not kept past the rest of its chain.
    assert density_hits > 0.8 * 6 * (600 // 7)
    scan = reference_class(0, 1, 60, False)
    head = reference_class(8, 8, 8, False)
    assert policy.reuse_share(scan) == 0.0
    assert policy.retention(scan) == 0
    assert policy.retention(head) >= 8
    assert replay("density")[0] == density_hits  # deterministic


def test_density_expects_the_re_read_head_back_and_not_a_scan() -> None:
    _, policy = replay("density", cycles=300)
    assert isinstance(policy, DensityPolicy)
    assert policy.reuse_chance(("never", "tracked")) == 1.0
    heads = [("head", i) for i in range(6) if ("head", i) in policy]
    scans = [key for key in policy._nodes if key[0] == "scan"]
    assert heads and scans
    # the head comes back every 8 lookups; a scan block never does
    for key in heads:
        assert policy.reuse_chance(key) > 0.5
        assert policy.reuse_chance(key, 1) <= policy.reuse_chance(key)
    assert max(policy.reuse_chance(key) for key in scans) < 0.05


def test_density_remembers_evicted_blocks_in_its_ghost() -> None:
    policy = DensityPolicy[int]()
    chain = [1, 2, 3]
    policy.on_lookup(chain, 0)
    insert_chain(policy, chain)
    for key in reversed(chain):
        assert policy.victim(never) == key
        policy.remove(key)
    assert policy.ghost_len == 3
    for _ in range(5):
        policy.on_lookup([99], 0)  # other lookups: the clock moves
    policy.on_lookup(chain, 0)  # the chain is back, 6 lookups later
    assert policy.ghost_len == 0
    policy.insert(1, None)
    node = policy._nodes[1]
    assert (node.gap, node.count) == (6, 2)  # type: ignore[attr-defined]
    assert node.klass == reference_class(6, 2, 3, False)  # type: ignore[attr-defined]


def test_density_state_stays_bounded() -> None:
    policy = DensityPolicy[int]()
    for start in range(0, 2 * (_AGE_EDGES[-1] + 100), 2):
        policy.on_lookup([start, start + 1], 0)  # announced, never put
    assert policy.pending_len <= 1 << 16
    for key in range(3000):
        policy.on_lookup([key, key + 1_000_000], 0)
        policy.insert(key, None)  # the chain never goes on
    assert len(policy._filling) <= 1024
    for key in range(3000):
        policy.remove(policy.victim(never))  # type: ignore[arg-type]
        policy.insert(10_000 + key, None)
        policy.on_lookup([10_000 + key], 1)
    assert policy.ghost_len <= 4 * len(policy) + 1024
    heaps = len(policy._leaf_heap) + len(policy._inner_heap)
    assert heaps <= heap_entries_max(len(policy))


def test_density_retention_is_capped_by_the_residence() -> None:
    _, policy = replay("density", cycles=300)
    # 200 blocks tracked, ~53 references per lookup: a mean residence of
    # ~4 lookups; no class is kept past 4 of them.
    residence = 200 / (policy._entered[:, 0].sum() / policy._lookups)
    assert max(policy._retention) <= 4 * residence


def test_density_victims_follow_priorities_raised_without_a_push() -> None:
    """A lookup that moves a block's deadline later leaves its heap entry
    (``lazy_raise``); the victim search still takes blocks in the order of
    their current priorities."""
    policy: DensityPolicy[int] = DensityPolicy()
    blocks = list(range(300))
    for block in blocks:
        policy.insert(block, None)  # each block a chain of its own: all leaves
    rng = random.Random(5)
    for _ in range(600):
        block = rng.choice(blocks)
        policy.touch_many([block])
        policy.on_lookup([block], 1)
    nodes = policy._nodes
    live = [e for e in policy._leaf_heap if e[2] in nodes and nodes[e[2]].seq == e[1]]
    raised = [e for e in live if e[0] != nodes[e[2]].priority]
    assert raised, "no priority was raised without a push: the test does not test it"
    while len(policy):
        expected = min(nodes, key=lambda k: nodes[k].priority)
        victim = policy.victim(never)
        assert victim == expected
        policy.remove(victim)


def test_s3fifo_scan_resistance_and_promotion() -> None:
    policy = S3FifoPolicy[str]()
    for key in "abcdefghij":  # ten unrelated blocks in the small queue
        policy.insert(key, None)
    policy.touch("a")  # hit while small: promoted when its turn comes
    assert policy.small_len == 10
    assert policy.victim(never) == "b"  # "a" went to the main queue instead
    policy.remove("b")
    assert policy.small_len == 8 and policy.ghost_len == 1
    policy.insert("b", None)  # back from the ghost: straight into main
    assert policy.small_len == 8
    # Main ("a", "b") goes round once per hit; small is over its share.
    assert drain(policy)[:8] == list("cdefghij")


def test_s3fifo_evicts_a_chain_tail_first_within_a_queue() -> None:
    policy = S3FifoPolicy[int]()
    insert_chain(policy, [1, 2, 3, 4])
    assert drain(policy) == [4, 3, 2, 1]


def test_a_pool_member_keeps_blocks_by_the_holders_plan_while_it_is_fresh() -> None:
    assert DensityPolicy[Any]().shared_plan() is None  # nothing planned yet
    holder, member = planned("holder", 4), planned("member", 9, lookups=320)
    plan = holder.shared_plan()
    assert plan is not None and member.shared_plan() is not None
    own = [member.retention(c) for c in range(_CLASSES)]
    holders = [holder.retention(c) for c in range(_CLASSES)]
    assert own != holders  # planned apart, from their own references
    assert member.adopt_plan(plan) and member.plan_adopted
    assert [member.retention(c) for c in range(_CLASSES)] == holders
    for _ in range(_PLAN_FRESH):  # its own plans wait while the adopted one is fresh
        member.on_lookup([], 0, [])
    assert [member.retention(c) for c in range(_CLASSES)] == holders
    for _ in range(_REFRESH):
        member.on_lookup([], 0, [])
    assert not member.plan_adopted
    assert [member.retention(c) for c in range(_CLASSES)] != holders  # its own again


def test_a_plan_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    holder, member = planned("holder", 4), planned("member", 9, lookups=320)
    plan = holder.shared_plan()
    assert plan is not None
    before = [member.retention(c) for c in range(_CLASSES)]
    tracked = struct.unpack_from("<Q", plan)[0]
    too_long = struct.pack(f"<Q{_CLASSES}I", tracked, *([_AGE_EDGES[-1] + 1] * _CLASSES))
    for bad in (plan[:-4], plan + b"\0\0\0\0", b"", too_long):
        assert not member.adopt_plan(bad)
    # A member of another size plans for itself: its plan fills its blocks.
    assert not member.adopt_plan(struct.pack("<Q", 2 * tracked) + plan[8:])
    assert not member.adopt_plan(struct.pack("<Q", tracked // 2) + plan[8:])
    assert [member.retention(c) for c in range(_CLASSES)] == before
    assert not member.plan_adopted
    # The other policies share no plan and adopt none.
    for name in ("lru", "s3fifo", "hazard"):
        assert make_policy(name).shared_plan() is None
        assert not make_policy(name).adopt_plan(plan)


def test_a_block_handed_on_keeps_its_history_at_its_new_owner() -> None:
    """``history`` at the old owner and ``expect`` at the new one: the block
    keeps its class, count and the lookups left to its deadline, moved to
    the new owner's clock, so it goes after a block put there without one."""
    old = planned("x", 8)
    key = ("x", "head", 0)
    history = old.history(key)
    assert history is not None and old.history(("x", "never", 0)) is None
    theirs = old._nodes[key]
    assert isinstance(theirs, _DensityNode) and theirs.due > old._now  # kept a while
    new = DensityPolicy[Any]()
    for _ in range(50):
        new.on_lookup([], 0)
    assert new.expect(key, history)
    new.insert(key, None)
    new.insert(("plain", 0), None)  # unannounced, no plan yet: due now
    ours = new._nodes[key]
    assert isinstance(ours, _DensityNode)
    assert (ours.klass, ours.gap, ours.count) == (theirs.klass, theirs.gap, theirs.count)
    assert ours.due - new._now == theirs.due - old._now
    assert new._now - ours.tick == old._now - theirs.tick
    assert drain(new) == [("plain", 0), key]
    # Nothing changes for a resident key, or bytes that are no history.
    new.insert(key, None)
    assert not new.expect(key, history)
    pack = struct.Struct("<IIIIq").pack
    for bad in (
        history[:-1],
        pack(_CLASSES, 0, 0, 1, 0),
        pack(0, 0, 0, 0, 0),
        pack(0, 0, 0, 1, _AGE_EDGES[-1] + 1),
    ):
        assert not new.expect(("bad", 0), bad)
    # Gaps and ages past 32 bits are said as the longest there is.
    long_lived = DensityPolicy[Any]()
    long_lived.on_lookup(["k"], 0)
    long_lived.insert("k", None)
    ancient = long_lived._nodes["k"]
    assert isinstance(ancient, _DensityNode)
    ancient.gap, long_lived._now = 1 << 40, 1 << 41
    said = long_lived.history("k")
    assert said is not None
    assert struct.unpack("<IIIIq", said)[1:3] == ((1 << 32) - 1, (1 << 32) - 1)
    # A deadline long past and a reference older than this policy's clock:
    # due at lookup 0, made at lookup 0; it goes before a block due now,
    # and it is not held back as a chain being put.
    assert new.expect(("late", 0), pack(0, 0, 10**6, 1, -(10**6)))
    new.insert(("late", 0), None)
    late = new._nodes[("late", 0)]
    assert isinstance(late, _DensityNode) and (late.tick, late.due) == (0, 0)
    new.insert(("plain", 1), None)
    assert drain(new)[0] == ("late", 0)


def test_a_handed_on_reference_is_learned_from_where_it_waits() -> None:
    """A handed-on reference joins the new owner's learning at its age: its
    reuse there is counted against its entry, as a reference made there."""
    old = DensityPolicy[Any]()
    old.on_lookup(["k"], 0)
    old.insert("k", None)
    history = old.history("k")
    assert history is not None
    new = DensityPolicy[Any]()
    for _ in range(5):
        new.on_lookup([], 0)
    assert new.expect("k", history)
    new.insert("k", None)
    new.on_lookup(["k"], 1)
    # Two references of a chain's last block entered (the handed one and
    # this lookup's), one reused; were the handed one not entered, its reuse
    # would count against nothing (1 of 1) and its ring row go below 0.
    assert new.reuse_share(_LAST) == 0.5
