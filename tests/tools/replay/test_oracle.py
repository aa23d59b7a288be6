"""The popularity-aware bound on ``documents`` (kvd.tools.replay.oracle): its
hazard model is the generator's, its replay the simulator's, and it sits
between LRU and the offline optimum."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from kvd.tools.replay import oracle, sim, workloads


def test_the_follow_up_hazard_gives_the_follow_up_chance() -> None:
    # Survival past every think time is 1 - p: exp(-integral of the hazard).
    ages = np.logspace(-3, 8, 400_000)
    hazard = oracle.follow_up_hazard(ages, 0.3)
    integral = float(np.sum((hazard[1:] + hazard[:-1]) / 2 * np.diff(ages)))
    assert math.exp(-integral) == pytest.approx(0.7, abs=1e-3)
    # It peaks near the median think time and is 0-ish for fresh questions.
    assert float(oracle.follow_up_hazard(np.array([0.001]), 0.3)[0]) < 1e-12


def test_the_draw_is_the_workload_s_own() -> None:
    records, draw = workloads.documents_drawn(workloads.SEED_DEFAULT)
    assert records == workloads.records("documents")
    assert len(draw.session_of) == len(records)
    turns = Counter(draw.session_of)
    follow_ups = sum(1 for n in turns.values() if n == 2)
    assert set(turns.values()) == {1, 2}
    assert 0.25 < follow_ups / len(turns) < 0.35  # the follow-up chance, 0.3
    # Every chain starts with the instruction, then one document's blocks
    # (all of them, unless the prompt reached its 64k-token cap).
    first_block = {ids[0]: ids for ids in draw.doc_ids}
    for record in records:
        chain = list(record["hash_ids"])  # type: ignore[call-overload]
        assert chain[:2] == draw.instruction_ids
        ids = first_block[chain[2]]
        assert chain[2 : 2 + len(ids)] == ids[: len(chain) - 2]
    assert len(draw.ranks) == 4  # an hour of 15-minute epochs


def test_the_bound_replays_as_the_simulator_does() -> None:
    trace = workloads.generate("documents")
    # Room for everything: every policy hits what a cache that never evicts does.
    whole = oracle.popularity_bound(1.0)
    unbounded = sim.unbounded(trace)
    assert (whole.block_hits, whole.block_refs) == (unbounded.block_hits, trace.n_refs)
    capacity = sim.capacity_for(trace, 0.10)
    told = oracle.popularity_bound(0.10)
    estimated = oracle.popularity_bound(0.10, half_life_s=70.0)
    assert told.capacity_blocks == estimated.capacity_blocks == capacity
    lru = sim.simulate(trace, "lru", capacity).block_hit_ratio
    belady = sim.belady(trace, capacity).block_hit_ratio
    assert lru < estimated.block_hit_ratio < told.block_hit_ratio < belady
    with pytest.raises(ValueError, match="fraction"):
        oracle.popularity_bound(0.0)
