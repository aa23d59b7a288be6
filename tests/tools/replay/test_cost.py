"""A policy's CPU cost per block reference (kvd.tools.replay.cost): the
recorded calls replay into a fresh policy with the same decisions."""

from __future__ import annotations

import dataclasses

import pytest

from kvd.store.eviction.policy import make_policy
from kvd.tools.replay import workloads
from kvd.tools.replay.cost import CallLog, CostError, _replay, measure
from kvd.tools.replay.report import head
from kvd.tools.replay.sim import capacity_for, simulate


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "density"])
def test_measure_replays_the_recorded_calls(policy: str) -> None:
    trace = head(workloads.generate("bursts"), 800)
    capacity = capacity_for(trace, 0.05)
    result, spent = measure(trace, policy, capacity, repeats=2)
    alone = simulate(trace, policy, capacity)
    assert result == dataclasses.replace(alone, elapsed_s=result.elapsed_s)
    assert result.evictions > 0
    # every call the simulator made: one on_lookup a request at least
    assert spent.calls > len(trace) and spent.block_refs == trace.n_refs
    assert spent.cpu_s > 0.0 and spent.wall_s > 0.0
    assert spent.cpu_us_per_ref == pytest.approx(1e6 * spent.cpu_s / trace.n_refs)


def test_a_replay_that_decides_otherwise_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = head(workloads.generate("bursts"), 800)
    capacity = capacity_for(trace, 0.05)
    logs: list[CallLog] = []

    def record(inner: object) -> CallLog:
        logs.append(CallLog(inner))  # type: ignore[arg-type]
        return logs[-1]

    simulate(trace, "density", capacity, wrap=record)  # type: ignore[arg-type]
    # the same calls into another policy choose other victims
    _, _, chosen = _replay(make_policy("lru"), logs[0])
    _, _, again = _replay(make_policy("density"), logs[0])
    assert chosen != again
    monkeypatch.setattr("kvd.tools.replay.cost.make_policy", lambda name: make_policy("lru"))
    with pytest.raises(CostError, match="other victims"):
        measure(trace, "density", capacity, repeats=1)


def test_call_log_needs_a_set_to_copy_the_pins() -> None:
    log = CallLog(make_policy("lru"))
    log.insert(1, None)
    assert log.victim(set().__contains__) == 1
    with pytest.raises(TypeError, match=r"a_set\.__contains__"):
        log.victim(lambda key: False)
    with pytest.raises(ValueError, match="repeats"):
        measure(head(workloads.generate("bursts"), 10), "lru", 10, repeats=0)
