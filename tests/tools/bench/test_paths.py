"""A tiny `kvd bench paths` run: every kvd path and ceiling produces a number,
each kvd case its CPU per value, and the results land as JSON and markdown
(peers left out: they are optional)."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from kvd.tools.bench import main, paths
from kvd.tools.bench.procs import TLS_PATHS


def test_paths_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "CASE_SECONDS", 0.05)
    monkeypatch.setattr(paths, "CLIENTS", (1, 2))
    monkeypatch.setattr(paths, "FILL_BYTES", 1 << 20)
    monkeypatch.setattr(paths, "FIO_FILE_BYTES", 16 << 20)
    monkeypatch.setattr(paths, "FIO_SECONDS", 1.0)
    assert main(["--out", str(tmp_path), "paths", "--sizes", "65536", "--no-peers"]) == 0
    [result] = tmp_path.glob("*-paths.json")
    data = json.loads(result.read_text())
    measured = {(r["path"], r["op"], r["clients"]): r["gbps"] for r in data["rows"]}
    for path in ("shm", "bulk", "grpc"):
        for op in ("get", "put"):
            for clients in (1, 2):
                assert measured[(path, op, clients)] > 0
        assert measured[(path, "get-batch", 1)] > 0  # get_many_into of 8 values a call
        assert measured[(path, "get-chain", 1)] > 0  # of 64: an engine's prefix
        assert measured[(path, "get-cold", 1)] > 0  # values only on L2
    for path in paths.POOL_PATHS:  # gets the client copies out of the daemon's L1
        assert measured[(path, "get", 1)] > 0 and measured[(path, "get", 2)] > 0
        assert measured[(path, "get-batch", 1)] > 0 and measured[(path, "get-chain", 1)] > 0
        assert (path, "put", 1) not in measured
    for path in TLS_PATHS:  # a daemon with TLS on its gRPC listener and bulk port
        for op in ("get", "put"):
            assert measured[(path, op, 1)] > 0 and measured[(path, op, 2)] > 0
        assert measured[(path, "get-batch", 1)] > 0 and measured[(path, "get-chain", 1)] > 0
    assert measured[("memcpy", "copy", 1)] > 0 and measured[("tcp", "get", 1)] > 0
    # The L2-cold rows' ceiling, from the same run on the cold daemon's file system.
    for depth in paths.FIO_DEPTHS:
        fio = measured[("fio", f"read QD{depth}", 1)]
        assert fio is None if shutil.which("fio") is None else fio > 0
    assert "| shm | get | 1 |" in result.with_suffix(".md").read_text()
    # CPU per value, the clients' and the daemon's, for every kvd case with one
    # client (a daemon's threads' schedstat; a get costs more than nothing).
    cpu = {(r["path"], r["op"], r["clients"]): r["cpu_us_per_value"] for r in data["rows"]}
    for path in ("shm", "bulk", "grpc", *paths.POOL_PATHS, *TLS_PATHS):
        assert cpu[(path, "get", 1)] > 0 and cpu[(path, "get-chain", 1)] > 0
    assert cpu[("memcpy", "copy", 1)] is None
    assert "CPU per value" in result.with_suffix(".md").read_text()
    assert {t["target"] for t in data["targets"]} >= {
        "bulk get 4 MiB / loopback TCP",
        "shm get-batch 4 MiB / memcpy",
        "shm get-cold 4 MiB / fio QD1",
        "shm-pool get 64 KiB / redis get",
        "shm-pool-trust get-batch 64 KiB / memcpy",
        "shm-pool get-chain 64 KiB / memcpy",
    }
    # The chart, both panels, where matplotlib (the bench extra) is installed.
    assert result.with_suffix(".png").exists() == (find_spec("matplotlib") is not None)


def test_a_process_cpu_time_counts_every_thread() -> None:
    """``process_cpu_ns`` sums the scheduler's clock over a process's live
    threads (a daemon's are), so a thread that burns CPU shows; a process
    that is gone is None."""
    import os
    import threading
    import time

    from kvd.tools.bench.procs import process_cpu_ns

    spun, leave = threading.Event(), threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        spun.set()
        leave.wait(10)

    before = process_cpu_ns(os.getpid())
    assert before is not None
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(10)
        after = process_cpu_ns(os.getpid())
    finally:
        leave.set()
        thread.join()
    assert after is not None and after - before >= 40_000_000  # its 50 ms, less clock
    assert process_cpu_ns(2**22 + 12345) is None  # no such process
