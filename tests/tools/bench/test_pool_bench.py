"""``kvd bench pool`` at tiny sizes: every section runs against real
daemons, writes its JSON and markdown, and reads back the right bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvd.tools.bench import main, netns, pool, pool_tls

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def tiny_trace(path: Path, requests: int) -> Path:
    """Conversations that grow turn by turn: later requests share prefixes."""
    lines = []
    for i in range(requests):
        conversation, turn = i % 5, i // 5
        blocks = [conversation * 1000 + j for j in range(2 + turn)]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(blocks),
                                 "output_length": 10, "hash_ids": blocks}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_pool_bench_runs_every_section(tmp_path: Path) -> None:
    """In network namespaces where this is root (CI), else on loopback; one
    peer transport (each has its own tests; one pool of two per transport):
    the bulk port with TLS between the members, the last the bench offers."""
    out = tmp_path / "results"
    transport = pool.peer_transports()[-1]
    assert transport == pool_tls.BULK_TLS_TRANSPORT
    argv = [
        "--out", str(out), "pool", "--values", "2", "--value-bytes", "1MiB",
        "--chain-keys", "40", "--lookups", "5", "--lookup-pace-ms", "1", "--requests", "40",
        "--trace", str(tiny_trace(tmp_path / "trace.jsonl", 40)), "--capacity-fraction", "0.5",
        "--join-chains", "8",
    ]  # fmt: skip
    assert main([*argv, "--transports", transport] if transport else argv) == 0
    [raw] = out.glob("*-pool.json")
    result = json.loads(raw.read_text())
    assert raw.with_suffix(".md").read_text().startswith("| Target |")
    reason = netns.unavailable()
    assert result["where"] == (f"loopback: {reason}" if reason else "network namespaces")
    gets = result["remote_get"]
    assert [(g["transport_asked"], g["transport_used"]) for g in gets] == [(transport, transport)]
    assert all(g["wrong_bytes"] == 0 and g["misses"] == 0 and g["bytes_per_s"] > 0 for g in gets)
    assert all(g["batch_bytes_per_s"] > 0 and g["batch_values"] == pool.REMOTE_BATCH for g in gets)
    assert gets[0]["tcp_ceiling"]["bytes"] == 2 * 2**20
    chain = gets[0]["chain"]  # a remote chain, one at a time and in one batch
    assert chain["values"] == pool.CHAIN_VALUES and chain["misses"] == 0
    assert chain["batch_bytes_per_s"] > 0 and chain["one_at_a_time_bytes_per_s"] > 0
    assert "Remote chain of 64 values" in raw.with_suffix(".md").read_text()
    handed = gets[0]["handed_on"]  # puts through A of values B owns, read back from B
    assert handed["values"] == 2 and handed["misses"] == 0 and handed["bytes_per_s"] > 0
    assert handed["cpu_ms_per_value"]["owner"] >= 0
    assert "Puts through A of values B owns" in raw.with_suffix(".md").read_text()
    for side in ("pool", "single"):
        replayed = result["hit_ratio"][side]
        assert replayed["requests"] == 40 and replayed["wrong_blocks"] == 0
        assert replayed["block_hits"] > 0  # the conversations' prefixes come back
        assert replayed["lost_after_lookup"] == 0  # what a lookup found, the get read
    simulated = result["hit_ratio"]["simulated"]  # the simulator makes the daemon's decisions
    assert simulated["single"] == pytest.approx(
        result["hit_ratio"]["single"]["block_hit_ratio"], abs=0.01
    )
    assert 0 <= simulated["pool_apart"] <= 1
    assert "members not in step" in raw.with_suffix(".md").read_text()
    assert result["lookup"]["owners"] == pool.MEMBERS
    # The lookups with hints (the default) were answered from them; with the setting at 0 each asks.
    assert result["lookup"]["hinted_lookups"] > 0
    assert {"pool", "pool_asked", "single"} <= set(result["lookup"])
    # Again with each node on its own CPUs, where the machine has two or more.
    split = len(os.sched_getaffinity(0)) >= 2
    assert split == ({"pool_split", "pool_asked_split", "single_split"} <= set(result["lookup"]))
    if split:
        assert "each node on its own CPUs" in raw.with_suffix(".md").read_text()
    assert result["lookup"]["pace_ms"] == 1  # as a scheduler steps
    assert "members, lookups 1 ms apart" in raw.with_suffix(".md").read_text()
    assert result["keys_moved"]["moved_to_the_new_member"] == result["keys_moved"]["moved"]
    faults = result["faults"]["rows"]
    assert [f["fault"] for f in faults][-2:] == ["SIGSTOP", "SIGKILL, restarted"]
    assert all(f["wrong_bytes"] == 0 and f["errors"] == 0 and f["misses"] > 0 for f in faults)
    join = result["join"]  # a fifth member from etcd: every block found again
    assert "skipped" not in join, join
    assert join["values"] == 8 * 64 and join["wrong"] == 0 and join["misses"] == 0
    assert join["found_after_s"] is not None and 0 < join["handed_on"] < join["values"]
    handed, bare = join["leave"]  # the fifth member leaves with its hand-off, member 3 without
    assert handed["found_after"] == 1.0 and handed["misses"] == handed["wrong"] == 0
    assert handed["handed_on"] >= handed["owned"] > 0  # the join's values it owns go too
    assert bare["found_after"] < 1.0 and bare["misses"] == bare["owned"] > 0
    replay = result["join_replay"]  # the trace again, a fifth member joining halfway
    assert "skipped" not in replay, replay
    assert replay["join_at"] == 20 and replay["after"]["requests"] == 20
    assert replay["after"]["wrong_blocks"] == 0 and replay["after"]["block_hits"] > 0
    assert replay["handed_on"] > 0 and replay["histories_taken"] > 0
    assert set(replay["simulated"]) == {"join", "join_without_histories", "no_join"}
    assert "with a join at request 20" in raw.with_suffix(".md").read_text()
    leave = result["leave_replay"]  # the fifth of five leaving halfway, its values handed on
    assert "skipped" not in leave, leave
    assert leave["leave_at"] == 20 and leave["after"]["requests"] == 20
    assert leave["after"]["wrong_blocks"] == 0 and leave["after"]["block_hits"] > 0
    assert "handed_on=" in leave["hand_off_log"]
    assert {"leave", "leave_without_hand_off", "no_leave"} <= set(leave["simulated"])
    assert "with a leave (hand-off) at request 20" in raw.with_suffix(".md").read_text()
    # Two lookup rows (four with the CPUs split), a join, a leave, a join
    # replay, a leave replay.
    lookups = 4 if split else 2
    assert len(result["targets"]) == 2 * len(gets) + 6 + lookups + len(faults)


def test_a_negative_lookup_pace_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["pool", "--lookup-pace-ms", "-1"])
    assert refused.value.code == 2
    assert "--lookup-pace-ms must be 0 or more, got -1" in capsys.readouterr().err
