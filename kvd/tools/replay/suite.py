"""The eviction suite: every workload, every policy, next to LRU and Belady.

``kvd bench replay --workloads SET`` runs this instead of a daemon replay:
for each workload of the set (``kvd.tools.replay.workloads``, plus the conversation
trace when ``--trace`` names it) and each capacity (a fraction of the
workload's unique blocks) it simulates the policies and Belady, and reports
block hit ratios, each policy's ratio to Belady and to LRU, and the
policy's own CPU time per block reference and per request.

CPU time is the policy's own, per block reference: the calls the simulator
made into it (``insert``, ``touch``, ``remove``, ``victim``, ``on_lookup``,
the calls the daemon's store makes for the same requests) replayed under the
thread's CPU clock, best of a few runs, the replay loop's own cost taken off
(``kvd.tools.replay.cost``); wall time of the same replays beside it. The
``lru`` row shows the floor every policy shares (the chain tree and its
heaps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.store.eviction.policy import DEFAULT_POLICY
from kvd.tools.replay import cost, workloads
from kvd.tools.replay.sim import belady, capacity_for
from kvd.tools.replay.tiers import TierResult, sweep_tiers
from kvd.tools.replay.trace import Trace, load_trace

CONVERSATION = "conversation"  # the real trace, a tuning workload
SUITE_POLICIES: tuple[str, ...] = ("lru", "s3fifo", "hazard", "density")
SUITE_FRACTIONS: tuple[float, ...] = (0.05, 0.10)
SETS = ("all", "tuning", "held-out")


@dataclass(frozen=True)
class SuiteRow:
    """One policy (or Belady) on one workload at one capacity."""

    workload: str
    held_out: bool
    fraction: float
    capacity_blocks: int
    policy: str
    block_hit_ratio: float
    token_hit_ratio: float
    policy_us_per_ref: float  # the policy's CPU time (kvd.tools.replay.cost); 0 for Belady
    policy_us_per_request: float
    policy_wall_us_per_ref: float  # wall time of the same replays

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def workload_names(which: str) -> tuple[str, ...]:
    """The synthetic workloads of a set name, or of a comma-separated list."""
    if which == "all":
        return tuple(workloads.WORKLOADS)
    if which == "tuning":
        return workloads.TUNING
    if which == "held-out":
        return workloads.HELD_OUT
    names = tuple(name for name in which.split(",") if name)
    for name in names:
        if name not in workloads.WORKLOADS:
            raise workloads.WorkloadError(
                f"unknown workload {name!r}; expected a set {SETS} or names of "
                f"{tuple(workloads.WORKLOADS)}"
            )
    return names


def traces(
    which: str, conversation: Path | None = None, seed: int = workloads.SEED_DEFAULT
) -> list[tuple[str, bool, Trace]]:
    """(name, held out, trace) of every workload of ``which``, the
    conversation trace first when given (unless the set is the held-out one)."""
    found: list[tuple[str, bool, Trace]] = []
    if conversation is not None and which != "held-out":
        found.append((CONVERSATION, False, load_trace(conversation)))
    for name in workload_names(which):
        found.append((name, name in workloads.HELD_OUT, workloads.generate(name, seed)))
    return found


def run(
    which: str,
    conversation: Path | None = None,
    *,
    policies: Sequence[str] = SUITE_POLICIES,
    fractions: Sequence[float] = SUITE_FRACTIONS,
    seed: int = workloads.SEED_DEFAULT,
    cpu_repeats: int = cost.REPEATS_DEFAULT,
    progress: Callable[[str], None] | None = None,
) -> list[SuiteRow]:
    """Simulate ``policies`` and Belady on every workload of ``which`` (and
    on the trace at ``conversation`` unless the set is the held-out one)."""
    rows: list[SuiteRow] = []
    for name, held_out, trace in traces(which, conversation, seed):
        for fraction in fractions:
            capacity = capacity_for(trace, fraction)
            if progress:
                progress(f"suite: {name} at {100 * fraction:.0f} % ({capacity} blocks)")
            for policy in policies:
                result, spent = cost.measure(trace, policy, capacity, repeats=cpu_repeats)
                rows.append(SuiteRow(
                    name, held_out, fraction, capacity, policy, result.block_hit_ratio,
                    result.token_hit_ratio, spent.cpu_us_per_ref, spent.cpu_us_per_request,
                    spent.wall_us_per_ref,
                ))  # fmt: skip
            best = belady(trace, capacity)
            rows.append(SuiteRow(
                name, held_out, fraction, capacity, "belady", best.block_hit_ratio,
                best.token_hit_ratio, 0.0, 0.0, 0.0,
            ))  # fmt: skip
    return rows


def markdown(rows: Sequence[SuiteRow], default: str = DEFAULT_POLICY) -> str:
    """A table per capacity: block hit ratio per policy and the default's
    ratios to Belady and LRU; then the policies' CPU time."""
    policies = list(dict.fromkeys(r.policy for r in rows if r.policy != "belady"))
    by_key = {(r.workload, r.fraction, r.policy): r for r in rows}
    names = list(dict.fromkeys(r.workload for r in rows))
    held_out = {r.workload: r.held_out for r in rows}
    lines: list[str] = []
    for fraction in dict.fromkeys(r.fraction for r in rows):
        header = ["workload", "set", *policies, "belady", f"{default} / belady",
                  f"{default} / lru"]  # fmt: skip
        lines += [
            f"Block hit ratio at {100 * fraction:.0f} % of each workload's unique blocks:",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for name in names:
            cells = [name, "held-out" if held_out[name] else "tuning"]
            for policy in [*policies, "belady"]:
                row = by_key.get((name, fraction, policy))
                cells.append(f"{100 * row.block_hit_ratio:.2f} %" if row else "")
            mine = by_key.get((name, fraction, default))
            best = by_key.get((name, fraction, "belady"))
            lru = by_key.get((name, fraction, "lru"))
            for other in (best, lru):
                ok = mine is not None and other is not None and other.block_hit_ratio > 0
                cells.append(
                    f"{mine.block_hit_ratio / other.block_hit_ratio:.3f}"
                    if ok and mine is not None and other is not None
                    else ""
                )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "Policy CPU time, µs per block reference (per request; wall µs per block "
        "reference), at each capacity:",
        "",
        "| workload | capacity | " + " | ".join(policies) + " |",
        "|---|---|" + "---|" * len(policies),
    ]
    for name in names:
        for fraction in dict.fromkeys(r.fraction for r in rows):
            cells = [name, f"{100 * fraction:.0f} %"]
            for policy in policies:
                row = by_key.get((name, fraction, policy))
                cells.append(
                    f"{row.policy_us_per_ref:.2f} ({row.policy_us_per_request:.0f}; "
                    f"{row.policy_wall_us_per_ref:.2f})"
                    if row
                    else ""
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_tiers(
    which: str,
    conversation: Path | None,
    *,
    fraction: float,
    ratios: Sequence[int],
    policy: str = DEFAULT_POLICY,
    seed: int = workloads.SEED_DEFAULT,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[str, TierResult]]:
    """L1 of ``fraction`` of each workload's unique blocks, L2 of each ratio
    times that: every admission rule, with and without reinsertion."""
    results: list[tuple[str, TierResult]] = []
    for name, _, trace in traces(which, conversation, seed):
        if progress:
            progress(f"tiers: {name}, L1 {100 * fraction:.0f} %, L2 {list(ratios)} x L1")
        for result in sweep_tiers(trace, policy, capacity_for(trace, fraction), ratios):
            results.append((name, result))
    return results


def tiers_markdown(results: Sequence[tuple[str, TierResult]]) -> str:
    """Combined hit ratio, L1 share and L2 writes per workload and rule,
    with the writes saved and hits lost against writing everything."""
    lines = [
        "Two tiers (L1 policy, L2 FIFO reclaim): combined block hit ratio, L1 share of "
        "the hits, blocks written to L2; `twice` against `all` at the same L2:",
        "",
        "| workload | L2 / L1 | admit | reinsert | hit | L1 share | L2 writes | "
        "writes saved | hits lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = {(name, r.l2_blocks, r.reinsert): r for name, r in results if r.admit == "all"}
    for name, r in results:
        base = baseline.get((name, r.l2_blocks, r.reinsert))
        saved = lost = ""
        if base is not None and r.admit != "all":
            saved = f"{1 - r.l2_writes / base.l2_writes:.1%}" if base.l2_writes else ""
            base_hits = base.l1_hits + base.l2_hits
            lost = f"{1 - (r.l1_hits + r.l2_hits) / base_hits:.1%}" if base_hits else ""
        lines.append(
            f"| {name} | {r.l2_blocks // max(r.l1_blocks, 1)} | {r.admit} | "
            f"{'yes' if r.reinsert else 'no'} | {100 * r.block_hit_ratio:.2f} % | "
            f"{100 * r.l1_share:.1f} % | {r.l2_writes} | {saved} | {lost} |"
        )
    return "\n".join(lines)
