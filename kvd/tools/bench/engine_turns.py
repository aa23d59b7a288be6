"""Multi-turn conversations through two real vLLM engines (``kvd bench engine``).

Requests come from a conversation trace (the Mooncake format of
``../shared/traces/``: each request lists its prefix blocks, equal ids for
equal prefixes), scaled to this CPU: a trace block becomes one 128-token
engine block of token ids derived from the block id, prompts are cut to
``BLOCKS_MAX`` blocks, and ``requests`` requests of the trace's first
conversations (``conversations``) are played in trace order, alternately on
two engine processes, so a conversation's next turn often lands on the
other engine; engine B is restarted halfway.
Three configurations, each from fresh engines:

- **recompute**: vLLM alone, its prefix cache off;
- **vllm prefix cache**: vLLM alone, prefix cache on (each engine its own;
  a restart loses it);
- **kvd**: vLLM's prefix cache on and kvd's connector, both engines on one
  daemon.

Per configuration: mean and p99 TTFT, and for kvd the share of prompt
blocks the daemon served.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.bench.engine_proc import EngineEnv, VllmProcess

BLOCK_TOKENS = 128
BLOCKS_MAX = 16  # 2,048-token prompts at most: ~15 s of recompute each on 2 CPUs
TAIL_TOKENS = 40  # the partial last block every request computes
REQUESTS = 24
CONFIGS = ("recompute", "vllm_prefix_cache", "kvd")

Progress = Callable[[str], None]


@dataclass
class TurnsRow:
    config: str
    requests: int
    ttft_mean_s: float
    ttft_p99_s: float
    kvd_block_hit_ratio: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def conversations(trace: Path, requests: int) -> list[list[int]]:
    """The block ids of at least ``requests`` requests (the first ones are
    kept) from the trace's first conversations of two turns or more, in
    trace order.

    A request belongs to the conversation of the first request that shares
    its first two blocks (the first block alone is a system prompt every
    request shares). The trace's first requests mostly start conversations
    whose next turns come thousands of requests later; played in plain
    order, 12 of them shared 1.2 % of their blocks.
    """
    rows: list[list[int]] = []
    members: dict[tuple[int, int], list[int]] = {}
    with trace.open() as lines:
        for line in lines:
            blocks = [int(block) for block in json.loads(line)["hash_ids"]]
            rows.append(blocks)
            if len(blocks) >= 2:
                members.setdefault((blocks[0], blocks[1]), []).append(len(rows) - 1)
    chosen: list[int] = []
    for turns in members.values():  # in order of each conversation's first turn
        if len(turns) > 1 and len(chosen) < requests:
            chosen += turns
    return [rows[i] for i in sorted(chosen)[:requests]]


def trace_prompts(trace: Path, requests: int) -> list[list[int]]:
    """``requests`` requests of ``trace``'s conversations as token ids."""
    prompts: list[list[int]] = []
    for blocks in conversations(trace, requests):
        ids = [t for block in blocks[:BLOCKS_MAX] for t in _block_tokens(block)]
        prompts.append(ids + _block_tokens(-len(prompts) - 1)[:TAIL_TOKENS])
    return prompts


def _block_tokens(block: int) -> list[int]:
    return [100 + (block * 104_729 + i * 7919) % 40_000 for i in range(BLOCK_TOKENS)]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _play(
    env: EngineEnv,
    logs: Path,
    config: str,
    prompts: list[list[int]],
    kvd_url: str,
    progress: Progress,
) -> list[float]:
    options: dict[str, Any] = {
        "prefix_caching": config != "recompute",
        "kvd_url": kvd_url if config == "kvd" else "",
    }
    engines = [VllmProcess(env, logs / f"{config}-a.log", **options),
               VllmProcess(env, logs / f"{config}-b.log", **options)]  # fmt: skip
    times = []
    try:
        for i, ids in enumerate(prompts):
            if i == len(prompts) // 2:  # engine B restarts: its own cache is gone
                engines[1].stop()
                engines[1] = VllmProcess(env, logs / f"{config}-b2.log", **options)
            answer = engines[i % 2].generate([ids], max_tokens=1)
            times.append(float(answer["wall_s"]))
        progress(f"engine turns: {config}: mean TTFT {statistics.mean(times):.3f} s")
    finally:
        for engine in engines:
            engine.stop()
    return times


def run(
    env: EngineEnv, trace: Path, logs: Path, requests: int = REQUESTS, progress: Progress = print
) -> list[TurnsRow]:
    prompts = trace_prompts(trace, requests)
    blocks = sum(len(ids) // BLOCK_TOKENS for ids in prompts)
    rows = []
    for config in CONFIGS:
        workdir = logs / f"turns-{config}"
        workdir.mkdir()
        daemon = SpawnedDaemon(
            workdir, [], dram="4GiB", max_value="32MiB", ssd="4GiB", segment="256MiB"
        )
        try:
            times = _play(env, logs, config, prompts, f"kvd://{daemon.socket}", progress)
            with Client(daemon.target, timeout_s=30) as client:
                hits = int(client.stats().get("hits", 0))
        finally:
            daemon.stop()
        ratio = round(hits / blocks, 4) if config == "kvd" else None
        rows.append(TurnsRow(config, len(times), statistics.mean(times), _p99(times), ratio))
    return rows


def markdown(rows: list[TurnsRow]) -> str:
    lines = [
        "| configuration | requests | mean TTFT s | p99 TTFT s | kvd block hits |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row.kvd_block_hit_ratio:.1%}" if row.kvd_block_hit_ratio is not None else "-"
        lines.append(
            f"| {row.config} | {row.requests} | {row.ttft_mean_s:.3f} | {row.ttft_p99_s:.3f} "
            f"| {ratio} |"
        )
    return "\n".join(lines)
