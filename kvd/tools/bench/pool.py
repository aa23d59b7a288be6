"""``kvd bench pool``: the pool across nodes, each figure beside its
reference measured in the same run.

- **Remote get**: an engine on node A reads values that node B owns, through
  A's daemon (its Unix socket and shared memory), once per peer transport the
  daemon offers (``pool_peer_transport``, and gRPC with TLS between the
  members: ``kvd.tools.bench.pool_tls``); beside each, the TCP ceiling between
  the same two nodes measured just before it (``kvd.tools.bench.pool_ceiling``:
  on this loaded 2-core VM a ceiling moves by 2x within minutes). Each value is read
  once (a second read is local: A keeps it in L1, reported beside). Then
  ``REMOTE_BATCHED_PER_VALUE`` times as many other values in calls of
  ``REMOTE_BATCH`` (``get_many_into``, as an engine loads a prefix of
  large blocks: A fetches a call's values from B in parallel, each copied
  into its room as it lands), against the same ceiling, after
  ``REMOTE_WARM_CALLS`` untimed calls that open the connections a call
  reads over and let TCP grow their windows (as the first single get does
  for its one; their times are reported). Then a
  chain of 64 values of 64 KiB that B owns, read through A one value at a
  time and in one batch (``get_many_into``: A asks B for all it lacks at
  once), fresh values each round. Then puts through A of values B owns,
  timed until B holds them (``kvd.tools.bench.pool_puts``).
- **Hit ratio**: a trace replayed over 4 members (request i through member
  i mod 4, as engines on different nodes) against one daemon of the same
  total L1 capacity, both with ``kvd.tools.replay.run``'s requests.
- **Keys moved on a join**: the trace's blocks placed over 4 members, then 5.
- **Lookup of a chain** spread over 4 members, asked of a member that holds
  only its own share, against one daemon that holds the whole chain
  (``kvd.tools.bench.pool_lookup``).
- **Faults** (``kvd.tools.bench.pool_faults``): an owner cut off, stopped,
  killed; the engine's calls against their deadline.
- **Join** (``kvd.tools.bench.pool_join``): a fifth member joins four whose
  membership comes from etcd; how soon lookups find every block again.
  Then the trace replayed with a fifth member joining halfway, and with
  the fifth of five leaving halfway (``kvd.tools.bench.pool_join_replay``):
  the hit ratio after the change beside the simulator's.

Members run in network namespaces when this is root (``kvd.tools.bench.netns``),
on loopback otherwise (the report says which). No L2: the figures are the
network's and the pool's, not the SSD's. Every value read is checked.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.config.settings import SETTINGS_BY_NAME
from kvd.store.eviction.policy import DEFAULT_POLICY
from kvd.tools.bench import (
    pool_ceiling,
    pool_faults,
    pool_join,
    pool_join_replay,
    pool_lookup,
    pool_puts,
    pool_tls,
)
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.bench.pool_nodes import Pool, write_tokens
from kvd.tools.replay.pool_sim import simulate_pool
from kvd.tools.replay.report import head
from kvd.tools.replay.run import (
    ReplayStats,
    _request,
    block_key,
    block_value,
    capacity_of,
    dram_bytes_for,
)
from kvd.tools.replay.sim import simulate
from kvd.tools.replay.trace import Trace, load_trace

MiB = 1 << 20
MEMBERS = 4
CEILING_RUNS = 3  # the ceiling is the best of three
# The remote chain: values, their size, and rounds (each reads fresh values
# one at a time, then fresh ones in one batch; the best round of each counts).
CHAIN_VALUES = 64
CHAIN_VALUE_BYTES = 64 * 1024
CHAIN_ROUNDS = 3
CHAIN_NS = "bench-remote-chain"
REMOTE_BATCH = 8  # values per get_many_into of the batched remote gets
# Untimed calls of REMOTE_BATCH before the timed ones: members keep their
# connections, but the bench's are new. On the development VM the first call
# of 8 x 4 MiB took ~22 ms (7 connections opened), the next two 14-19 ms
# while TCP grew the new connections' windows, the calls after 11-15 ms.
REMOTE_WARM_CALLS = 2
# Values read in the timed calls of REMOTE_BATCH, per value read one at a
# time (128 at the default 32): one call's rate moved by up to 2x from call
# to call on the development VM.
REMOTE_BATCHED_PER_VALUE = 4
CALL_TIMEOUT_S = 60.0
# Peer calls may take 1 s here (the daemon's default is 200 ms): the bench
# measures the pool's speed and hit ratio, not a loaded machine's timeouts.
PEER_TIMEOUT_MS = 1000

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    values: int = 32
    value_bytes: int = 4 * MiB
    chain_keys: int = 1000
    lookups: int = 200
    lookup_pace_ms: float = 0.0  # between timed lookups; 0: back to back
    requests: int = 0  # 0: the whole trace
    capacity_fraction: float = 0.05  # kvd bench replay's default
    block_bytes: int = 64 * 1024
    netns: bool = True
    trace: str = ""
    transports: tuple[str, ...] = ()  # () : every one the daemon offers
    join_chains: int = 256  # chains held when a fifth member joins (pool_join)


def peer_transports() -> tuple[str, ...]:
    """The choices of pool_peer_transport besides auto; ("",) when the daemon
    has one transport and no such setting."""
    setting = SETTINGS_BY_NAME.get("pool_peer_transport")
    if setting is None or not setting.choices:
        return ("",)
    choices = tuple(choice for choice in setting.choices if choice != "auto")
    if "pool_tls_ca_file" in SETTINGS_BY_NAME and pool_tls.available():
        choices += (pool_tls.TLS_TRANSPORT,)
        if "bulk_tls" in SETTINGS_BY_NAME:
            choices += (pool_tls.BULK_TLS_TRANSPORT,)
    return choices


def _transport_used(log: list[str]) -> str:
    for line in log:
        found = re.search(r'pool joined.* peer_transport=("[^"]*"|\S+)', line)
        if found:
            used = found.group(1).strip('"').split()[0]  # "bulk (nixl asked)": bulk
            return used + ("+tls" if " peer_tls=on" in line else "")
    return "grpc"


def _keys_owned(placement: Placement, owner: str, ns: str, prefix: str, count: int) -> list[bytes]:
    """``count`` keys of ``ns`` that ``owner`` owns."""
    keys: list[bytes] = []
    i = 0
    while len(keys) < count:
        key = f"{prefix}-{i:06d}".encode()
        if placement.owner(ns, key) == owner:
            keys.append(key)
        i += 1
    return keys


def tcp_ceiling(pool: Pool, options: Options) -> dict[str, Any]:
    """Node B sends to node A over plain TCP: the best of CEILING_RUNS."""
    lab = pool.lab
    if lab is not None:
        host = lab.nodes[0].address
        runs = [
            pool_ceiling.measure(
                host, 0, options.value_bytes, options.values,
                lambda argv: lab.command(0, argv), lambda argv: lab.command(1, argv),
            )
            for _ in range(CEILING_RUNS)
        ]  # fmt: skip
    else:
        runs = [
            pool_ceiling.measure(
                "127.0.0.1", 0, options.value_bytes, options.values, list, list
            )
            for _ in range(CEILING_RUNS)
        ]  # fmt: skip
    best = max(runs, key=lambda run: run["bytes_per_s"])
    return {**best, "runs_bytes_per_s": [run["bytes_per_s"] for run in runs]}


def _timed_gets(client: Client, ns: str, keys: list[bytes], first: int,
                value_bytes: int) -> tuple[list[float], int, int, int]:  # fmt: skip
    """Each get into one shared buffer: its seconds, bytes got, wrong bytes, misses."""
    buffer = client.buffer(value_bytes)
    seconds: list[float] = []
    moved = wrong = misses = 0
    for i, key in enumerate(keys):
        started = time.perf_counter()
        got = client.get_into(ns, key, buffer)
        seconds.append(time.perf_counter() - started)
        if got is None:
            misses += 1
            continue
        moved += got
        if bytes(buffer[:got]) != block_value(first + i, value_bytes):
            wrong += got
    return seconds, moved, wrong, misses


def _timed_batches(client: Client, ns: str, keys: list[bytes], first: int,
                   views: list[memoryview]) -> tuple[float, int, int, int]:  # fmt: skip
    """``keys`` read ``len(views)`` a call (``get_many_into``) into ``views``: the
    calls' seconds, bytes got, wrong bytes, misses (each value checked after
    its call's clock; key i holds ``block_value(first + i)``)."""
    size = len(views[0])
    seconds = 0.0
    moved = wrong = misses = 0
    for start in range(0, len(keys), len(views)):
        batch = keys[start : start + len(views)]
        into = views[: len(batch)]
        started = time.perf_counter()
        got = client.get_many_into(ns, batch, into)
        seconds += time.perf_counter() - started
        for i, (size_got, view) in enumerate(zip(got, into, strict=True)):
            if size_got is None:
                misses += 1
                continue
            moved += size_got
            if bytes(view[:size_got]) != block_value(first + start + i, size):
                wrong += size_got
    return seconds, moved, wrong, misses


def _views(client: Client, count: int, size: int) -> list[memoryview]:
    """``count`` buffers of ``size`` bytes, one after the other in one region."""
    region = client.buffer(count * size)
    return [region[i * size : (i + 1) * size] for i in range(count)]


def remote_chain(engine: Client, owner: Client, keys: list[bytes]) -> dict[str, Any]:
    """``keys`` (owned by ``owner``'s daemon, ``CHAIN_VALUES`` x 2 per round)
    read through ``engine``'s daemon one at a time and in one batch."""
    n, size = CHAIN_VALUES, CHAIN_VALUE_BYTES
    owner.put_many(CHAIN_NS, [(key, block_value(i, size)) for i, key in enumerate(keys)])
    views = _views(engine, n, size)
    single = batch = float("inf")
    wrong = misses = 0
    for round_ in range(CHAIN_ROUNDS):
        first = 2 * round_ * n
        seconds, _, wrong_one, misses_one = _timed_gets(
            engine, CHAIN_NS, keys[first : first + n], first, size
        )
        single = min(single, sum(seconds))
        wrong, misses = wrong + wrong_one, misses + misses_one
        first += n
        batch_s, _, wrong_batch, misses_batch = _timed_batches(
            engine, CHAIN_NS, keys[first : first + n], first, views
        )
        batch = min(batch, batch_s)
        wrong, misses = wrong + wrong_batch, misses + misses_batch
    return {
        "values": n,
        "value_bytes": size,
        "one_at_a_time_s": single,
        "batch_s": batch,
        "one_at_a_time_bytes_per_s": n * size / single,
        "batch_bytes_per_s": n * size / batch,
        "wrong_bytes": wrong,
        "misses": misses,
    }


def remote_get(root: Path, transport: str, options: Options, progress: Progress) -> dict[str, Any]:
    """Values owned by B read through A's daemon, after the TCP ceiling
    between the same two nodes; then the remote chain (``remote_chain``)."""
    if transport in pool_tls.TRANSPORTS:
        extra = pool_tls.member_flags(root / f"get-{transport}-files", transport)
    else:
        extra = ["--pool-peer-transport", transport] if transport else []
    chain_bytes = 2 * CHAIN_ROUNDS * CHAIN_VALUES * CHAIN_VALUE_BYTES
    batched = max(REMOTE_BATCH, REMOTE_BATCHED_PER_VALUE * options.values)
    warm_values = REMOTE_WARM_CALLS * REMOTE_BATCH
    gets = 1 + options.values + batched + warm_values
    puts = pool_puts.WARM_PUTS + options.values
    # B holds the values of the single and the batched gets and of the puts,
    # A a copy of each.
    dram = f"{(gets + puts) * options.value_bytes + chain_bytes * 2 + 64 * MiB}"
    max_value = str(max(options.value_bytes, MiB))
    with Pool(root / f"get-{transport or 'default'}", 2, extra, netns=options.netns,
              peer_timeout_ms=PEER_TIMEOUT_MS,
              dram=dram, max_value=max_value, ssd="") as pool:  # fmt: skip
        progress(f"pool: TCP ceiling between two nodes ({pool.where})")
        ceiling = tcp_ceiling(pool, options)
        a, b = pool.members
        used = _transport_used(a.running.log)
        progress(f"pool: remote get, transport {transport or 'default'} (daemon says {used})")
        ns = "bench-remote"
        keys = _keys_owned(pool.placement(), b.address, ns, "v", gets)
        after = 1 + options.values + batched  # the warm-up calls' keys come after the timed ones
        single_keys, batch_keys = keys[1 : options.values + 1], keys[options.values + 1 : after]
        with Client(b.socket_target, token=pool.token, timeout_s=CALL_TIMEOUT_S) as put:
            for i, key in enumerate(keys):
                put.put(ns, key, block_value(i, options.value_bytes))
        with Client(a.socket_target, token=pool.token, timeout_s=CALL_TIMEOUT_S) as engine:
            _timed_gets(engine, ns, keys[:1], 0, options.value_bytes)  # connections up
            remote, moved, wrong, misses = _timed_gets(engine, ns, single_keys, 1,
                                                       options.value_bytes)  # fmt: skip
            local, moved_local, wrong_local, _ = _timed_gets(
                engine, ns, single_keys, 1, options.value_bytes
            )
            views = _views(engine, REMOTE_BATCH, options.value_bytes)
            warm_s = [  # a call's connections up, their TCP windows grown
                _timed_batches(engine, ns, keys[at : at + REMOTE_BATCH], at, views)[0]
                for at in range(after, after + warm_values, REMOTE_BATCH)
            ]
            batched_s, moved_batched, wrong_batched, misses_batched = _timed_batches(
                engine, ns, batch_keys, options.values + 1, views
            )  # fmt: skip
            progress(f"pool: remote chain, transport {transport or 'default'}")
            chain_keys = _keys_owned(
                pool.placement(), b.address, CHAIN_NS, "c", 2 * CHAIN_ROUNDS * CHAIN_VALUES
            )
            with Client(b.socket_target, token=pool.token, timeout_s=CALL_TIMEOUT_S) as owner:
                chain = remote_chain(engine, owner, chain_keys)
        progress(f"pool: puts handed on, transport {transport or 'default'}")
        put_keys = _keys_owned(pool.placement(), b.address, ns, "h", puts)
        handed = pool_puts.handed_on(
            a, b, pool.token, ns, put_keys, options.value_bytes, CALL_TIMEOUT_S
        )
        return {
            "transport_asked": transport or "default",
            "transport_used": used,
            "where": pool.where,
            "values": options.values,
            "value_bytes": options.value_bytes,
            "bytes_per_s": moved / sum(remote),
            "get_p50_ms": float(np.percentile(remote, 50)) * 1e3,
            "get_p99_ms": float(np.percentile(remote, 99)) * 1e3,
            "local_bytes_per_s": moved_local / sum(local),
            "batch_values": REMOTE_BATCH,
            "batch_calls": -(-batched // REMOTE_BATCH),
            "batch_bytes_per_s": moved_batched / batched_s,
            "batch_warmup_s": warm_s,
            "tcp_ceiling": ceiling,
            "wrong_bytes": wrong
            + wrong_local
            + wrong_batched
            + chain["wrong_bytes"]
            + handed["wrong_bytes"],
            "misses": misses + misses_batched,
            "chain": chain,
            "handed_on": handed,
        }


def _replay(clients: list[Client], trace: Trace, block_bytes: int,
            progress: Progress) -> ReplayStats:  # fmt: skip
    """Request i through clients[i mod len], in trace order."""
    stats = ReplayStats()
    started = time.perf_counter()
    for index in range(len(trace)):
        _request(clients[index % len(clients)], "replay", trace, index, block_bytes, stats)
        if index and index % 2000 == 0:
            progress(f"pool: replay {index}/{len(trace)} requests")
    stats.elapsed_s = time.perf_counter() - started
    return stats


def hit_ratio(root: Path, trace: Trace, options: Options, progress: Progress) -> dict[str, Any]:
    """The trace over MEMBERS members of capacity C/MEMBERS each, and over one
    daemon of capacity C."""
    unique = len(set(trace.blocks.tolist()))
    per_member = max(1, int(unique * options.capacity_fraction) // MEMBERS)
    block_bytes = options.block_bytes
    member_dram = dram_bytes_for(per_member, block_bytes)
    capacity = MEMBERS * capacity_of(member_dram, block_bytes)
    max_value = str(max(block_bytes, 1024))
    progress(f"pool: replay of {len(trace)} requests over {MEMBERS} members, {capacity} blocks")
    with Pool(root / "replay", MEMBERS, netns=options.netns, dram=str(member_dram),
              peer_timeout_ms=PEER_TIMEOUT_MS,
              max_value=max_value, ssd="") as pool:  # fmt: skip
        clients = [Client(m.socket_target, token=pool.token, timeout_s=CALL_TIMEOUT_S)
                   for m in pool.members]  # fmt: skip
        try:
            spread = _replay(clients, trace, block_bytes, progress)
        finally:
            for client in clients:
                client.close()

        def total(name: str) -> float:
            return sum(member.metric(name) for member in pool.members)

        forwards = total("kvd_cluster_forwards_total")
        dropped = total("kvd_cluster_forwards_dropped_total")
        peer_errors = total("kvd_cluster_peer_errors_total")
        guests = total("kvd_guest_entries")
        plans = {
            "adopted": total("kvd_cluster_plans_adopted_total"),
            "refused": total("kvd_cluster_plans_refused_total"),
            "tells_dropped": total("kvd_cluster_tells_dropped_total"),
            "remote_misses": total("kvd_cluster_remote_misses_total"),
            "remote_hits": total("kvd_cluster_remote_hits_total"),
        }
        addresses = [m.address for m in pool.members]
        where = pool.where
    progress(f"pool: the same replay on one daemon of {capacity} blocks")
    single = root / "replay-single"
    single.mkdir(parents=True)
    token, auth = write_tokens(single)
    daemon = SpawnedDaemon(single, auth, dram=str(dram_bytes_for(capacity, block_bytes)),
                           max_value=max_value, ssd="")  # fmt: skip
    try:
        with Client(daemon.socket_target, token=token, timeout_s=CALL_TIMEOUT_S) as client:
            alone = _replay([client], trace, block_bytes, progress)
    finally:
        daemon.stop()
    # The simulator makes the single daemon's decisions (docs/replay.md): it
    # gives what one member alone would hit, and checks the measured single.
    simulated = {
        "policy": DEFAULT_POLICY,
        "single": simulate(trace, DEFAULT_POLICY, capacity).block_hit_ratio,
        "one_member_alone": simulate(trace, DEFAULT_POLICY, capacity // MEMBERS).block_hit_ratio,
        # The pool's decisions over the same members (kvd.tools.replay.pool_sim).
        "pool": simulate_pool(
            trace, DEFAULT_POLICY, addresses, capacity // MEMBERS
        ).block_hit_ratio,
        # The same without the members in step (each its own plan and clock).
        "pool_apart": simulate_pool(
            trace, DEFAULT_POLICY, addresses, capacity // MEMBERS, in_step=False
        ).block_hit_ratio,
    }
    return {
        "requests": len(trace),
        "unique_blocks": unique,
        "capacity_blocks": capacity,
        "capacity_fraction": capacity / unique,
        "block_bytes": block_bytes,
        "where": where,
        "forwards": forwards,
        "forwards_dropped": dropped,
        "peer_errors": peer_errors,
        "guests_at_end": guests,
        "plans": plans,
        "pool": spread.figures(),
        "single": alone.figures(),
        "simulated": simulated,
    }


def keys_moved(trace: Trace) -> dict[str, Any]:
    """The share of the trace's blocks whose owner changes when a fifth member
    joins four (and when one of five leaves)."""
    keys = [block_key(b) for b in sorted(set(trace.blocks.tolist()))]
    four = [f"10.77.0.{i + 1}:7400" for i in range(MEMBERS)]
    five = [*four, f"10.77.0.{MEMBERS + 1}:7400"]
    before = Placement(four).owners("replay", keys)
    after = Placement(five).owners("replay", keys)
    moved = sum(1 for x, y in zip(before, after, strict=True) if x != y)
    to_new = sum(1 for x, y in zip(before, after, strict=True) if x != y and y == five[-1])
    return {
        "keys": len(keys),
        "members_before": MEMBERS,
        "members_after": MEMBERS + 1,
        "moved": moved,
        "moved_fraction": moved / len(keys),
        "moved_to_the_new_member": to_new,
        "ideal_fraction": 1 / (MEMBERS + 1),
    }


def run(options: Options, root: Path, trace_path: Path, progress: Progress) -> dict[str, Any]:
    trace = head(load_trace(trace_path), options.requests)
    transports = options.transports or peer_transports()
    gets = [remote_get(root, t, options, progress) for t in transports]
    lookup = pool_lookup.run(
        root, options.chain_keys, options.lookups, options.lookup_pace_ms, options.netns, progress
    )
    ratio = hit_ratio(root, trace, options, progress)
    faults = pool_faults.run(root, options.netns, progress)
    join = pool_join.run(root, progress, options.join_chains)
    join_replay = pool_join_replay.run(
        root, trace, options.capacity_fraction, options.block_bytes, progress
    )
    leave_replay = pool_join_replay.run_leave(
        root, trace, options.capacity_fraction, options.block_bytes, progress
    )
    return {
        "trace": str(trace_path),
        "where": gets[0]["where"],
        "remote_get": gets,
        "lookup": lookup,
        "hit_ratio": ratio,
        "keys_moved": keys_moved(trace),
        "faults": faults,
        "join": join,
        "join_replay": join_replay,
        "leave_replay": leave_replay,
    }
