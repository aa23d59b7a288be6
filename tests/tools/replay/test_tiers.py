"""Two-tier replay (kvd.tools.replay.tiers) and the workload suite (kvd.tools.replay.suite)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvd.tools.replay import suite, workloads
from kvd.tools.replay.report import head
from kvd.tools.replay.sim import SimError, capacity_for, simulate, unbounded
from kvd.tools.replay.tiers import simulate_tiers
from kvd.tools.replay.trace import Trace, parse_trace


def make_trace(chains: list[list[int]]) -> Trace:
    return parse_trace(
        json.dumps({"timestamp": i, "input_length": 512 * len(ids) - 1, "output_length": 1,
                    "hash_ids": ids})
        for i, ids in enumerate(chains)
    )  # fmt: skip


# a-b-c, x-y-z (L1 of 3 evicts a-b-c), a-b-c again
AGAIN = [[1, 2, 3], [7, 8, 9], [1, 2, 3]]


def test_l2_serves_what_l1_evicted() -> None:
    result = simulate_tiers(make_trace(AGAIN), "lru", 3, 30)
    assert (result.l1_hits, result.l2_hits) == (0, 3)
    assert result.l2_writes == 6 and result.lost == 0
    assert result.l1_share == 0.0 and result.block_hit_ratio == pytest.approx(3 / 9)


def test_written_only_if_used_twice() -> None:
    result = simulate_tiers(make_trace(AGAIN), "lru", 3, 30, admit="twice")
    # a-b-c was seen once when L1 evicted it: never written, so lost (and
    # x-y-z when a-b-c came back); a-b-c is written on its second request.
    assert (result.l1_hits, result.l2_hits, result.l2_writes) == (0, 0, 3)
    assert result.lost == 6
    with pytest.raises(SimError, match="admission"):
        simulate_tiers(make_trace(AGAIN), "lru", 3, 30, admit="sometimes")


def test_reclaim_writes_again_a_block_still_in_l1() -> None:
    # L1 of 2, L2 of 3, as the daemon reclaims: block 1 is hot in L1 when
    # writing 4 reclaims its L2 copy, so it is written again (2 goes
    # instead); L1 evicts it for 5, and the last request finds it on L2.
    chains = [[1], [2], [1], [3], [1], [4], [5], [1]]
    kept = simulate_tiers(make_trace(chains), "lru", 2, 3, reinsert=True)
    dropped = simulate_tiers(make_trace(chains), "lru", 2, 3, reinsert=False)
    assert (kept.l2_reinserts, dropped.l2_reinserts) == (1, 0)
    assert (kept.l1_hits, kept.l2_hits) == (2, 1)
    assert (dropped.l1_hits, dropped.l2_hits) == (2, 0)
    assert (kept.lost, dropped.lost) == (0, 1)  # 1 left L1 with no copy on L2


def test_reclaim_ends_when_every_block_is_still_in_l1() -> None:
    # L2 of 2 behind an L1 of 4: each reclaim meets only blocks still in L1;
    # each goes round once and then the oldest is dropped.
    result = simulate_tiers(make_trace([[1], [2], [3], [4]]), "lru", 4, 2, reinsert=True)
    assert result.l2_writes == 4 + result.l2_reinserts and result.l2_reinserts == 4


@pytest.fixture(scope="module")
def documents() -> Trace:
    return head(workloads.generate("documents"), 1500)


@pytest.mark.parametrize("policy", ["lru", "density"])
def test_without_l2_the_tiers_are_the_l1_simulator(documents: Trace, policy: str) -> None:
    capacity = capacity_for(documents, 0.1)
    alone = simulate(documents, policy, capacity)
    tiers = simulate_tiers(documents, policy, capacity, 0)
    assert tiers.l1_hits == alone.block_hits and tiers.l2_hits == 0


def test_an_l2_that_holds_everything_reaches_the_unbounded_cache(documents: Trace) -> None:
    capacity = capacity_for(documents, 0.1)
    result = simulate_tiers(documents, "density", capacity, documents.n_unique)
    assert result.l1_hits + result.l2_hits == unbounded(documents).block_hits
    assert 0.0 < result.l1_share < 1.0


def test_suite_reports_every_policy_next_to_belady(
    documents: Trace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(suite.workloads, "generate", lambda name, seed: documents)
    rows = suite.run("documents,bursts", policies=("lru", "density"), fractions=(0.05,))
    assert [(r.workload, r.policy) for r in rows] == [
        ("documents", "lru"), ("documents", "density"), ("documents", "belady"),
        ("bursts", "lru"), ("bursts", "density"), ("bursts", "belady"),
    ]  # fmt: skip
    by_policy = {(r.workload, r.policy): r for r in rows}
    assert by_policy["bursts", "density"].held_out
    best = by_policy["documents", "belady"].block_hit_ratio
    assert by_policy["documents", "lru"].block_hit_ratio <= best
    assert by_policy["documents", "density"].policy_us_per_ref > 0.0
    table = suite.markdown(rows, default="density")
    assert "| documents | tuning |" in table and "| bursts | held-out |" in table
    assert "density / belady" in table and "µs per block reference" in table
    tiers = suite.run_tiers("documents", None, fraction=0.05, ratios=(10,))
    assert len(tiers) == 5  # `all` with and without reinsertion, three other rules
    assert "| documents | 10 | twice | yes |" in suite.tiers_markdown(tiers)
    with pytest.raises(workloads.WorkloadError, match="unknown workload"):
        suite.workload_names("nope")


def test_written_when_l1_evicts_it() -> None:
    # write-back: a-b-c is written when x-y-z evicts it, and x-y-z when a-b-c
    # comes back; the last a-b-c is served from L2 and promoted, not rewritten
    result = simulate_tiers(make_trace(AGAIN), "lru", 3, 30, admit="evict")
    assert (result.l1_hits, result.l2_hits, result.l2_writes, result.lost) == (0, 3, 6, 0)


def test_written_on_eviction_only_if_expected_back(documents: Trace) -> None:
    capacity = capacity_for(documents, 0.01)
    every = simulate_tiers(documents, "density", capacity, 10 * capacity, admit="evict")
    none = simulate_tiers(
        documents, "density", capacity, 10 * capacity, admit="expect", expect_min=1.01
    )
    some = simulate_tiers(documents, "density", capacity, 10 * capacity, admit="expect")
    # blocks evicted before the first plan count as expected (nothing learned)
    assert none.l2_writes < some.l2_writes < every.l2_writes
    assert none.l2_hits < some.l2_hits
    assert none.lost > some.lost > every.lost == 0
