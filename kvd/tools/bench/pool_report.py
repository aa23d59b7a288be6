"""``kvd bench pool``'s targets and markdown: each figure as a ratio to its
reference from the same run (``kvd.tools.bench.pool``).

The targets:

- remote get of 4 MiB values through the local daemon >= 0.8x the TCP
  ceiling between the same two nodes, measured just before (each peer
  transport its own row: one value a call, then ``batch_values`` a call);
- pool hit ratio = a single daemon's of the same total capacity, within 2 %
  of it (pool / single in 0.98..1.02; the difference in points is shown too);
- keys moved on a join <= 1.2 x 1/N (N: the members after the join);
- lookup of a 1,000-key chain spread over 4 members: p99 <= 2x a single
  daemon's, with ``pool_lookup_hint_ms`` (the default: a chain looked up
  again is answered from its owners' recent answers) and with it at 0
  (every lookup asks the owners);
- an owner cut off, stopped or killed: the engine's calls through its own
  daemon have p99 <= their deadline + 10 ms, 0 wrong bytes, 0 errors.

Beside them (no target in numbers): a fifth member joining four from
etcd; the values handed on to it against 1/N, and every block found
again by lookups, with 0 wrong bytes; a member leaving with
``pool_leave_handoff_ms`` (every block found after, 0 wrong), beside one
leaving without it. And the trace replayed with a fifth
member joining halfway, and with the fifth of five leaving halfway (its
values handed on first): the hit ratio after the change within 2 % of the
pool simulator's for the same change (the daemon and the simulator make
the same decisions but for timing), 0 wrong blocks.
"""

from __future__ import annotations

from typing import Any

GB = 1e9
REMOTE_GET_MIN = 0.8
HIT_RATIO_BAND = 0.02
MOVED_MAX = 1.2
LOOKUP_P99_MAX = 2.0


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: the figure, its reference, the ratio, met or not."""
    rows = []
    for get in result["remote_get"]:
        ceiling = get["tcp_ceiling"]["bytes_per_s"]
        asked, used = get["transport_asked"], get["transport_used"]
        name = used if asked in (used, "default") else f"{asked} (ran {used})"
        size = f"{get['value_bytes'] >> 20} MiB"
        batched = f", {get['batch_values']} a call"
        for how, rate in (("", get["bytes_per_s"]), (batched, get["batch_bytes_per_s"])):
            ratio = rate / ceiling
            rows.append({
                "target": f"remote get {size}{how}, {name}",
                "measured": f"{rate / GB:.2f} GB/s",
                "reference": f"TCP ceiling {ceiling / GB:.2f} GB/s",
                "ratio": ratio,
                "goal": f">= {REMOTE_GET_MIN}",
                "met": ratio >= REMOTE_GET_MIN,
            })  # fmt: skip
    hits = result["hit_ratio"]
    pool, single = hits["pool"]["block_hit_ratio"], hits["single"]["block_hit_ratio"]
    ratio = pool / single if single else 0.0
    rows.append({
        "target": f"hit ratio, {hits['requests']} requests over 4 members",
        "measured": f"{100 * pool:.2f} %",
        "reference": f"single daemon {100 * single:.2f} % ({100 * (pool - single):+.2f} points)",
        "ratio": ratio,
        "goal": f"{1 - HIT_RATIO_BAND:.2f}..{1 + HIT_RATIO_BAND:.2f}",
        "met": abs(ratio - 1) <= HIT_RATIO_BAND,
    })  # fmt: skip
    moved = result["keys_moved"]
    ratio = moved["moved_fraction"] / moved["ideal_fraction"]
    rows.append({
        "target": f"keys moved, join {moved['members_before']} -> {moved['members_after']}",
        "measured": f"{moved['moved_fraction']:.4f} of {moved['keys']}",
        "reference": f"1/N = {moved['ideal_fraction']:.4f}",
        "ratio": ratio,
        "goal": f"<= {MOVED_MAX}",
        "met": ratio <= MOVED_MAX,
    })  # fmt: skip
    rows += _lookup_rows(result["lookup"])
    for fault in result["faults"]["rows"]:
        bound_ms = fault["deadline_ms"] + 10
        ratio = fault["p99_ms"] / bound_ms
        rows.append({
            "target": f"fault: owner {fault['fault']}, {fault['calls']} engine calls",
            "measured": f"p99 {fault['p99_ms']:.1f} ms (max {fault['max_ms']:.0f}), "
            f"{fault['wrong_bytes']} wrong bytes, "
            f"{fault['errors']} errors, {fault['misses']} misses",
            "reference": f"deadline + 10 ms = {bound_ms:.0f} ms",
            "ratio": ratio,
            "goal": "<= 1, 0 wrong, 0 errors",
            "met": ratio <= 1 and fault["wrong_bytes"] == 0 and fault["errors"] == 0,
        })  # fmt: skip
    join = result.get("join", {})
    if "skipped" not in join and join:
        share, ideal = join["handed_on_share"], 1 / (join["members"] + 1)
        after = join["found_after_s"]
        found = f"100 % after {after:.2f} s" if after is not None else "not all within the wait"
        rows.append({
            "target": f"join {join['members']} -> {join['members'] + 1} (etcd): blocks found",
            "measured": f"{100 * join['found_at_join']:.1f} % at the join, {found}; "
            f"{join['handed_on']:.0f} of {join['values']} values handed on ({share:.4f}), "
            f"{join['wrong']} wrong, {join['misses']} misses",
            "reference": f"1/N = {ideal:.4f}",
            "ratio": share / ideal,
            "goal": "all found, 0 wrong",
            "met": after is not None and join["wrong"] == 0 and join["misses"] == 0,
        })  # fmt: skip
        if join.get("leave"):
            rows.append(_leave_row(join["leave"]))
    replay = result.get("join_replay", {})
    if "skipped" not in replay and replay:
        rows.append(_change_replay_row(
            replay, "join", f"trace with a join at request {replay['join_at']}",
            (("without histories", "join_without_histories"), ("no join", "no_join")),
        ))  # fmt: skip
    leave = result.get("leave_replay", {})
    if "skipped" not in leave and leave:
        rows.append(_change_replay_row(
            leave, "leave", f"trace with a leave (hand-off) at request {leave['leave_at']}",
            (("without histories", "leave_without_histories"),
             ("without the hand-off", "leave_without_hand_off"), ("no leave", "no_leave")),
        ))  # fmt: skip
    return rows


def _change_replay_row(
    replay: dict[str, Any], change: str, target: str, others: tuple[tuple[str, str], ...]
) -> dict[str, Any]:
    """A trace replayed with a change of members: the hit ratio after it
    against the simulator's ``change`` case, the ``others`` beside it."""
    measured, simulated = replay["after"], replay["simulated"]
    ratio = measured["block_hit_ratio"] / max(simulated[change]["after"], 1e-9)

    def both(case: str) -> str:
        return (f"{100 * simulated[case]['after']:.2f} % "
                f"({100 * simulated[case]['right_after']:.2f} %)")  # fmt: skip

    return {
        "target": f"{target}: hit ratio after it",
        "measured": f"{100 * measured['block_hit_ratio']:.2f} % (the first "
        f"{replay['window']}: {100 * replay['right_after']['block_hit_ratio']:.2f} %), "
        f"{measured['wrong_blocks']} wrong blocks",
        "reference": f"simulator {both(change)}; "
        + ", ".join(f"{label} {both(case)}" for label, case in others),
        "ratio": ratio,
        "goal": f"{1 - HIT_RATIO_BAND:.2f}..{1 + HIT_RATIO_BAND:.2f} of the simulator, 0 wrong",
        "met": abs(ratio - 1) <= HIT_RATIO_BAND and measured["wrong_blocks"] == 0,
    }


def _leave_row(leaves: list[dict[str, Any]]) -> dict[str, Any]:
    """A member leaving with ``pool_leave_handoff_ms``, and one without."""
    handed, bare = leaves
    took = f"in {handed['handoff_ms']} ms" if handed["handoff_ms"] is not None else "(no log line)"
    return {
        "target": "a member leaving (SIGTERM) with pool_leave_handoff_ms: blocks found after",
        "measured": f"{100 * handed['found_after']:.1f} %; {handed['handed_on']} values "
        f"handed on {took} (its {handed['owned']} of these chains and the join's it owned), "
        f"{handed['wrong']} wrong, {handed['misses']} missing",
        "reference": f"a member leaving without it: {100 * bare['found_after']:.1f} %, "
        f"{bare['misses']} of its {bare['owned']} values missing",
        "ratio": handed["found_after"],
        "goal": "all found, 0 wrong, 0 missing",
        "met": handed["found_after"] == 1.0 and handed["wrong"] == 0 and handed["misses"] == 0,
    }


def markdown(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| Target | Measured | Reference (same run) | Ratio | Goal | Met |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['target']} | {row['measured']} | {row['reference']} | "
            f"{row['ratio']:.2f} | {row['goal']} | {'yes' if row['met'] else 'no'} |"
        )
    ceilings = "; ".join(
        f"{g['transport_used']}: "
        + ", ".join(f"{r / GB:.2f}" for r in g["tcp_ceiling"]["runs_bytes_per_s"])
        for g in result["remote_get"]
    )
    moved = result["remote_get"][0]["tcp_ceiling"]["bytes"]
    gets = ", ".join(
        f"{g['transport_used']}: p50 {g['get_p50_ms']:.1f} ms, then local "
        f"{g['local_bytes_per_s'] / GB:.2f} GB/s"
        for g in result["remote_get"]
    )
    chains = ", ".join(
        f"{g['transport_used']}: batch {g['chain']['batch_bytes_per_s'] / GB:.2f} GB/s "
        f"({g['chain']['batch_s'] * 1e3:.1f} ms), one at a time "
        f"{g['chain']['one_at_a_time_bytes_per_s'] / GB:.2f} GB/s "
        f"({g['chain']['one_at_a_time_s'] / g['chain']['batch_s']:.2f}x the batch's time)"
        for g in result["remote_get"]
    )
    handed = ", ".join(_handed_on(g) for g in result["remote_get"] if "handed_on" in g)
    chain = result["remote_get"][0]["chain"]
    hits = result["hit_ratio"]
    plans = hits.get("plans", {})
    wrong = sum(g["wrong_bytes"] for g in result["remote_get"]) + sum(
        hits[side]["wrong_blocks"] for side in ("pool", "single")
    )
    lines += [
        "",
        f"Members {'in' if result['where'] == 'network namespaces' else 'on'} "
        f"{result['where']}. TCP ceiling: the best of three runs just before "
        f"each transport's gets, one connection, {moved / 2**20:.0f} MiB each ({ceilings} "
        f"GB/s). Remote gets ({gets}). Remote chain of "
        f"{chain['values']} values of {chain['value_bytes'] >> 10} KiB ({chains}). Puts "
        f"through A of values B owns, until B holds them ({handed or 'not run'}).",
        f"Replay: {hits['capacity_blocks']} blocks of {hits['block_bytes']} B "
        f"({100 * hits['capacity_fraction']:.1f} % of {hits['unique_blocks']} unique), "
        f"{hits['forwards']:.0f} puts handed to their owners ({hits['forwards_dropped']:.0f} "
        f"dropped), {hits['peer_errors']:.0f} failed peer calls (misses); lookup: "
        f"{result['lookup']['peer_errors']:.0f} failed peer calls; replay took pool "
        f"{hits['pool']['seconds']} s, "
        f"single {hits['single']['seconds']} s. Simulated ({hits['simulated']['policy']}): one "
        f"daemon of the pool's size {100 * hits['simulated']['single']:.2f} %, one member alone "
        f"{100 * hits['simulated']['one_member_alone']:.2f} %, the pool "
        f"{100 * hits['simulated'].get('pool', 0.0):.2f} % (measured "
        f"{100 * hits['pool']['block_hit_ratio']:.2f} %; members not in step "
        f"{100 * hits['simulated'].get('pool_apart', 0.0):.2f} %); plans adopted "
        f"{plans.get('adopted', 0):.0f} (refused {plans.get('refused', 0):.0f}); found by a "
        f"lookup and gone at its get: {hits['pool']['lost_after_lookup']}; guests held at the end: "
        f"{hits.get('guests_at_end', 0):.0f}. Wrong bytes or blocks: {wrong}.",
    ]
    for key, name, describe in (
        ("join", "Join", _join_line),
        ("join_replay", "Trace with a join", _join_replay_line),
        ("leave_replay", "Trace with a leave", _leave_replay_line),
    ):
        section = result.get(key, {})
        if "skipped" in section:
            lines.append(f"{name}: skipped ({section['skipped']}).")
        elif section:
            lines.append(describe(section))
    return "\n".join(lines)


def _join_line(join: dict[str, Any]) -> str:
    cpu = ", ".join(f"{ms:.0f}" for ms in join["old_members_cpu_ms"])
    return (
        f"Join: {join['values']} values of {join['value_bytes'] >> 10} KiB in chains, "
        f"member 0 looking every chain up until it found every block; the old members' "
        f"CPU meanwhile {cpu} ms; {join['forward_errors']:.0f} hand-offs failed."
    )


def _join_replay_line(replay: dict[str, Any]) -> str:
    return (
        f"Trace with a join: {replay['handed_on']:.0f} values handed on in "
        f"{replay['handoff_s']:.1f} s, {replay['histories_taken']:.0f} with their history; "
        f"{replay['forward_errors']:.0f} hand-offs failed; before the join the four hit "
        f"{100 * replay['before']['block_hit_ratio']:.2f} %."
    )


def _leave_replay_line(leave: dict[str, Any]) -> str:
    return (
        f"Trace with a leave: the member stopped in {leave['stop_s']:.1f} s "
        f"({leave['hand_off_log'].partition('msg=')[2] or 'no hand-off logged'}); the four "
        f"kept {leave['adopted']:.0f} copies as their own, "
        f"{leave['histories_taken']:.0f} values taken with their history; before the "
        f"leave the five hit {100 * leave['before']['block_hit_ratio']:.2f} %."
    )


def _handed_on(get: dict[str, Any]) -> str:
    """A transport's puts handed on: rate, ratio to its ceiling, CPU per value."""
    handed, ceiling = get["handed_on"], get["tcp_ceiling"]["bytes_per_s"]
    cpu = handed["cpu_ms_per_value"]
    return (
        f"{get['transport_used']}: {handed['values']} x {handed['value_bytes'] >> 20} MiB at "
        f"{handed['bytes_per_s'] / GB:.2f} GB/s, {handed['bytes_per_s'] / ceiling:.2f}x the "
        f"ceiling, CPU per value A {cpu['member']:.2f} ms, B {cpu['owner']:.2f} ms, "
        f"{handed['misses']} not there"
    )


def _lookup_rows(lookup: dict[str, Any]) -> list[dict[str, Any]]:
    """The lookup's p99 against one daemon's: with hints, asking every time,
    and each again with each node on its own CPUs where the run had them."""
    cases = [("pool", "")]  # a result from before the hints: every lookup asked
    if lookup.get("default") == "pool":  # hints on by default
        hint = f"pool_lookup_hint_ms {lookup['hint_ms']}, the default"
        cases = [
            ("pool", f", the chain looked up again ({hint})"),
            ("pool_asked", ", asking the owners every time (pool_lookup_hint_ms 0)"),
        ]
    elif "pool_asked" in lookup:
        cases = [("pool", ", pool_lookup_hint_ms on, the chain looked up again"),
                 ("pool_asked", ", asking the owners every time (the default)")]  # fmt: skip
    if "pool_split" in lookup:
        split = lookup["split_cpus"]
        rest = ", ".join(map(str, split["rest"]))
        on = (f", each node on its own CPUs (the asking member and the engine on CPU "
              f"{split['first']}, the other members on {rest})")  # fmt: skip
        cases += [(case + "_split", how + on) for case, how in cases]
    pace = f", lookups {lookup['pace_ms']:g} ms apart" if lookup.get("pace_ms") else ""
    rows = []
    for case, how in cases:
        single = lookup["single_split" if case.endswith("_split") else "single"]
        spread, ratio = lookup[case], lookup[case]["p99_ms"] / single["p99_ms"]
        chain = f"{lookup['keys']}-key chain over {lookup['owners']} members{pace}"
        rows.append({
            "target": f"lookup p99, {chain}{how}",
            "measured": f"{spread['p99_ms']:.2f} ms (p50 {spread['p50_ms']:.2f})",
            "reference": f"single daemon {single['p99_ms']:.2f} ms (p50 {single['p50_ms']:.2f})"
            + (", on the first CPU with its engine" if case.endswith("_split") else ""),
            "ratio": ratio,
            "goal": f"<= {LOOKUP_P99_MAX}",
            "met": ratio <= LOOKUP_P99_MAX,
        })  # fmt: skip
    return rows
