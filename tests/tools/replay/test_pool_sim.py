"""The pool simulator (kvd.tools.replay.pool_sim): one member is exactly one
daemon; over four, guests never cost an owned block its place, every key
found is one its owner or the asking member holds, and bad parameters are
refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.store.eviction.policy import POLICIES
from kvd.tools.replay.pool_sim import owners_of, simulate_pool
from kvd.tools.replay.report import head
from kvd.tools.replay.sim import SimError, belady, simulate, unbounded
from kvd.tools.replay.trace import Trace, load_trace
from tests.tools.replay.support import TRACE_PATH, trace_from_words, words

MEMBERS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.4:50051"]


@settings(max_examples=40, deadline=None)
@given(words, st.integers(1, 10))
def test_one_member_is_one_daemon(requests: list[list[int]], capacity_blocks: int) -> None:
    trace = trace_from_words(requests)
    for name in POLICIES:
        alone = simulate_pool(trace, name, MEMBERS[:1], capacity_blocks)
        single = simulate(trace, name, capacity_blocks)
        assert (alone.block_hits, alone.token_hits) == (single.block_hits, single.token_hits)


@settings(max_examples=40, deadline=None)
@given(words, st.integers(1, 6))
def test_a_pool_hits_no_more_than_it_could(requests: list[list[int]], per_member: int) -> None:
    trace = trace_from_words(requests)
    pool = simulate_pool(trace, "density", MEMBERS, per_member)
    assert pool.capacity_blocks == 4 * per_member
    # Guests are copies: the pool never holds more distinct blocks than its
    # total, so the optimum of that total bounds it, as it bounds one daemon.
    assert pool.block_hits <= belady(trace, pool.capacity_blocks).block_hits
    assert pool.block_hits <= unbounded(trace).block_hits


def test_owners_spread_over_the_members() -> None:
    trace = trace_from_words([[i % 3, i % 5, i] for i in range(400)])
    owners = owners_of(trace, MEMBERS, "replay")
    shares = [owners.count(i) / len(owners) for i in range(len(MEMBERS))]
    assert all(0.15 < share < 0.35 for share in shares), shares


def test_a_join_with_the_values_handed_on_loses_no_hit_where_nothing_is_evicted() -> None:
    """With room for every block, a pool joined by a fifth member that gets
    the values it owns hits after the join what the four hit without it;
    without the hand-off, a chain stops at its first key the joiner owns."""
    trace = trace_from_words([[i % 7, 100 + i % 11, 200 + i % 13, 300 + i] for i in range(300)])
    joiner, at, room = "10.0.0.5:50051", 150, 10_000
    kept = simulate_pool(trace, "density", MEMBERS, room, counted_from=at)
    joined = simulate_pool(trace, "density", MEMBERS, room, join=(at, joiner), counted_from=at)
    left = simulate_pool(
        trace, "density", MEMBERS, room, join=(at, joiner), hand_off=False, counted_from=at
    )
    assert joined.block_hits == kept.block_hits > 0
    assert left.block_hits < joined.block_hits
    with pytest.raises(SimError, match="joining is one already"):
        simulate_pool(trace, "lru", MEMBERS, 4, join=(1, MEMBERS[0]))


def test_a_leave_with_the_values_handed_on_loses_no_hit_where_nothing_is_evicted() -> None:
    """With room for every block, a member that hands what it owns to the
    others before it leaves costs no hit after; one that takes its values
    with it does (a chain stops at its first key only the leaver held)."""
    trace = trace_from_words([[i % 7, 100 + i % 11, 200 + i % 13, 300 + i] for i in range(300)])
    leaver, at, room = MEMBERS[3], 150, 10_000
    kept = simulate_pool(trace, "density", MEMBERS, room, counted_from=at)
    handed = simulate_pool(trace, "density", MEMBERS, room, leave=(at, leaver), counted_from=at)
    lost = simulate_pool(
        trace, "density", MEMBERS, room, leave=(at, leaver), leave_hand_off=False,
        counted_from=at,
    )  # fmt: skip
    assert handed.block_hits == kept.block_hits > 0
    assert lost.block_hits < handed.block_hits
    with pytest.raises(SimError, match="leaving is none of several"):
        simulate_pool(trace, "lru", MEMBERS, 4, leave=(1, "10.0.0.9:50051"))
    with pytest.raises(SimError, match="leaving is none of several"):
        simulate_pool(trace, "lru", MEMBERS[:1], 4, leave=(1, MEMBERS[0]))


def test_bad_parameters_are_refused() -> None:
    trace = trace_from_words([[1, 2], [1, 3]])
    with pytest.raises(SimError, match="unknown policy"):
        simulate_pool(trace, "nope", MEMBERS, 4)
    with pytest.raises(SimError, match="distinct"):
        simulate_pool(trace, "lru", [MEMBERS[0], MEMBERS[0]], 4)
    with pytest.raises(SimError, match="distinct"):
        simulate_pool(trace, "lru", [], 4)
    with pytest.raises(SimError, match="capacity"):
        simulate_pool(trace, "lru", MEMBERS, -1)


@pytest.fixture(scope="module")
def real_head() -> Trace:
    if not TRACE_PATH.exists():
        pytest.skip(f"conversation trace not present at {TRACE_PATH}")
    return head(load_trace(TRACE_PATH), 3000)


def test_four_members_of_lru_hit_about_what_one_daemon_does(real_head: Trace) -> None:
    """Rendezvous spreads LRU's recency evenly: four quarters hold what one
    whole does, within a few points (a check of the pool's semantics: a
    member that lost the head of a chain would show here as a gap)."""
    capacity = int(real_head.n_unique * 0.05) // 4 * 4
    pool = simulate_pool(real_head, "lru", MEMBERS, capacity // 4)
    single = simulate(real_head, "lru", capacity)
    assert pool.block_hit_ratio > 0.9 * single.block_hit_ratio, (pool, single)


def test_four_members_of_density_in_step_hit_what_one_daemon_does(real_head: Trace) -> None:
    """Members whose clocks move with every lookup of the pool and who keep
    blocks by one plan trim a chain's shares together; each on its own
    plan, the first to drop its block of a chain cuts it for all (on this
    head: 0.956x against 0.870x one daemon of the same total L1)."""
    capacity = int(real_head.n_unique * 0.05) // 4 * 4
    single = simulate(real_head, "density", capacity).block_hit_ratio
    in_step = simulate_pool(real_head, "density", MEMBERS, capacity // 4).block_hit_ratio
    apart = simulate_pool(
        real_head, "density", MEMBERS, capacity // 4, in_step=False
    ).block_hit_ratio
    assert in_step > 0.94 * single, (in_step, single)
    assert in_step > apart + 0.05 * single, (in_step, apart)
