"""Data-path throughput: kvd over shared memory, bulk TCP and gRPC (and both
TCP paths again to a daemon with TLS on them: ``TLS_PATHS``), next to
the ceilings (numpy memcpy into pre-allocated memory, loopback TCP with
recv_into) and peers (Redis with the hiredis parser, Mooncake Store in TCP
mode) measured in the same run. The L2-cold gets come with their own
ceiling from the same run: fio random reads (io_uring, O_DIRECT) of each
size on the cold daemon's file system.

The ceilings are measured at the start and again at the end of the run,
and the higher figure is kept, so a ratio never rests on a ceiling caught in
a slow moment. Every kvd and Redis case runs ``clients`` client processes
(``kvd.tools.bench.procs``: one process per client, as engines run one per
worker), each with its own client and pre-allocated buffer, for
``CASE_SECONDS``, and reports aggregate GB/s. Ceilings and Mooncake run in
threads of this process. Gets
read values that are resident in L1 (written just before); puts write new
keys, so they include the daemon's write-back to L2 behind them. The peers
live in ``kvd.tools.bench.paths_peers`` and are handed to ``run``; a peer
that cannot start is reported as skipped with the reason.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvd.client import Client
from kvd.tools.bench.backends import fio_randread
from kvd.tools.bench.daemon import written_back
from kvd.tools.bench.hugetlb import fio_huge_buffers
from kvd.tools.bench.procs import (
    TLS_PATHS,
    Case,
    ClientProcesses,
    expect_size,
    kvd_client,
    value_bytes,
)

SIZES_BYTES = (64 << 10, 1 << 20, 4 << 20, 32 << 20)
CLIENTS = (1, 16)
# Values a batched get asks for in one call (``get_many_into``), as an
# engine loads a prefix's chunks; fewer when the fill holds fewer keys.
BATCH_VALUES = 8
# get-chain: one call of this many values, as an engine loads a prefix of
# 1,024 tokens in blocks of 16 (vLLM's default block), for values this small.
CHAIN_VALUES = 64
CHAIN_MAX_BYTES = 64 << 10
# Gets copied out of the daemon's L1 by the client (shm_pool_reads), checked
# against their checksums or not, after a frame each, or found through the
# pool's directory without one, checked or not: on a daemon of their own,
# whose L1 is shared memory.
POOL_PATHS = ("shm-pool", "shm-pool-trust", "shm-pool-direct", "shm-pool-direct-trust")
# Long enough to average a few hundred 64 KiB ops or a dozen 32 MiB ones on
# 2 cores; 100+ cases at this length keep a full run near 90 s.
CASE_SECONDS = 0.5
# Values written per size before the gets: enough distinct keys that a get
# does not hit one cache-hot value, few enough to stay far inside L1.
FILL_BYTES = 128 << 20

Progress = Callable[[str], None]
Op = Callable[[int], None]


class Peers(Protocol):
    """The peers a user would pick instead (``kvd.tools.bench.paths_peers``),
    handed to ``run``: rows measured beside kvd's, in the same client
    processes, and rows measured after them in this process."""

    def beside_kvd(
        self, sizes: tuple[int, ...], progress: Progress, procs: ClientProcesses
    ) -> list[Row]: ...

    def after_kvd(self, sizes: tuple[int, ...], progress: Progress) -> list[Row]: ...


@dataclass
class Row:
    path: str  # shm, bulk, grpc, memcpy, tcp, redis, mooncake
    op: str  # put, get, copy
    size_bytes: int
    clients: int
    gbps: float | None
    note: str = ""
    # The clients' and the server's CPU per value (µs), where both are known.
    cpu_us_per_value: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(size: int, workers: list[Op]) -> float:
    """Aggregate GB/s of ``workers`` (one thread each) calling their op for CASE_SECONDS."""
    counts = [0] * len(workers)
    errors: list[BaseException] = []
    warmed = threading.Barrier(len(workers) + 1)
    go = threading.Event()
    stop_at = [0.0]

    def loop(index: int, op: Op) -> None:
        try:
            op(0)  # warm-up: connections, first touches
            warmed.wait()
            go.wait()
            i = 1
            while time.perf_counter() < stop_at[0]:
                op(i)
                i += 1
            counts[index] = i - 1
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)
            warmed.abort()

    threads = [threading.Thread(target=loop, args=(i, op)) for i, op in enumerate(workers)]
    for thread in threads:
        thread.start()
    try:
        warmed.wait(timeout=60)
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    stop_at[0] = start + CASE_SECONDS
    go.set()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return size * sum(counts) / (time.perf_counter() - start) / 1e9


# ---- ceilings -------------------------------------------------------------------------
def memcpy_gbps(size: int) -> float:
    """Copies from as many distinct sources as the kvd gets read: caches do not help either."""
    count = fill_count(size)
    src = np.ones(size * count, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    return measure(
        size, [lambda i: np.copyto(dst, src[(i % count) * size : (i % count + 1) * size])]
    )


def bench_keys(prefix: str, count: int) -> tuple[bytes, ...]:
    """``count`` keys of 32 bytes, as engines' chained block hashes are: a
    batch of keys of one width is one frame (keys of different widths go
    item by item, or over gRPC)."""
    return tuple(hashlib.sha256(b"%s%d" % (prefix.encode(), i)).digest() for i in range(count))


def fill_count(size: int) -> int:
    return max(2, min(32, FILL_BYTES // size))


class LoopbackServer:
    """Sends a slot's bytes per 16-byte request (size, slot): like kvd's gets
    and the memcpy ceiling, a size is read from as many distinct sources as
    kvd holds values of it, so the sender's copy comes from memory, not from
    a cache that kvd's values would not fit in. (On the development VM the
    kernel's copy dominates: one hot source measured the same, 4.78 against
    4.66 GB/s at 4 MiB, medians of four.)"""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        total = max(size * fill_count(size) for size in sizes)
        self.data = np.ones(total, dtype=np.uint8).data  # every page touched
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while request := conn.recv(_REQUEST.size, socket.MSG_WAITALL):
                size, slot = _REQUEST.unpack(request)
                conn.sendall(self.data[slot * size : (slot + 1) * size])

    def close(self) -> None:
        self.listener.close()


_REQUEST = struct.Struct("<QQ")


def tcp_gbps(server: LoopbackServer, size: int, clients: int) -> float:
    socks: list[socket.socket] = []
    count = fill_count(size)

    def worker(index: int) -> Op:
        sock = socket.create_connection(("127.0.0.1", server.port))
        socks.append(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = memoryview(bytearray(size))

        def op(i: int) -> None:
            sock.sendall(_REQUEST.pack(size, (i + index) % count))
            pos = 0
            while pos < size:
                pos += sock.recv_into(buffer[pos:])

        return op

    try:
        return measure(size, [worker(index) for index in range(clients)])
    finally:
        for sock in socks:
            sock.close()


# ---- kvd ------------------------------------------------------------------------------
def kvd_rows(
    path: str,
    tcp_target: str,
    unix_target: str,
    size: int,
    progress: Progress,
    procs: ClientProcesses,
    server_pid: int = 0,
    ca_file: str = "",
) -> list[Row]:
    ns = f"bench-{path}-{size}"
    keys = bench_keys("v", fill_count(size))
    value = value_bytes(size)
    rows = []
    with kvd_client(path, tcp_target, unix_target, ca_file) as filler:
        buffer = filler.buffer(size)
        for clients in CLIENTS:
            # (Again) before each round: the previous round's puts may have
            # pushed these out of L1 and, past L2's size, out of kvd. A put of
            # a key L2 still holds changes nothing, so a get brings it back
            # into L1: the round then measures L1 gets, not promotions.
            for key in keys:
                filler.put(ns, key, value.data)
                expect_size(filler.get_into(ns, key, buffer), size)
            progress(f"paths: {path} {size_label(size)} x{clients}")
            # A pool read's put is a region put: the shm rows measure it.
            ops = ("get", "get-batch") if path in POOL_PATHS else ("get", "put", "get-batch")
            for op in ops:
                if op == "get-batch" and clients > 1:
                    continue
                batch = min(BATCH_VALUES, len(keys)) if op == "get-batch" else 1
                case = Case(
                    "kvd", op, size, keys, f"p{clients}", ns, path, tcp_target, unix_target,
                    batch=batch, ca_file=ca_file,
                )  # fmt: skip
                got = procs.measure(case, CASE_SECONDS, clients, server_pid)
                note = f"{batch} values a call" if batch > 1 else ""
                rows.append(Row(path, op, size, clients, got.gbps, note, got.cpu_us_per_value))
                if op == "put":
                    # Its write-back would count as the next case's CPU.
                    written_back(filler)
            if clients == 1 and size <= CHAIN_MAX_BYTES:
                chain = bench_keys("chain", CHAIN_VALUES)
                for key in chain:
                    filler.put(ns, key, value.data)
                case = Case(
                    "kvd", "get-chain", size, chain, "chain", ns, path, tcp_target, unix_target,
                    batch=CHAIN_VALUES, ca_file=ca_file,
                )  # fmt: skip
                written_back(filler)
                got = procs.measure(case, CASE_SECONDS, 1, server_pid)
                rows.append(Row(path, "get-chain", size, 1, got.gbps,
                                f"{CHAIN_VALUES} values a call", got.cpu_us_per_value))  # fmt: skip
        filler.delete_namespace(ns)
    return rows


# The L2-cold daemon's L1 and how much is written to it: three times L1, so
# the first two thirds of what was written live on L2 only, and each get of
# them reads the SSD (and no get is repeated).
COLD_DRAM = "64MiB"
COLD_DRAM_BYTES = 64 << 20
COLD_SSD = "1GiB"


def cold_rows(path: str, tcp_target: str, unix_target: str, size: int) -> list[Row]:
    """Single-client gets of values that are on L2 only (the daemon's L1 holds others)."""
    ns = f"cold-{path}-{size}"
    count = max(8, 3 * COLD_DRAM_BYTES // size)
    keys = list(bench_keys("c", count))
    value = value_bytes(size)
    with Client(tcp_target, timeout_s=120, shm=False, bulk=True) as filler:
        for key in keys:
            filler.put(ns, key, value.data)
        written_back(filler)
    cold = keys[: count * 2 // 3]
    with kvd_client(path, tcp_target, unix_target) as client:
        buffer = client.buffer(size)
        expect_size(client.get_into(ns, keys[-1], buffer), size)  # warm-up: connections, regions
        start = time.perf_counter()
        done = 0
        for key in cold:
            expect_size(client.get_into(ns, key, buffer), size)
            done += 1
            if time.perf_counter() - start > CASE_SECONDS:
                break
        gbps = size * done / (time.perf_counter() - start) / 1e9
        client.delete_namespace(ns)
        del buffer
    return [Row(path, "get-cold", size, 1, gbps, f"{done} L2 reads")]


# fio's file for the L2 ceiling: larger than any value, small enough to lay
# out in a second or two.
FIO_FILE_BYTES = 512 << 20
FIO_SECONDS = 2.0
FIO_DEPTHS = (1, 32)


def fio_rows(directory: str, sizes: tuple[int, ...], progress: Progress) -> list[Row]:
    """The ceiling of the L2-cold rows: fio io_uring O_DIRECT random reads of
    each size in ``directory`` (the cold daemon's file system), at queue depth
    1 (one read at a time, as one client's gets) and 32 (what the device gives),
    into huge pages as the daemon's L1 where they can be had (kvd.tools.bench.hugetlb)."""
    path = os.path.join(directory, "fio-ceiling")
    rows: list[Row] = []
    try:
        with fio_huge_buffers(max(FIO_DEPTHS) * max(sizes)) as buffers:
            for size in sizes:
                progress(f"paths: fio {size_label(size)}")
                for depth in FIO_DEPTHS:
                    gbps = fio_randread(
                        path,
                        block_bytes=size,
                        queue_depth=depth,
                        seconds=FIO_SECONDS,
                        file_bytes=max(FIO_FILE_BYTES, 2 * size),
                        extra=buffers.fio_args(),
                    )
                    note = "" if gbps is not None else "skipped: fio not installed"
                    if gbps is not None and buffers.why_not:
                        note = f"buffers on 4 KiB pages: {buffers.why_not}"
                    rows.append(Row("fio", f"read QD{depth}", size, 1, gbps, note))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rows


# ---- the run --------------------------------------------------------------------------
def run(
    tcp_target: str,
    unix_target: str,
    sizes: tuple[int, ...] = SIZES_BYTES,
    progress: Progress = print,
    peers: Peers | None = None,
    cold: tuple[str, str] | None = None,
    cold_dir: str | None = None,
    pooled: tuple[str, str] | None = None,
    server_pids: dict[str, int] | None = None,
    secure: tuple[str, str] | None = None,
) -> list[Row]:
    """Every path and ceiling; ``peers`` the peers' suite (Redis, Mooncake:
    ``kvd.tools.bench.paths_peers.PEERS``) or None; ``cold`` is a small-L1
    daemon's (tcp, unix) targets, ``cold_dir`` a directory on its file
    system for the fio ceiling, ``pooled`` a daemon's with pool reads on
    (``POOL_PATHS``); ``secure`` a daemon's with TLS on its gRPC listener and
    bulk port, (tcp target, CA file), for ``TLS_PATHS``; ``server_pids`` the
    daemons' process ids by tcp target, for their CPU per value."""
    pids = server_pids or {}
    rows = ceiling_rows(sizes, progress)
    progress(f"paths: starting {max(CLIENTS)} client processes")
    procs = ClientProcesses(max(CLIENTS))
    try:
        for path in ("shm", "bulk", "grpc"):
            for size in sizes:
                rows += kvd_rows(path, tcp_target, unix_target, size, progress, procs,
                                 pids.get(tcp_target, 0))  # fmt: skip
        if pooled is not None:
            for path in POOL_PATHS:
                for size in sizes:
                    rows += kvd_rows(path, pooled[0], pooled[1], size, progress, procs,
                                     pids.get(pooled[0], 0))  # fmt: skip
        if secure is not None:
            for path in TLS_PATHS:
                for size in sizes:
                    rows += kvd_rows(path, secure[0], "", size, progress, procs,
                                     pids.get(secure[0], 0), secure[1])  # fmt: skip
        if peers is not None:
            rows += peers.beside_kvd(sizes, progress, procs)
    finally:
        procs.close()
    if cold is not None:
        # The puts above leave the main daemon writing back to the same disk.
        with Client(tcp_target, timeout_s=60, shm=False, bulk=False) as main:
            written_back(main)
        for path in ("shm", "bulk", "grpc"):
            for size in sizes:
                progress(f"paths: {path} {size_label(size)} L2-cold")
                rows += cold_rows(path, cold[0], cold[1], size)
        if cold_dir is not None:
            rows += fio_rows(cold_dir, sizes, progress)
    if peers is not None:
        rows += peers.after_kvd(sizes, progress)
    # The ceilings again, keeping the higher figure: this machine's memory and
    # loopback speed drift within a run, and a ratio to a low ceiling flatters.
    again = {(r.path, r.size_bytes, r.clients): r for r in ceiling_rows(sizes, progress)}
    for row in rows:
        later = again.get((row.path, row.size_bytes, row.clients))
        if later is not None and row.gbps is not None and later.gbps is not None:
            row.gbps = max(row.gbps, later.gbps)
    return rows


def ceiling_rows(sizes: tuple[int, ...], progress: Progress) -> list[Row]:
    rows: list[Row] = []
    loopback = LoopbackServer(sizes)
    try:
        for size in sizes:
            progress(f"paths: ceilings {size_label(size)}")
            rows.append(Row("memcpy", "copy", size, 1, memcpy_gbps(size)))
            for clients in CLIENTS:
                rows.append(Row("tcp", "get", size, clients, tcp_gbps(loopback, size, clients)))
    finally:
        loopback.close()
    return rows


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def tls_daemon_args(where: Path, shm_dir: str) -> tuple[list[str], str]:
    """A daemon with TLS on its gRPC listener and its bulk port (``bulk_tls``):
    its flags, with a certificate for 127.0.0.1 a CA made for the run signed,
    and the CA's file (``TLS_PATHS``)."""
    from kvd.tools.bench.certs import write_run_files  # cryptography: test extras

    ca, cert, key = write_run_files(where, "kvd bench paths CA", "kvd-bench", ("127.0.0.1",))
    flags = [
        *bench_daemon_args(shm_dir), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--bulk-tls", "true",
    ]  # fmt: skip
    return flags, str(ca)


def bench_daemon_args(shm_dir: str) -> list[str]:
    # 16 clients each attach a staging region and a buffer region.
    return ["--shm-dir", shm_dir, "--max-regions-per-client", "64", "--max-regions", "256"]


def temp_shm_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvd-bench-", dir=base)
