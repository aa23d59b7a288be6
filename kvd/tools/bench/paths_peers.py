"""The peers of ``kvd bench paths``: what a user would pick instead of kvd.

Redis with the hiredis parser (a server process of its own, driven by the
suite's client processes like kvd's cases) and Mooncake Store in TCP mode
(its master and a process holding the segment, driven from threads of this
one). ``PEERS`` is what ``kvd.tools.bench.paths.run`` takes; a peer that
cannot start is reported as skipped with the reason. The suite's settings
(``CLIENTS``, ``CASE_SECONDS``, ``FILL_BYTES``) are read from
``kvd.tools.bench.paths`` when a case runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.bench import paths
from kvd.tools.bench.paths import Progress, Row, bench_keys, measure, size_label
from kvd.tools.bench.procs import Case, ClientProcesses, expect_size, value_bytes

START_TIMEOUT_S = 15.0


class _Peers:
    """Redis beside kvd's cases, Mooncake after them (``paths.Peers``)."""

    def beside_kvd(
        self, sizes: tuple[int, ...], progress: Progress, procs: ClientProcesses
    ) -> list[Row]:
        return redis_rows(sizes, progress, procs)

    def after_kvd(self, sizes: tuple[int, ...], progress: Progress) -> list[Row]:
        return mooncake_rows(sizes, progress)


PEERS = _Peers()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on port {port}")


def redis_rows(sizes: tuple[int, ...], progress: Progress, procs: ClientProcesses) -> list[Row]:
    server = shutil.which("redis-server")
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return _skipped("redis", sizes, "redis-py not installed (pip install 'kvd[bench]')")
    if server is None:
        return _skipped("redis", sizes, "redis-server not installed (apt install redis-server)")
    if not HIREDIS_AVAILABLE:
        return _skipped("redis", sizes, "hiredis parser not installed: not redis' best setup")
    port = _free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [server, *args, "--proto-max-bulk-len", "1gb"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows: list[Row] = []
    try:
        _wait_port(port, proc)
        for size in sizes:
            value = value_bytes(size).tobytes()
            keys = bench_keys("v", paths.fill_count(size))
            filler = redis.Redis(port=port)
            for key in keys:
                filler.set(key, value)
            for clients in paths.CLIENTS:
                progress(f"paths: redis {size_label(size)} x{clients}")
                for op in ("get", "put"):
                    case = Case("redis", op, size, keys, port=port)
                    got = procs.measure(case, paths.CASE_SECONDS, clients, proc.pid)
                    rows.append(Row("redis", op, size, clients, got.gbps, "",
                                    got.cpu_us_per_value))  # fmt: skip
            filler.flushall()
            filler.close()
    except (OSError, RuntimeError) as exc:
        return _skipped("redis", sizes, f"could not run: {exc}")
    finally:
        proc.terminate()
        proc.wait(10)
    return rows


_MOONCAKE_HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup(sys.argv[1], sys.argv[2], 1 << 30, 16 << 20, "tcp", "", sys.argv[3])
print("ready", rc, flush=True)
time.sleep(600)
"""


def mooncake_rows(sizes: tuple[int, ...], progress: Progress) -> list[Row]:
    """Mooncake Store, TCP transport: values live in another process's segment."""
    master = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return _skipped(
            "mooncake", sizes, "mooncake-transfer-engine-non-cuda not installed (kvd[bench])"
        )
    if not os.path.exists(master):
        return _skipped("mooncake", sizes, "mooncake_master not found")
    rpc_port, http_port = _free_port(), _free_port()
    metadata = f"http://127.0.0.1:{http_port}/metadata"
    master_addr = f"127.0.0.1:{rpc_port}"
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[Row] = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    master,
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={rpc_port}",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={http_port}",
                    f"--metrics_port={_free_port()}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait_port(rpc_port, procs[0])
        _wait_port(http_port, procs[0])
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _MOONCAKE_HOLDER,
                f"127.0.0.1:{_free_port()}",
                metadata,
                master_addr,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().split() != [b"ready", b"0"]:
            return _skipped("mooncake", sizes, "the segment holder did not start")
        store = MooncakeDistributedStore()
        rc = store.setup(
            f"127.0.0.1:{_free_port()}", metadata, 0, 256 << 20, "tcp", "", master_addr
        )
        if rc != 0:
            return _skipped("mooncake", sizes, f"setup returned {rc}")
        try:
            for size in sizes:
                progress(f"paths: mooncake {size_label(size)} x1")
                try:
                    rows += _mooncake_size(store, size)
                except (AssertionError, RuntimeError) as exc:
                    # One size failing (an object evicted under a get) is that
                    # size's rows, reported as skipped; the run goes on.
                    rows += _skipped("mooncake", (size,), f"failed: {exc}")
        finally:
            store.close()
    except (OSError, RuntimeError) as exc:
        return _skipped("mooncake", sizes, f"could not run: {exc}")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
    return rows


def _mooncake_size(store: Any, size: int) -> list[Row]:
    """Get and put GB/s of one value size; the previous sizes' objects removed
    first, so Mooncake's eviction never takes a value the gets read."""
    store.remove_all()
    src = value_bytes(size)
    dst = np.empty_like(src)
    for array in (src, dst):
        store.register_buffer(array.ctypes.data, size)
    try:
        keys = [f"v{size}-{i}" for i in range(max(2, min(8, paths.FILL_BYTES // size)))]
        for key in keys:
            store.put_from(key, src.ctypes.data, size)

        def get(i: int) -> None:
            expect_size(store.get_into(keys[i % len(keys)], dst.ctypes.data, size), size)

        def put(i: int) -> None:
            store.put_from(f"p{size}-{i}", src.ctypes.data, size)

        return [
            Row("mooncake", "get", size, 1, measure(size, [get])),
            Row("mooncake", "put", size, 1, measure(size, [put])),
        ]
    finally:
        for array in (src, dst):
            store.unregister_buffer(array.ctypes.data)


def _skipped(path: str, sizes: tuple[int, ...], reason: str) -> list[Row]:
    return [
        Row(path, op, size, 1, None, f"skipped: {reason}")
        for size in sizes
        for op in ("get", "put")
    ]
