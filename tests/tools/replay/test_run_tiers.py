"""``kvd bench replay --l2-ratio``: the started daemon has an L2 as well;
every byte comes back right through both tiers; with ``l2_admission = all``
every block put is written to L2, with ``twice`` fewer (the held-back ones
the daemon counts); the report puts the daemon next to the two-tier
simulation of the same sizes and rule."""

from __future__ import annotations

import argparse

import pytest

from kvd.tools.replay.report import add_arguments, markdown, run_bench
from kvd.tools.replay.run import L2_SEGMENT_BYTES, L2_SEGMENTS_MIN, l2_layout

REQUESTS = 300


def _args(admission: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--workload", "documents", "--requests", str(REQUESTS), "--block-bytes", "4096",
        "--capacity-fraction", "0.05", "--l2-ratio", "4", "--l2-admission", admission,
        "--prefill-tokens-per-s", "1000",
    ])  # fmt: skip


def test_an_l2_holds_whole_segments_of_records() -> None:
    small = l2_layout(10, 4096)  # 4 KiB header + 4 KiB: one 64 KiB record a block
    per_segment = L2_SEGMENT_BYTES // (64 << 10) - 1  # less the segment's marker
    assert small.ssd_bytes == L2_SEGMENTS_MIN * L2_SEGMENT_BYTES
    assert small.blocks == L2_SEGMENTS_MIN * per_segment
    large = l2_layout(20 * per_segment + 1, 61_440)  # exactly one record
    assert large.blocks == 21 * per_segment and large.ssd_bytes == 21 * L2_SEGMENT_BYTES


@pytest.mark.parametrize("admission", ["all", "twice"])
def test_a_replay_through_two_tiers(admission: str) -> None:
    report, text = run_bench(_args(admission), lambda line: None)
    moved, tiers = report["moved"], report["tiers"]
    daemon, simulated = tiers["daemon"], tiers["simulator"]
    assert report["run"]["requests"] == REQUESTS
    assert moved["wrong_blocks"] == 0 and moved["lost_after_lookup"] == 0
    assert daemon["l1_dropped_unwritten"] == 0  # write-back kept up: nothing lost unwritten
    assert report["daemon"]["l2_block_hit_ratio"] > 0  # L2 served some of the hits
    assert 0 < daemon["block_hit_ratio"] <= report["references"]["unbounded"]["block_hit_ratio"]
    assert simulated["l2_blocks"] == tiers["l2_blocks"] and simulated["admit"] == admission
    first_writes = daemon["l2_writes"] - daemon["l2_rewrites"]
    if admission == "all":
        assert daemon["l2_held_back"] == 0
        assert 0.9 * moved["blocks_put"] <= first_writes <= moved["blocks_put"]
    else:
        assert daemon["l2_held_back"] > 0
        assert daemon["l2_never_written"] + daemon["l2_admitted"] <= daemon["l2_held_back"]
        assert 0 < first_writes < moved["blocks_put"] - daemon["l2_never_written"] + 1
    assert f"admission `{admission}`" in text and "| simulator |" in text
    assert markdown(report) == text
