"""``kvd bench engine``'s report: ratios from one run's figures, skipped
peers named with their reason, and a flag when a restore's first token
differs from recompute. (The suite itself runs real engines: `kvd bench
engine`; tests/engines covers the same engine paths.)"""

from __future__ import annotations

import json
from pathlib import Path

from kvd.tools.bench import engine_turns
from kvd.tools.bench.engine import EngineRow, markdown, prompt, root_cause


def test_ratios_come_from_the_same_row() -> None:
    row = EngineRow(2048, ttft_s={"recompute": 16.0, "prefix_hit": 1.0, "kvd_l1": 1.2,
                                  "kvd_l2": 1.5})  # fmt: skip
    ratios = row.as_dict()["ratios"]
    assert ratios["kvd_l1_over_prefix_hit"] == 1.2
    assert ratios["recompute_over_kvd_l1"] == 13.333
    assert ratios["kvd_l2_over_kvd_l1"] == 1.25
    assert ratios["vllm_offload_over_prefix_hit"] is None  # not measured: no ratio


def test_the_table_names_skipped_peers_and_unequal_tokens() -> None:
    row = EngineRow(1024, ttft_s={"recompute": 5.0, "prefix_hit": 0.5, "kvd_l1": 0.6})
    row.skipped["vllm_offload"] = "RuntimeError: no CPU support"
    row.equal_tokens = {"prefix_hit": True, "kvd_l1": False}
    table = markdown([row])
    assert "| 1024 | 5.000 | 0.500 | 0.600 | skipped | skipped | 1.20 | 8.33 | - |" in table
    assert "vllm_offload: skipped: RuntimeError: no CPU support" in table
    assert "NOT for kvd_l1" in table


def test_prompts_of_different_sizes_share_no_block() -> None:
    small, large = prompt(1024, 1), prompt(2048, 1)
    assert len(small) == 1024 and len(large) == 2048
    assert small[:128] != large[:128]


def test_trace_requests_become_prompts_that_share_their_prefix_blocks(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"hash_ids": [0, 1, 2]},
        {"hash_ids": [0, 9]},  # one turn only: left out
        {"hash_ids": [0, 5, 6]},
        {"hash_ids": [0, 1, 2, 3]},
        {"hash_ids": [0, 5, 6, 7]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert engine_turns.conversations(trace, 3) == [[0, 1, 2], [0, 5, 6], [0, 1, 2, 3]]
    first, second, third = engine_turns.trace_prompts(trace, 3)
    block = engine_turns.BLOCK_TOKENS
    assert len(first) == 3 * block + engine_turns.TAIL_TOKENS
    assert third[: 3 * block] == first[: 3 * block]  # the turn extends the last
    assert second[:block] == first[:block] and second[block : 2 * block] != first[block : 2 * block]
    assert first[3 * block :] != third[3 * block : 3 * block + engine_turns.TAIL_TOKENS]


def test_the_turns_table() -> None:
    rows = [engine_turns.TurnsRow("recompute", 24, 5.0, 9.0, None),
            engine_turns.TurnsRow("kvd", 24, 1.5, 4.0, 0.4567)]  # fmt: skip
    table = engine_turns.markdown(rows)
    assert "| recompute | 24 | 5.000 | 9.000 | - |" in table
    assert "| kvd | 24 | 1.500 | 4.000 | 45.7% |" in table


def test_a_skipped_peer_is_named_by_its_root_cause_not_by_vllms_see_above() -> None:
    log = """engine exited with 1:
RuntimeError: Worker failed with error 'CPU Offloading is only on CUDA'
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
resource_tracker: There appear to be 1 leaked shared_memory objects"""
    assert root_cause(log) == (
        "RuntimeError: Worker failed with error 'CPU Offloading is only on CUDA'"
    )
