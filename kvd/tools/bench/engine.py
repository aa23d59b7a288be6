"""``kvd bench engine``: time to first token through a real vLLM.

Each figure comes from vLLM's CPU build on this machine, in one run, for
prompts of each size (tokens):

- **recompute**: a prompt no cache holds (vLLM with its own prefix cache on,
  first sight of the prompt);
- **prefix hit**: the same engine, the same prompt again: vLLM's in-memory
  prefix-cache hit, the physical limit (the KV already sits in the engine);
- **kvd L1**: a fresh engine process restores the prompt a first engine
  stored in kvd (the daemon's DRAM);
- **kvd L2**: the same fresh engine, first request after the daemon
  restarted (the SSD tier);
- **vLLM offload**: vLLM's native CPU offloading (``OffloadingConnector``),
  the same engine after its own prefix cache was reset, the peer a vLLM user
  would pick instead; LMCache, the other peer, is reported with the reason it
  does not run here.

A restore is timed ``REPEATS`` times and the median kept (each request of a
prompt restores it again: vLLM's prefix cache is off in kvd's engines).
Ratios: kvd L1 / prefix hit, recompute / kvd L1, kvd L2 / kvd L1.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.tools.bench.daemon import SpawnedDaemon, written_back
from kvd.tools.bench.engine_proc import (
    EngineEnv,
    EngineFailed,
    EngineUnavailable,
    VllmProcess,
    find_engine_env,
)

PROMPT_TOKENS: tuple[int, ...] = (1024, 2048, 4096)
REPEATS = 3
BLOCK_TOKENS = 128
# vLLM's OffloadingConnector keeps offloaded blocks in this much host memory.
OFFLOAD_BYTES = 2 << 30
LMCACHE_SKIP = (
    "LMCache 0.5.6's vLLM connector needs CUDA (on a CPU: RuntimeError: No supported cpu "
    "connector found), and `pip install lmcache` lowers numpy, protobuf and grpcio below "
    "what vLLM's CPU build and kvd need"
)

Progress = Callable[[str], None]


def prompt(tokens: int, seed: int) -> list[int]:
    """Token ids no other (tokens, seed) shares a block with (vocab 49,152)."""
    return [100 + (i * 7919 + seed * 104_729 + tokens) % 40_000 for i in range(tokens)]


@dataclass
class EngineRow:
    prompt_tokens: int
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    equal_tokens: dict[str, bool] = field(default_factory=dict)

    def ratio(self, num: str, den: str) -> float | None:
        a, b = self.ttft_s.get(num), self.ttft_s.get(den)
        return round(a / b, 3) if a and b else None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratios"] = {
            "kvd_l1_over_prefix_hit": self.ratio("kvd_l1", "prefix_hit"),
            "recompute_over_kvd_l1": self.ratio("recompute", "kvd_l1"),
            "kvd_l2_over_kvd_l1": self.ratio("kvd_l2", "kvd_l1"),
            "vllm_offload_over_prefix_hit": self.ratio("vllm_offload", "prefix_hit"),
        }
        return data


def _ttft(engine: VllmProcess, ids: list[int]) -> tuple[float, list[int]]:
    answer = engine.generate([ids], max_tokens=1)
    output = answer["outputs"][0]
    if output["finish_reason"] != "length":
        raise EngineFailed(f"request ended with {output['finish_reason']!r}")
    return float(answer["wall_s"]), list(output["tokens"])


def _median_ttft(engine: VllmProcess, ids: list[int], repeats: int) -> tuple[float, list[int]]:
    times: list[float] = []
    tokens: list[int] = []
    for _ in range(repeats):
        wall_s, tokens = _ttft(engine, ids)
        times.append(wall_s)
    return statistics.median(times), tokens


def run(
    sizes: tuple[int, ...] = PROMPT_TOKENS,
    repeats: int = REPEATS,
    progress: Progress = lambda _: None,
    env: EngineEnv | None = None,
) -> list[EngineRow]:
    env = env or find_engine_env()
    rows = {size: EngineRow(size) for size in sizes}
    prompts = {size: prompt(size, 1) for size in sizes}
    warmup = prompt(256, 99)
    reference: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvd-bench-engine-") as tmp:
        logs = Path(tmp)
        progress("engine: vLLM alone (recompute, its own prefix-cache hit)")
        with VllmProcess(env, logs / "vllm.log", prefix_caching=True) as engine:
            _ttft(engine, warmup)
            for size, ids in prompts.items():
                rows[size].ttft_s["recompute"], reference[size] = _ttft(engine, ids)
                rows[size].ttft_s["prefix_hit"], tokens = _median_ttft(engine, ids, repeats)
                rows[size].equal_tokens["prefix_hit"] = tokens == reference[size]
                progress(f"engine: {size} tokens: recompute {rows[size].ttft_s['recompute']:.3f} s")
        _kvd(env, logs, rows, prompts, reference, warmup, repeats, progress)
        _offload(env, logs, rows, prompts, reference, warmup, repeats, progress)
    for row in rows.values():
        row.skipped["lmcache"] = LMCACHE_SKIP
    return list(rows.values())


def _kvd(
    env: EngineEnv,
    logs: Path,
    rows: dict[int, EngineRow],
    prompts: dict[int, list[int]],
    reference: dict[int, list[int]],
    warmup: list[int],
    repeats: int,
    progress: Progress,
) -> None:
    workdir = logs / "kvd"
    workdir.mkdir()
    daemon = SpawnedDaemon(
        workdir, [], dram="4GiB", max_value="32MiB", ssd="4GiB", segment="256MiB"
    )
    url = f"kvd://{daemon.socket}"  # the same-node path engines use by default
    try:
        progress("engine: kvd, a first engine stores")
        with VllmProcess(env, logs / "kvd-store.log", kvd_url=url) as engine:
            for ids in prompts.values():
                _ttft(engine, ids)
        with Client(daemon.target, timeout_s=30) as client:
            written_back(client)
        progress("engine: kvd, a fresh engine restores")
        with VllmProcess(env, logs / "kvd-restore.log", kvd_url=url) as engine:
            _ttft(engine, warmup)
            for size, ids in prompts.items():
                rows[size].ttft_s["kvd_l1"], tokens = _median_ttft(engine, ids, repeats)
                rows[size].equal_tokens["kvd_l1"] = tokens == reference[size]
            for size, ids in prompts.items():
                daemon.stop()
                daemon = SpawnedDaemon(
                    workdir, [], dram="4GiB", max_value="32MiB", ssd="4GiB", segment="256MiB"
                )
                time.sleep(3.0)  # the connector's retry window after the restart
                rows[size].ttft_s["kvd_l2"], tokens = _ttft(engine, ids)
                rows[size].equal_tokens["kvd_l2"] = tokens == reference[size]
                progress(f"engine: {size} tokens: kvd L1 {rows[size].ttft_s['kvd_l1']:.3f} s")
    finally:
        daemon.stop()


def _offload(
    env: EngineEnv,
    logs: Path,
    rows: dict[int, EngineRow],
    prompts: dict[int, list[int]],
    reference: dict[int, list[int]],
    warmup: list[int],
    repeats: int,
    progress: Progress,
) -> None:
    progress("engine: vLLM's OffloadingConnector (CPU offload)")
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": OFFLOAD_BYTES},
    }
    try:
        with VllmProcess(env, logs / "offload.log", prefix_caching=True, kv_config=config) as e:
            _ttft(e, warmup)
            for size, ids in prompts.items():
                _ttft(e, ids)
                times = []
                for _ in range(repeats):
                    time.sleep(0.5)  # offloads finish between steps
                    e.request({"op": "reset_prefix_cache"})
                    wall_s, tokens = _ttft(e, ids)
                    times.append(wall_s)
                rows[size].ttft_s["vllm_offload"] = statistics.median(times)
                rows[size].equal_tokens["vllm_offload"] = tokens == reference[size]
    except (EngineFailed, EngineUnavailable) as exc:
        for row in rows.values():
            row.skipped["vllm_offload"] = root_cause(str(exc))


def root_cause(text: str) -> str:
    """The error line that says why an engine failed, not vLLM's "see above"."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if re.search(r"\w+(Error|Exception): ", line) and "see root cause" not in line.lower()
    ]
    return (errors[-1] if errors else lines[-1] if lines else "unknown")[:300]


def markdown(rows: list[EngineRow]) -> str:
    names = ["recompute", "prefix_hit", "kvd_l1", "kvd_l2", "vllm_offload"]
    lines = [
        "| prompt tokens | " + " | ".join(f"{n} TTFT s" for n in names)
        + " | kvd L1 / prefix hit | recompute / kvd L1 | kvd L2 / kvd L1 |",
        "|---" * (len(names) + 4) + "|",
    ]  # fmt: skip
    for row in rows:
        cells = [
            f"{row.ttft_s[n]:.3f}" if row.ttft_s.get(n) else "skipped" for n in names
        ]  # fmt: skip
        ratios = [row.ratio("kvd_l1", "prefix_hit"), row.ratio("recompute", "kvd_l1"),
                  row.ratio("kvd_l2", "kvd_l1")]  # fmt: skip
        lines.append(
            f"| {row.prompt_tokens} | " + " | ".join(cells) + " | "
            + " | ".join(f"{r:.2f}" if r else "-" for r in ratios) + " |"
        )  # fmt: skip
    skipped = {name: reason for row in rows for name, reason in row.skipped.items()}
    for name, reason in skipped.items():
        lines.append(f"\n{name}: skipped: {reason}")
    unequal = sorted({n for row in rows for n, same in row.equal_tokens.items() if not same})
    lines.append(
        "\nfirst token equal to recompute: "
        + ("all" if not unequal else "NOT for " + ", ".join(unequal))
    )
    return "\n".join(lines)


def results(rows: list[EngineRow]) -> dict[str, Any]:
    return {"rows": [row.as_dict() for row in rows]}


def dumps(rows: list[EngineRow]) -> str:
    return json.dumps(results(rows), indent=2)
