"""``kvd bench``: measurements against the physical ceilings and peers.

Each suite starts what it measures (a kvd daemon in a child process unless
``--target`` names a running one) and reports every figure as a ratio to a
ceiling measured in the same run. Results go to ``bench/results/`` as JSON
and markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvd import __version__

RESULTS_DIR = Path("bench/results")
# The conversation trace beside the checkout (shared/traces/), for multi-turn runs.
CONVERSATION_TRACE = (
    Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)


def _progress(text: str) -> None:
    print(f"kvd bench: {text}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import os

    from kvd.util.hugepages import shmem_mode

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "kvd": __version__,
        # Shared memory (the pool with pool reads, regions) gets huge pages by it.
        "shmem_huge_pages": shmem_mode(),
    }


def write_results(suite: str, data: dict[str, Any], table: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out_dir / f"{stamp}-{suite}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(table + "\n")
    return path


def _grpc(args: argparse.Namespace) -> int:
    from kvd.tools.bench import grpc_path
    from kvd.tools.bench.daemon import SpawnedDaemon

    sizes = tuple(int(s) for s in args.sizes) if args.sizes else grpc_path.SIZES_BYTES
    daemon = None
    target = args.target
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        if not target:
            daemon = SpawnedDaemon(Path(tmp), [], dram="1GiB", max_value="48MiB", ssd="1GiB")
            target = daemon.target
        try:
            rows = grpc_path.run(target, sizes, _progress)
        finally:
            if daemon is not None:
                daemon.stop()
    table = grpc_path.markdown(rows)
    data = {"suite": "grpc", "machine": machine(), "rows": [r.as_dict() for r in rows]}
    path = write_results("grpc", data, table, Path(args.out))
    print(table)
    print(f"\nraw: {path}")
    return 0


def _l2(args: argparse.Namespace) -> int:
    from kvd.config.sizes import parse_size
    from kvd.tools.bench import l2_read, ramdisk

    options = {
        "blocks_bytes": [parse_size(s) for s in args.sizes] or l2_read.BLOCKS_BYTES,
        "depths": args.depths or l2_read.DEPTHS,
        "read_paths": args.paths or l2_read.READ_PATHS,
        "seconds": args.seconds,
    }
    rows = []
    if args.ramdisk:
        read_bps = parse_size(args.ramdisk_read_bps) if args.ramdisk_read_bps else 0
        for count in args.ramdisk_count:
            with ramdisk.ramdisks(count, parse_size(args.ramdisk), args.ramdisk_fs,
                                  read_bps) as made:  # fmt: skip
                on_fs = args.ramdisk_fs != "none"
                target = l2_read.Target.of(made if on_fs else [], [] if on_fs else made)
                _progress(f"ramdisks: {', '.join(made)}")
                rows += l2_read.run(target, _progress, **options)
    else:
        rows = l2_read.run(l2_read.Target.of([args.dir], args.device), _progress, **options)
    table = l2_read.markdown(rows)
    data = {"suite": "l2", "machine": machine(), "rows": [r.as_dict() for r in rows]}
    path = write_results("l2", data, table, Path(args.out))
    print(table)
    print(f"\nraw: {path}")
    return 0


def _paths(args: argparse.Namespace) -> int:
    if not args.shmem_huge_pages:
        return _paths_run(args)
    from kvd.tools.bench.shmem import shmem_huge_pages

    with shmem_huge_pages(args.shmem_huge_pages) as old:
        _progress(f"shmem huge pages: {args.shmem_huge_pages} for the run ({old} after)")
        return _paths_run(args)


def _paths_run(args: argparse.Namespace) -> int:
    import shutil

    from kvd.tools.bench import paths, paths_peers, paths_report, pool_tls
    from kvd.tools.bench.daemon import SpawnedDaemon

    sizes = tuple(int(s) for s in args.sizes) if args.sizes else paths.SIZES_BYTES
    daemon = None
    # Each daemon its own shm directory: the shm socket lives there, one per daemon.
    shm_dir, cold_shm_dir, pool_shm_dir, tls_shm_dir = (paths.temp_shm_dir() for _ in range(4))
    tcp_target, unix_target = args.target, args.socket_target
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        cold_daemon = pool_daemon = tls_daemon = None
        ca_file = ""
        if not tcp_target:
            daemon = SpawnedDaemon(
                Path(tmp), paths.bench_daemon_args(shm_dir), dram="2GiB", max_value="32MiB",
                ssd="4GiB", segment="256MiB",
            )  # fmt: skip
            tcp_target, unix_target = daemon.target, daemon.socket_target
            (Path(tmp) / "cold").mkdir()
            cold_daemon = SpawnedDaemon(
                Path(tmp) / "cold", paths.bench_daemon_args(cold_shm_dir), dram=paths.COLD_DRAM,
                max_value="32MiB", ssd=paths.COLD_SSD,
            )  # fmt: skip
            (Path(tmp) / "pool").mkdir()
            pool_daemon = SpawnedDaemon(
                Path(tmp) / "pool", [*paths.bench_daemon_args(pool_shm_dir), "--shm-pool-reads",
                "true"], dram="2GiB", max_value="32MiB", ssd="",
            )  # fmt: skip
            if pool_tls.available():  # certificates can be made here
                (Path(tmp) / "tls").mkdir()
                flags, ca_file = paths.tls_daemon_args(Path(tmp) / "tls", tls_shm_dir)
                tls_daemon = SpawnedDaemon(
                    Path(tmp) / "tls", flags, dram="2GiB", max_value="32MiB", ssd=""
                )
        try:
            cold = (cold_daemon.target, cold_daemon.socket_target) if cold_daemon else None
            pooled = (pool_daemon.target, pool_daemon.socket_target) if pool_daemon else None
            secure = (tls_daemon.target, ca_file) if tls_daemon else None
            spawned = (daemon, pool_daemon, tls_daemon)
            pids = {d.target: d.proc.pid for d in spawned if d is not None}
            rows = paths.run(
                tcp_target, unix_target, sizes, _progress,
                peers=None if args.no_peers else paths_peers.PEERS, cold=cold,
                cold_dir=str(Path(tmp) / "cold") if cold_daemon else None, pooled=pooled,
                server_pids=pids, secure=secure,
            )  # fmt: skip
        finally:
            for spawned_daemon in (daemon, cold_daemon, pool_daemon, tls_daemon):
                if spawned_daemon is not None:
                    spawned_daemon.stop()
            for directory in (shm_dir, cold_shm_dir, pool_shm_dir, tls_shm_dir):
                shutil.rmtree(directory, ignore_errors=True)
    table = paths_report.markdown(rows)
    data = {
        "suite": "paths",
        "machine": machine(),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [r.as_dict() for r in rows],
        "targets": paths_report.ratios(rows),
    }
    path = write_results("paths", data, table, Path(args.out))
    drawn = paths_report.chart(rows, path.with_suffix(".png"))
    print(table)
    print(f"\nraw: {path}" + (f"\nchart: {path.with_suffix('.png')}" if drawn else ""))
    return 0


def _engine(args: argparse.Namespace) -> int:
    from kvd.tools.bench import engine

    sizes = engine.PROMPT_TOKENS
    if args.prompt_tokens:
        sizes = tuple(int(s) for s in args.prompt_tokens)
    started = time.perf_counter()
    rows = engine.run(sizes, args.repeats, _progress)
    table = engine.markdown(rows)
    data: dict[str, Any] = {"suite": "engine", "machine": machine(), **engine.results(rows)}
    trace = Path(args.trace) if args.trace else None
    if trace is not None and trace.exists() and args.turns > 0:
        from kvd.tools.bench import engine_turns
        from kvd.tools.bench.engine_proc import find_engine_env

        try:
            with tempfile.TemporaryDirectory(prefix="kvd-bench-turns-") as tmp:
                turns = engine_turns.run(find_engine_env(), trace, Path(tmp), args.turns, _progress)
        except (RuntimeError, OSError) as exc:  # the rows above are kept and written
            reason = engine.root_cause(str(exc))
            table += f"\n\nMulti-turn ({trace.name}): failed: {reason}"
            data["turns"] = {"trace": str(trace), "failed": reason}
        else:
            table += f"\n\nMulti-turn ({trace.name}):\n\n" + engine_turns.markdown(turns)
            data["turns"] = {"trace": str(trace), "rows": [row.as_dict() for row in turns]}
    data["seconds"] = round(time.perf_counter() - started, 1)
    path = write_results("engine", data, table, Path(args.out))
    print(table)
    print(f"\nraw: {path}")
    return 0


def _pool(args: argparse.Namespace) -> int:
    from kvd.config.sizes import parse_size
    from kvd.tools.bench import pool, pool_report

    options = pool.Options(
        values=args.values, value_bytes=parse_size(args.value_bytes), chain_keys=args.chain_keys,
        lookups=args.lookups, lookup_pace_ms=args.lookup_pace_ms, requests=args.requests,
        capacity_fraction=args.capacity_fraction, netns=not args.loopback,
        transports=tuple(args.transports), join_chains=args.join_chains,
    )  # fmt: skip
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvd-bench-pool-") as tmp:
        result = pool.run(options, Path(tmp), Path(args.trace), _progress)
    if result["where"] != "network namespaces":
        _progress(f"pool: members ran on {result['where']}, not in network namespaces")
    rows = pool_report.targets(result)
    table = pool_report.markdown(result, rows)
    data = {
        "suite": "pool",
        "machine": machine(),
        "seconds": round(time.perf_counter() - started, 1),
        **result,
        "targets": rows,
    }
    path = write_results("pool", data, table, Path(args.out))
    print(table)
    print(f"\nraw: {path}")
    return 0


def _lookup(args: argparse.Namespace) -> int:
    from kvd.tools.bench import lookup

    started = time.perf_counter()
    chain_keys = tuple(args.keys) if args.keys else lookup.CHAIN_KEYS
    rows = lookup.run(_progress, chain_keys, tuple(args.paths) or lookup.PATHS)
    table = lookup.markdown(rows)
    data = {
        "suite": "lookup",
        "machine": machine(),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [r.as_dict() for r in rows],
        "targets": lookup.targets(rows),
    }
    path = write_results("lookup", data, table, Path(args.out))
    print(table)
    print(f"\nraw: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd bench", description=__doc__)
    parser.add_argument("--out", default=str(RESULTS_DIR), help="results directory")
    sub = parser.add_subparsers(dest="suite")
    grpc_cmd = sub.add_parser("grpc", help="gRPC Put/Get next to a plain echo and memcpy")
    grpc_cmd.add_argument("--target", default="", help="a running daemon (default: start one)")
    grpc_cmd.add_argument("--sizes", nargs="*", help="value sizes in bytes")
    l2_cmd = sub.add_parser("l2", help="L2 cold reads next to fio on the same device")
    l2_cmd.add_argument("--dir", default="kvd-bench-data", help="work directory on the SSD")
    l2_cmd.add_argument(
        "--device",
        action="append",
        default=[],
        help="a block device to read (repeat to stripe); ITS DATA IS OVERWRITTEN",
    )
    l2_cmd.add_argument(
        "--ramdisk",
        default="",
        metavar="SIZE",
        help="make RAM-backed loop devices of SIZE (e.g. 2GiB) for the run (root)",
    )
    l2_cmd.add_argument(
        "--ramdisk-count",
        nargs="+",
        type=int,
        default=[1],
        help="how many (striped); several counts run one after the other (1 2 4)",
    )
    l2_cmd.add_argument(
        "--ramdisk-read-bps",
        default="",
        metavar="SIZE",
        help="cap each ramdisk's reads at SIZE a second (e.g. 1GiB), as each SSD of a "
        "RAID0 has its own bandwidth, so striping shows; fio runs under the same cap",
    )
    l2_cmd.add_argument(
        "--ramdisk-fs",
        default="none",
        choices=("none", "ext4"),
        help="read the loop devices raw, or a file on ext4 on each",
    )
    l2_cmd.add_argument("--sizes", nargs="*", default=[], help="block sizes (64KiB 1MiB 4MiB)")
    l2_cmd.add_argument("--depths", nargs="*", type=int, default=[], help="queue depths (1 8 32)")
    l2_cmd.add_argument(
        "--paths",
        nargs="*",
        default=[],
        choices=("store", "tier", "batch", "store-batch"),
        help="read paths: the store's get, L2Tier.read, L2Tier.read_many, "
        "the store's batched get (all)",
    )
    l2_cmd.add_argument("--seconds", type=float, default=2.0, help="seconds per case")
    from kvd.tools.replay import report as replay_report

    replay_report.add_arguments(sub.add_parser("replay", help="replay a request trace"))
    paths_cmd = sub.add_parser(
        "paths", help="shm, bulk TCP and gRPC next to memcpy, loopback TCP, Redis, Mooncake"
    )
    paths_cmd.add_argument("--target", default="", help="a running daemon's gRPC host:port")
    paths_cmd.add_argument("--socket-target", default="", help="its unix:///path (shm path)")
    paths_cmd.add_argument("--sizes", nargs="*", help="value sizes in bytes")
    paths_cmd.add_argument("--no-peers", action="store_true", help="skip Redis and Mooncake")
    paths_cmd.add_argument(
        "--shmem-huge-pages",
        default="",
        choices=("", "advise", "always", "within_size", "never"),
        help="set the kernel's shmem huge-page mode for the run, then put it back (root): "
        "shared memory on 4 KiB pages copies at ~0.8x memcpy",
    )
    lookup_cmd = sub.add_parser(
        "lookup", help="chain lookups (1, 1,000, 10,000 keys) over the shm socket and gRPC"
    )
    lookup_cmd.add_argument("--keys", nargs="*", type=int, help="chain lengths")
    lookup_cmd.add_argument(
        "--paths",
        nargs="*",
        default=[],
        choices=("shm-socket", "shm-burst", "grpc-unix", "grpc-tcp"),
    )
    engine_cmd = sub.add_parser(
        "engine", help="TTFT through a real vLLM: recompute, its prefix cache, kvd L1/L2, peers"
    )
    engine_cmd.add_argument("--prompt-tokens", nargs="*", help="prompt sizes (tokens)")
    engine_cmd.add_argument("--repeats", type=int, default=3, help="timed restores per figure")
    engine_cmd.add_argument(
        "--trace",
        default=str(
            Path(__file__).resolve().parents[4] / "shared/traces/mooncake_conversation_trace.jsonl"
        ),
        help="conversation trace for the multi-turn run",
    )
    engine_cmd.add_argument("--turns", type=int, default=24, help="multi-turn requests; 0: none")
    pool_cmd = sub.add_parser(
        "pool", help="the pool across nodes: remote gets, hit ratio, placement, chain lookups"
    )
    pool_cmd.add_argument("--values", type=int, default=32, help="values read from a peer")
    pool_cmd.add_argument("--value-bytes", default="4MiB", help="size of each")
    pool_cmd.add_argument("--chain-keys", type=int, default=1000, help="keys of the chain")
    pool_cmd.add_argument("--lookups", type=int, default=200, help="timed lookups of it")
    pool_cmd.add_argument(
        "--lookup-pace-ms", type=float, default=0.0,
        help="time between timed lookups, as an engine's scheduler steps (0: back to back)",
    )  # fmt: skip
    pool_cmd.add_argument("--trace", default=str(CONVERSATION_TRACE), help="trace to replay")
    pool_cmd.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    pool_cmd.add_argument(
        "--capacity-fraction", type=float, default=0.05,
        help="total L1 as a share of the trace's unique blocks",
    )  # fmt: skip
    pool_cmd.add_argument(
        "--transports", nargs="*", default=[], help="peer transports (default: every one)"
    )
    pool_cmd.add_argument(
        "--loopback", action="store_true", help="members on loopback, not in network namespaces"
    )
    pool_cmd.add_argument(
        "--join-chains", type=int, default=256,
        help="chains of 64 values of 64 KiB held when a fifth member joins (etcd)",
    )  # fmt: skip
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.suite == "pool":
        if args.lookup_pace_ms < 0:
            parser.error(f"--lookup-pace-ms must be 0 or more, got {args.lookup_pace_ms:g}")
        if args.join_chains < 1:
            parser.error(f"--join-chains must be 1 or more, got {args.join_chains}")
        return _pool(args)
    if args.suite == "engine":
        return _engine(args)
    if args.suite == "lookup":
        return _lookup(args)
    if args.suite == "paths":
        return _paths(args)
    if args.suite in (None, "grpc"):
        if args.suite is None:
            args.target, args.sizes = "", None
        return _grpc(args)
    if args.suite == "l2":
        return _l2(args)
    if args.suite == "replay":
        return replay_report.main(args, Path(args.out), _progress)
    parser.error(f"unknown suite {args.suite}")
