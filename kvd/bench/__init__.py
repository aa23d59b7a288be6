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


def _progress(text: str) -> None:
    print(f"kvd bench: {text}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import os

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "kvd": __version__,
    }


def write_results(suite: str, data: dict[str, Any], table: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out_dir / f"{stamp}-{suite}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(table + "\n")
    return path


def _grpc(args: argparse.Namespace) -> int:
    from kvd.bench import grpc_path
    from kvd.bench.daemon import SpawnedDaemon

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvd bench", description=__doc__)
    parser.add_argument("--out", default=str(RESULTS_DIR), help="results directory")
    sub = parser.add_subparsers(dest="suite")
    grpc_cmd = sub.add_parser("grpc", help="gRPC Put/Get next to a plain echo and memcpy")
    grpc_cmd.add_argument("--target", default="", help="a running daemon (default: start one)")
    grpc_cmd.add_argument("--sizes", nargs="*", help="value sizes in bytes")
    from kvd.replay import report as replay_report

    replay_report.add_arguments(sub.add_parser("replay", help="replay a request trace"))
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.suite in (None, "grpc"):
        if args.suite is None:
            args.target, args.sizes = "", None
        return _grpc(args)
    if args.suite == "replay":
        return replay_report.main(args, Path(args.out), _progress)
    parser.error(f"unknown suite {args.suite}")
