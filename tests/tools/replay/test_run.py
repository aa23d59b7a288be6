"""Replay against a real daemon (kvd.tools.replay.run): same hits as the simulator,
every byte verified; the bench report's pieces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvd.store.eviction.policy import DEFAULT_POLICY
from kvd.tools.replay import load_trace, simulate, workloads
from kvd.tools.replay.report import head, markdown, references, store_calls_on_lookup
from kvd.tools.replay.run import (
    block_value,
    capacity_of,
    dram_bytes_for,
    modeled_ttft,
    pages_per_block,
    replay,
    start_l1_daemon,
)
from kvd.tools.replay.trace import Trace

TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
REQUESTS = 500
# 3000 blocks is a quarter of the 11,879 unique blocks of the first 500
# requests: evictions start after ~200 requests and LRU hits 782 blocks.
CAPACITY_BLOCKS = 3000
BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def first_requests() -> Trace:
    if not TRACE.exists():
        pytest.skip("the conversation trace is not on this machine")
    return head(load_trace(TRACE), REQUESTS)


def test_block_values_differ_per_block_and_fill_the_size() -> None:
    assert len(block_value(7, 100)) == 100
    assert block_value(7, 64) != block_value(8, 64)
    assert block_value(1 << 40, 16)[:8] != block_value(0, 16)[:8]


def test_capacity_is_whole_blocks_of_pages() -> None:
    assert pages_per_block(1) == 1
    assert pages_per_block(65_537) == 2
    assert capacity_of(dram_bytes_for(3000, 4096), 4096) == 3000
    assert capacity_of(dram_bytes_for(10, 23_592_960), 23_592_960) == 10
    assert capacity_of(dram_bytes_for(1, 1), 1) == 16  # the daemon's 1 MiB minimum


@pytest.mark.parametrize("policy", ["lru", "pred", "hazard", "s3fifo", "density"])
def test_daemon_replay_equals_simulator(tmp_path: Path, first_requests: Trace, policy: str) -> None:
    dram_bytes = dram_bytes_for(CAPACITY_BLOCKS, BLOCK_BYTES)
    daemon = start_l1_daemon(tmp_path, dram_bytes, BLOCK_BYTES, ["--eviction-policy", policy])
    try:
        stats = replay(daemon.target, first_requests, block_bytes=BLOCK_BYTES)
    finally:
        daemon.stop()
    expected = simulate(
        first_requests, policy, CAPACITY_BLOCKS, lookup_hook=store_calls_on_lookup()
    )
    assert stats.requests == REQUESTS
    assert stats.block_refs == expected.block_refs
    assert stats.block_hits == expected.block_hits
    assert stats.token_hits == expected.token_hits
    assert stats.l2_hits == 0 and stats.l1_hits == stats.block_hits
    assert stats.wrong_blocks == 0 and stats.lost_after_lookup == 0
    assert stats.bytes_got == stats.block_hits * BLOCK_BYTES
    assert stats.blocks_put == expected.block_refs - expected.block_hits


def test_report_of_a_replay(first_requests: Trace, tmp_path: Path) -> None:
    daemon = start_l1_daemon(tmp_path, dram_bytes_for(CAPACITY_BLOCKS, 1024), 1024)
    try:
        stats = replay(daemon.target, head(first_requests, 100), block_bytes=1024, clients=4)
    finally:
        daemon.stop()
    assert stats.requests == 100 and stats.wrong_blocks == 0
    model = modeled_ttft(first_requests, stats, 1000.0, 100)
    assert model["ttft_mean_with_kvd_s"] <= model["ttft_mean_without_kvd_s"]
    refs = references(first_requests, CAPACITY_BLOCKS, "pred")
    assert refs["belady"]["block_hit_ratio"] <= refs["unbounded"]["block_hit_ratio"]
    assert refs["lru (simulated)"]["block_hit_ratio"] <= refs["belady"]["block_hit_ratio"]
    report = {
        "trace": "t", "references": refs, "model": model,
        "run": {"requests": 100, "clients": 4, "speed": 0, "block_bytes": 1024, "scale": 2.0,
                "model": "m", "capacity_blocks": 3000, "capacity_fraction": 0.25,
                "unique_blocks": 12000, "policy": "pred"},
        "daemon": {"block_hit_ratio": 0.1, "token_hit_ratio": 0.1, "l1_block_hit_ratio": 0.1,
                   "l2_block_hit_ratio": 0.0},
        "latency_ms": {"lookup": stats.lookup.percentiles_ms()},
        "moved": {"requests_per_s": 1.0, "bytes_got": stats.bytes_got, "bytes_put": 1,
                  "wrong_blocks": 0, "lost_after_lookup": 0},
    }  # fmt: skip
    text = markdown(report)
    assert "| belady |" in text and "| lookup | 100 |" in text


def test_malformed_trace_line_is_named(tmp_path: Path) -> None:
    from kvd.tools.replay.trace import TraceError

    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path.write_text(good + "\n" + '{"timestamp": 1, "input_length": 10}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl: line 2: missing field 'output_length'"):
        load_trace(path)


@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_daemon_replay_equals_simulator_on_every_workload(tmp_path: Path, name: str) -> None:
    trace = head(workloads.generate(name), 400)
    unique = len(set(trace.blocks.tolist()))
    capacity = unique // 5  # evictions from about the 100th request on
    daemon = start_l1_daemon(
        tmp_path, dram_bytes_for(capacity, BLOCK_BYTES), BLOCK_BYTES,
        ["--eviction-policy", DEFAULT_POLICY],
    )  # fmt: skip
    try:
        stats = replay(daemon.target, trace, block_bytes=BLOCK_BYTES)
    finally:
        daemon.stop()
    expected = simulate(trace, DEFAULT_POLICY, capacity, lookup_hook=store_calls_on_lookup())
    assert expected.evictions > 0
    assert (stats.block_hits, stats.token_hits) == (expected.block_hits, expected.token_hits)
    assert stats.wrong_blocks == 0 and stats.lost_after_lookup == 0


@pytest.mark.parametrize("policy", ["lru", "density"])
def test_daemon_replay_equals_simulator_when_a_chain_is_longer_than_l1(
    tmp_path: Path, policy: str
) -> None:
    trace = head(workloads.generate("agents"), 300)  # chains of up to 58 blocks
    capacity = 44
    daemon = start_l1_daemon(
        tmp_path, dram_bytes_for(capacity, BLOCK_BYTES), BLOCK_BYTES, ["--eviction-policy", policy]
    )
    try:
        stats = replay(daemon.target, trace, block_bytes=BLOCK_BYTES)
    finally:
        daemon.stop()
    expected = simulate(trace, policy, capacity, lookup_hook=store_calls_on_lookup())
    assert int(np.diff(trace.offsets).max()) > capacity
    assert (stats.block_hits, stats.token_hits) == (expected.block_hits, expected.token_hits)
    assert stats.wrong_blocks == 0 and stats.lost_after_lookup == 0
