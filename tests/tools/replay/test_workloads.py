"""Synthetic workloads (kvd.tools.replay.workloads): valid traces, seeded, of the
shapes they are named for."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvd.tools.replay import workloads
from kvd.tools.replay.trace import Trace, load_trace


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    return {name: workloads.generate(name) for name in workloads.WORKLOADS}


def test_tuning_and_held_out_split_every_workload() -> None:
    assert set(workloads.TUNING).isdisjoint(workloads.HELD_OUT)
    assert set(workloads.TUNING) | set(workloads.HELD_OUT) == set(workloads.WORKLOADS)
    with pytest.raises(workloads.WorkloadError, match="unknown workload"):
        workloads.records("nope")


def test_seeded_and_written_in_the_trace_format(tmp_path: Path) -> None:
    assert workloads.lines("agents", 3) == workloads.lines("agents", 3)
    assert workloads.lines("agents", 3) != workloads.lines("agents", 4)
    path = tmp_path / "agents.jsonl"
    count = workloads.write("agents", path, 3)
    trace = load_trace(path)  # validates ids, parents and lengths
    assert len(trace) == count and trace.n_refs == workloads.generate("agents", 3).n_refs


def test_sizes_keep_a_replay_bounded(traces: dict[str, Trace]) -> None:
    for name, trace in traces.items():
        assert 5_000 <= len(trace) <= 20_000, name
        assert 100_000 <= trace.n_refs <= 600_000, name
        assert trace.n_unique < trace.n_refs, name  # something is re-read


def heads(trace: Trace) -> Counter[int]:
    return Counter(int(trace.chain(i)[0]) for i in range(len(trace)))


def test_shared_prompts_share_a_few_heads(traces: dict[str, Trace]) -> None:
    counts = heads(traces["shared-prompts"])
    assert len(counts) == 6
    assert counts.most_common(1)[0][1] > 0.3 * len(traces["shared-prompts"])


def test_documents_are_re_read_by_many_questions(traces: dict[str, Trace]) -> None:
    trace = traces["documents"]
    # Block 2 of each chain is its document's first block (after the 2-block
    # instruction): the popular ones are read by hundreds of questions.
    firsts = Counter(int(trace.chain(i)[2]) for i in range(len(trace)))
    assert 500 <= len(firsts) <= 2000
    assert firsts.most_common(1)[0][1] >= 100


def test_agent_prompts_grow_by_a_little_each_turn(traces: dict[str, Trace]) -> None:
    trace = traces["agents"]
    last_of: dict[int, tuple[int, int]] = {}  # block -> (chain length, request)
    grown = []
    for i in range(len(trace)):
        chain = trace.chain(i).tolist()
        for length in range(len(chain) - 1, 0, -1):
            earlier = last_of.get(chain[length - 1])
            if earlier is not None and earlier[0] == length + 1:
                grown.append(len(chain) - earlier[0])
                break
        last_of[chain[-2] if len(chain) > 1 else chain[-1]] = (len(chain), i)
    assert len(grown) > 0.7 * len(trace)
    assert 0 <= float(np.median(grown)) <= 3


def test_bursts_are_one_shot_and_long(traces: dict[str, Trace]) -> None:
    trace = traces["bursts"]
    refs = np.bincount(trace.blocks, minlength=trace.n_unique)
    chain_heads = heads(trace)
    one_shot = [i for i in range(len(trace)) if chain_heads[int(trace.chain(i)[0])] == 1]
    assert len(one_shot) > 1000
    for i in one_shot:
        chain = trace.chain(i)
        assert len(chain) >= 16 and int(refs[chain].max()) == 1


def test_diurnal_mix_has_a_night_and_a_peak(traces: dict[str, Trace]) -> None:
    stamps_s = traces["diurnal-mix"].timestamps_ms / 1000.0
    span_s = 2 * 3600
    night = np.count_nonzero(stamps_s < span_s / 8) + np.count_nonzero(stamps_s > 7 * span_s / 8)
    peak = np.count_nonzero(np.abs(stamps_s - span_s / 2) < span_s / 8)
    assert peak > 2.5 * night
