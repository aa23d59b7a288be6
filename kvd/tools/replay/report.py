"""``kvd bench replay``: run a trace against a daemon and write the report.

The report puts the daemon's figures (hit ratios per tier, latency
percentiles, bytes moved, requests/s) next to references the simulator
computes from the same trace at the same capacity: the unbounded cache,
Belady, ``lru`` and the daemon's policy; then the modeled prefill saving and
TTFT at a given prefill rate. Written as JSON, markdown and (with matplotlib,
the ``bench`` extra) a PNG of hit ratio against capacity.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.config.settings import L2_ADMISSIONS
from kvd.store.eviction.policy import DEFAULT_POLICY, POLICIES
from kvd.tools.bench.daemon import written_back
from kvd.tools.replay import prefill, suite, workloads
from kvd.tools.replay.run import (
    MODEL_BLOCK_BYTES,
    L2Layout,
    ReplayStats,
    capacity_of,
    dram_bytes_for,
    l2_layout,
    modeled_ttft,
    replay,
    start_l1_daemon,
)
from kvd.tools.replay.sim import belady, capacity_for, simulate, unbounded
from kvd.tools.replay.tiers import simulate_tiers
from kvd.tools.replay.trace import Trace, load_trace

CURVE_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
# How long a replay with L2 waits, after its last request, for write-back to
# write what is queued before it reads the daemon's L2 counters.
WRITE_BACK_DRAIN_S = 60.0
# The daemon's L2 counters a two-tier replay reports (``kvd.store``'s stats).
L2_FIGURES = ("l2_writes", "l2_write_bytes", "l2_rewrites", "l2_reclaims", "l2_held_back",
              "l2_admitted", "l2_never_written", "l1_dropped_unwritten")  # fmt: skip
# Prefill rate when none is given: SmolLM2-135M on one CPU core of the
# development machine is of this order (DESIGN.md's 15-25x restore claim).
PREFILL_TOKENS_PER_S_DEFAULT = 2000.0


def store_calls_on_lookup() -> bool:
    """Whether the daemon's store tells its policy about lookups (``on_lookup``,
    queued until the answer is out: ``kvd.store.learning``); the simulated
    reference of the daemon's policy then does the same."""
    from kvd.store.learning import DeferredPolicy

    return hasattr(DeferredPolicy, "defer_lookup")


def head(trace: Trace, requests: int) -> Trace:
    """The first ``requests`` requests of a trace (all of it for 0)."""
    if requests <= 0 or requests >= len(trace):
        return trace
    end = int(trace.offsets[requests])
    return Trace(
        trace.timestamps_ms[:requests],
        trace.input_tokens[:requests],
        trace.output_tokens[:requests],
        trace.offsets[: requests + 1],
        trace.blocks[:end],
        trace.parents,
        trace.block_tokens,
    )


def references(
    trace: Trace, capacity_blocks: int, policy: str, lookup_hook: bool = True
) -> dict[str, dict[str, float]]:
    """Simulated hit ratios at ``capacity_blocks``: bounds and policies."""
    results = {
        "unbounded": unbounded(trace),
        "belady": belady(trace, capacity_blocks),
        "lru (simulated)": simulate(trace, "lru", capacity_blocks),
        f"{policy} (simulated)": simulate(trace, policy, capacity_blocks, lookup_hook=lookup_hook),
    }
    return {
        name: {
            "block_hit_ratio": r.block_hit_ratio,
            "token_hit_ratio": r.token_hit_ratio,
            "block_hits": r.block_hits,
        }
        for name, r in results.items()
    }


def curve(trace: Trace) -> dict[str, list[float]]:
    """Block hit ratio per policy (and Belady) at CURVE_FRACTIONS."""
    rows: dict[str, list[float]] = {name: [] for name in (*POLICIES, "belady")}
    for fraction in CURVE_FRACTIONS:
        capacity = capacity_for(trace, fraction)
        for name in POLICIES:
            rows[name].append(simulate(trace, name, capacity).block_hit_ratio)
        rows["belady"].append(belady(trace, capacity).block_hit_ratio)
    rows["unbounded"] = [unbounded(trace).block_hit_ratio] * len(CURVE_FRACTIONS)
    return rows


def plot(
    rows: dict[str, list[float]], capacity_fraction: float, measured: float, path: Path
) -> bool:
    """The curve as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    xs = [100 * f for f in CURVE_FRACTIONS]
    for name, values in rows.items():
        style = "--" if name in ("belady", "unbounded") else "-"
        axes.plot(xs, [100 * v for v in values], style, marker="o", label=name)
    axes.plot([100 * capacity_fraction], [100 * measured], "k*", markersize=12, label="daemon")
    axes.set_xscale("log")
    axes.set_xlabel("capacity, % of unique blocks")
    axes.set_ylabel("block hit ratio, %")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _ratios(stats: ReplayStats) -> dict[str, float]:
    refs = stats.block_refs or 1
    return {
        "block_hit_ratio": stats.block_hits / refs,
        "token_hit_ratio": stats.token_hits / (stats.token_refs or 1),
        "l1_block_hit_ratio": stats.l1_hits / refs,
        "l2_block_hit_ratio": stats.l2_hits / refs,
    }


def markdown(report: dict[str, Any]) -> str:
    run, refs = report["run"], report["references"]
    lines = [
        f"# kvd bench replay: {report['trace']}",
        "",
        f"{run['requests']} requests, {run['clients']} client(s), speed "
        f"{run['speed'] or 'max'}; block {run['block_bytes']} B (scale 1/{run['scale']:.0f} "
        f"of {run['model']}); L1 capacity {run['capacity_blocks']} blocks "
        f"({100 * run['capacity_fraction']:.1f} % of {run['unique_blocks']} unique); "
        f"policy `{run['policy']}`.",
        "",
        "| | block hit | token hit |",
        "|---|---|---|",
    ]
    daemon = report["daemon"]
    lines.append(
        f"| daemon (L1 {100 * daemon['l1_block_hit_ratio']:.2f} %, L2 "
        f"{100 * daemon['l2_block_hit_ratio']:.2f} %) | "
        f"{100 * daemon['block_hit_ratio']:.2f} % | "
        f"{100 * daemon['token_hit_ratio']:.2f} % |"
    )
    for name, row in refs.items():
        lines.append(
            f"| {name} | {100 * row['block_hit_ratio']:.2f} % | "
            f"{100 * row['token_hit_ratio']:.2f} % |"
        )
    lines += ["", "| op | n | p50 ms | p90 ms | p99 ms | p99.9 ms |", "|---|---|---|---|---|---|"]
    for op, row in report["latency_ms"].items():
        if row:
            lines.append(
                f"| {op} | {row['n']} | {row['p50']:.2f} | {row['p90']:.2f} | "
                f"{row['p99']:.2f} | {row['p99.9']:.2f} |"
            )
    moved = report["moved"]
    model = report["model"]
    lines += [
        "",
        f"{moved['requests_per_s']:.1f} requests/s; got {moved['bytes_got'] / 2**20:.1f} MiB, "
        f"put {moved['bytes_put'] / 2**20:.1f} MiB; every byte verified "
        f"({moved['wrong_blocks']} wrong, {moved['lost_after_lookup']} lost after lookup).",
        "",
        f"Modeled at {model['prefill_tokens_per_s']:.0f} prefill tokens/s "
        f"({model.get('prefill_rate_source', 'parameter')}): "
        f"{100 * model['prefill_tokens_saved_ratio']:.1f} % of prefill tokens saved; mean TTFT "
        f"{model['ttft_mean_without_kvd_s']:.2f} s without kvd, "
        f"{model['ttft_mean_with_kvd_s']:.2f} s with ({model['ttft_speedup']:.2f}x).",
    ]
    if "tiers" in report:
        lines += _tiers_markdown(report["tiers"])
    return "\n".join(lines)


def run_bench(
    args: argparse.Namespace, progress: Callable[[str], None]
) -> tuple[dict[str, Any], str]:
    """What ``kvd bench replay`` runs; returns the report and its markdown."""
    if args.workload:
        trace_all = workloads.generate(args.workload, args.seed)
    else:
        trace_all = load_trace(args.trace)
    trace = head(trace_all, args.requests)
    unique = len(set(trace.blocks.tolist()))
    capacity = max(1, int(unique * args.capacity_fraction))
    block_bytes = args.block_bytes
    model_bytes = MODEL_BLOCK_BYTES[args.model]
    policy = args.policy or DEFAULT_POLICY
    daemon = None
    l2: L2Layout | None = None
    l2_figures: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="kvd-replay-") as tmp:
        target = args.target
        if not target:
            dram_bytes = dram_bytes_for(capacity, block_bytes)
            capacity = capacity_of(dram_bytes, block_bytes)
            extra = ["--eviction-policy", policy]
            if args.l2_ratio:
                l2 = l2_layout(args.l2_ratio * capacity, block_bytes)
                extra += ["--l2-admission", args.l2_admission]
            daemon = start_l1_daemon(Path(tmp), dram_bytes, block_bytes, extra, l2)
            target = daemon.target
            progress(f"started kvd at {target}: L1 {dram_bytes} B = {capacity} blocks"
                     + (f", L2 {l2.ssd_bytes} B = {l2.blocks} blocks" if l2 else ""))  # fmt: skip
        try:
            stats = replay(
                target,
                trace,
                block_bytes=block_bytes,
                namespace=args.namespace,
                clients=args.clients,
                speed=args.speed,
                progress=progress,
            )
            if l2 is not None:
                l2_figures = _drained_l2_figures(target)
        finally:
            if daemon is not None:
                daemon.stop()
    if args.prefill_tokens_per_s <= 0:
        progress("prefill rate: measuring the real model when installed")
    rate = prefill.resolve(args.prefill_tokens_per_s, PREFILL_TOKENS_PER_S_DEFAULT)
    model = modeled_ttft(trace, stats, rate.tokens_per_s, stats.requests)
    model["prefill_rate_source"] = rate.source
    progress("simulating the references")
    fraction = capacity / unique
    rows = curve(trace)
    report: dict[str, Any] = {
        "suite": "replay",
        "trace": f"{args.workload} (seed {args.seed})" if args.workload else str(args.trace),
        "run": {
            "requests": stats.requests,
            "clients": args.clients,
            "speed": args.speed,
            "block_bytes": block_bytes,
            "model": args.model,
            "scale": model_bytes / block_bytes,
            "capacity_blocks": capacity,
            "capacity_fraction": fraction,
            "unique_blocks": unique,
            "policy": policy,
            "target": args.target or "self-started (L1 only)",
        },
        "daemon": _ratios(stats),
        "references": references(trace, capacity, policy, store_calls_on_lookup()),
        "latency_ms": {
            "lookup": stats.lookup.percentiles_ms(),
            "get (hit prefix)": stats.get.percentiles_ms(),
            "put (missed blocks)": stats.put.percentiles_ms(),
        },
        "moved": {
            "bytes_got": stats.bytes_got,
            "bytes_put": stats.bytes_put,
            "blocks_put": stats.blocks_put,
            "wrong_blocks": stats.wrong_blocks,
            "lost_after_lookup": stats.lost_after_lookup,
            "elapsed_s": stats.elapsed_s,
            "requests_per_s": stats.requests / stats.elapsed_s if stats.elapsed_s else 0.0,
        },
        "model": model,
        "curve": {"fractions": list(CURVE_FRACTIONS), "block_hit_ratio": rows},
    }
    if l2 is not None:
        progress("simulating the two tiers")
        report["tiers"] = _tiers(trace, policy, capacity, l2, args.l2_admission, stats,
                                 l2_figures)  # fmt: skip
    return report, markdown(report)


def _drained_l2_figures(target: str) -> dict[str, int]:
    """The daemon's L2 counters once write-back has written what is queued
    (or ``WRITE_BACK_DRAIN_S`` has passed)."""
    with Client(target) as client:
        written_back(client, WRITE_BACK_DRAIN_S)
        values = client.stats()
    return {name: int(values.get(name, 0)) for name in L2_FIGURES}


def _tiers(trace: Trace, policy: str, capacity: int, l2: L2Layout, admission: str,
           stats: ReplayStats, figures: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    """The daemon's two tiers next to ``kvd.tools.replay.tiers``'s simulation
    of the same sizes and admission rule (FIFO reclaim with reinsertion)."""
    simulated = simulate_tiers(trace, policy, capacity, l2.blocks, admit=admission)
    hits = stats.l1_hits + stats.l2_hits
    return {
        "l2_blocks": l2.blocks,
        "l2_bytes": l2.ssd_bytes,
        "admission": admission,
        "daemon": {
            "block_hit_ratio": stats.block_hits / (stats.block_refs or 1),
            "l1_share": stats.l1_hits / hits if hits else 0.0,
            **figures,
        },
        "simulator": simulated.as_dict(),
    }


def _tiers_markdown(tiers: dict[str, Any]) -> list[str]:
    daemon, sim = tiers["daemon"], tiers["simulator"]
    return [
        "",
        f"Two tiers: L2 of {tiers['l2_blocks']} blocks ({tiers['l2_bytes'] / 2**30:.2f} GiB), "
        f"admission `{tiers['admission']}`:",
        "",
        "| | block hit ratio | L1 share of hits | L2 writes (blocks) |",
        "|---|---|---|---|",
        f"| daemon | {100 * daemon['block_hit_ratio']:.2f} % | {100 * daemon['l1_share']:.1f} % "
        f"| {daemon['l2_writes']} ({daemon['l2_write_bytes'] / 2**30:.2f} GiB) |",
        f"| simulator | {100 * sim['block_hit_ratio']:.2f} % | {100 * sim['l1_share']:.1f} % "
        f"| {sim['l2_writes']} |",
        "",
        f"Daemon: {daemon['l2_held_back']} puts held back, {daemon['l2_admitted']} of them "
        f"written at a second reference, {daemon['l2_never_written']} evicted unwritten; "
        f"{daemon['l2_rewrites']} records rewritten at reclaim, {daemon['l2_reclaims']} "
        f"segments reclaimed.",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="", help="JSONL trace (Mooncake format)")
    parser.add_argument(
        "--workload",
        default="",
        choices=("", *workloads.WORKLOADS),
        help="replay a synthetic workload (kvd.tools.replay.workloads) instead of --trace",
    )
    parser.add_argument(
        "--workloads",
        default="",
        metavar="SET",
        help="simulate every policy on a set of workloads (all, tuning, held-out, or "
        "names) next to LRU and Belady, with the policies' CPU time; no daemon. "
        "--trace adds the conversation trace (a tuning workload)",
    )
    parser.add_argument("--seed", type=int, default=workloads.SEED_DEFAULT, help="workload seed")
    parser.add_argument(
        "--l2-ratios",
        default="",
        help="with --workloads: also replay L1 (the first of --fractions) + L2 of these "
        "multiples of L1 (e.g. 10,50), each L2 admission rule (kvd.tools.replay.tiers)",
    )
    parser.add_argument(
        "--fractions",
        default="0.05,0.10",
        help="capacities of --workloads, as fractions of each workload's unique blocks",
    )
    parser.add_argument("--target", default="", help="a running daemon (default: start one)")
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=1 << 16,
        help="bytes per 512-token block (scaled down from --model)",
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m-fp32",
        choices=sorted(MODEL_BLOCK_BYTES),
        help="model whose block size --block-bytes scales",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="time-accurate at this speed-up; 0: as fast as possible",
    )
    parser.add_argument("--clients", type=int, default=1, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    parser.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.05,
        help="L1 size as a share of the trace's unique blocks",
    )
    parser.add_argument(
        "--policy",
        default="",
        choices=("", *POLICIES),
        help=f"eviction policy of a started daemon [default {DEFAULT_POLICY}]",
    )
    parser.add_argument(
        "--l2-ratio",
        type=int,
        default=0,
        help="give a started daemon an L2 of this many times its L1 (0: L1 only) and "
        "report both tiers next to their simulation (kvd.tools.replay.tiers)",
    )
    parser.add_argument(
        "--l2-admission",
        default="all",
        choices=L2_ADMISSIONS,
        help="the started daemon's l2_admission (with --l2-ratio)",
    )
    parser.add_argument("--namespace", default="replay", help="namespace of the blocks")
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=0.0,
        help="prefill rate for the TTFT model; 0: measure the end-to-end test's model "
        f"(SmolLM2-135M) when installed, else {PREFILL_TOKENS_PER_S_DEFAULT:.0f}",
    )


def run_suite(
    args: argparse.Namespace, progress: Callable[[str], None]
) -> tuple[dict[str, Any], str]:
    """What ``kvd bench replay --workloads SET`` runs (kvd.tools.replay.suite)."""
    fractions = tuple(float(f) for f in args.fractions.split(",") if f)
    conversation = Path(args.trace) if args.trace else None
    started = time.perf_counter()
    rows = suite.run(args.workloads, conversation, fractions=fractions, seed=args.seed,
                     progress=progress)  # fmt: skip
    table = suite.markdown(rows)
    ratios = tuple(int(r) for r in args.l2_ratios.split(",") if r)
    tier_rows: list[dict[str, Any]] = []
    if ratios:
        tiers = suite.run_tiers(args.workloads, conversation, fraction=fractions[0],
                                ratios=ratios, seed=args.seed, progress=progress)  # fmt: skip
        table += "\n\n" + suite.tiers_markdown(tiers)
        tier_rows = [{"workload": name, **result.as_dict()} for name, result in tiers]
    report: dict[str, Any] = {
        "suite": "replay-workloads",
        "workloads": args.workloads,
        "seed": args.seed,
        "trace": str(conversation) if conversation else "",
        "default_policy": DEFAULT_POLICY,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [row.as_dict() for row in rows],
        "tiers": tier_rows,
    }
    return report, table


def main(args: argparse.Namespace, out_dir: Path, progress: Callable[[str], None]) -> int:
    if args.workloads:
        report, table = run_suite(args, progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = out_dir / f"{stamp}-replay-workloads.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        path.with_suffix(".md").write_text(table + "\n")
        print(table)
        print(f"\nraw: {path}")
        return 0
    if bool(args.trace) == bool(args.workload):
        raise SystemExit("kvd bench replay: --trace FILE or --workload NAME, or --workloads SET")
    report, table = run_bench(args, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out_dir / f"{stamp}-replay.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(table + "\n")
    png = path.with_suffix(".png")
    if not plot(
        report["curve"]["block_hit_ratio"],
        report["run"]["capacity_fraction"],
        report["daemon"]["block_hit_ratio"],
        png,
    ):
        progress("matplotlib not installed (pip install 'kvd[bench]'): no PNG")
    print(table)
    print(f"\nraw: {path}")
    return 0
