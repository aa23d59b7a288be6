"""Client processes for the many-client cases of ``kvd bench paths``.

Sixteen client threads in one Python process measure that process's GIL
more than the server: each op hands the GIL over a few times, and 16
threads turn that into futex traffic (measured: 1 ms of client CPU per 4 MiB
shared-memory get with 16 threads, 0.09 ms with one). Engines run one
process per worker, so the many-client cases run one client per process: a
pool started once (spawn, so no gRPC state is inherited) and reused for
every case. Each case: every process builds its client and buffer, reports
ready, then all run the op from one start time for the same seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.client import Client, Tls


@dataclass(frozen=True)
class Measured:
    """One case: aggregate GB/s, the values moved, and the CPU the clients
    (all threads, user and kernel) and the server (when known) spent."""

    gbps: float
    values: int
    client_cpu_s: float
    server_cpu_s: float | None

    @property
    def cpu_us_per_value(self) -> float | None:
        """Clients' and server's CPU per value moved: what one get or put
        costs the machine, which other load on it moves far less than GB/s."""
        if self.server_cpu_s is None or not self.values:
            return None
        return (self.client_cpu_s + self.server_cpu_s) / self.values * 1e6


def process_cpu_ns(pid: int) -> int | None:
    """CPU time of every live thread of ``pid`` so far, in ns (``schedstat``:
    the scheduler's own clock, not /proc/PID/stat's 10 ms ticks; a daemon's
    threads live as long as it does); None when the process is gone."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                    total += int(stat.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
    except OSError:
        return None
    return total


# Building 16 clients (a gRPC channel, DescribePaths, two regions each) on 2
# busy cores takes a few seconds; a process that says nothing for this long
# is broken.
REPORT_TIMEOUT_S = 120.0
START_DELAY_S = 0.2


@dataclass(frozen=True)
class Case:
    kind: str  # "kvd" or "redis"
    # "get", "put", "get-batch" or "get-chain" (kvd: get_many_into of ``batch`` values a call)
    op: str
    size: int
    keys: tuple[bytes, ...] = ()  # what gets read (written before the case)
    tag: str = ""  # makes put keys unique to the case
    ns: str = ""
    path: str = ""  # kvd: shm, bulk, grpc
    tcp_target: str = ""
    unix_target: str = ""
    port: int = 0  # redis
    batch: int = 1  # kvd get-batch: values a call
    ca_file: str = ""  # kvd bulk+tls, grpc+tls: the CA the daemon's certificate checks against


# What each measured path must really use: a figure taken on a fallback
# (region ops over gRPC, gRPC instead of bulk) would be reported under the
# wrong name.
# shm-pool: gets copied out of the daemon's L1 by the client, each copy
# checked against its checksum, after a POOL_GET frame; shm-pool-trust: the
# same, unchecked; shm-pool-direct: found in the pool's directory and copied
# without a frame (checked); shm-pool-direct-trust: the same, unchecked (the
# owner tags alone tell a copy of reused pages).
_EXPECTED_PATHS = {
    "shm": {"shm", "shm-socket"},
    "shm-pool": {"shm", "shm-socket", "shm-pool"},
    "shm-pool-trust": {"shm", "shm-socket", "shm-pool"},
    "shm-pool-direct": {"shm", "shm-socket", "shm-pool", "shm-pool-direct"},
    "shm-pool-direct-trust": {"shm", "shm-socket", "shm-pool", "shm-pool-direct"},
    "bulk": {"bulk"},
    "grpc": set(),
    "bulk+tls": {"bulk"},
    "grpc+tls": set(),
}
# Paths to a daemon with TLS on its gRPC listener and bulk port (bulk_tls).
TLS_PATHS = ("bulk+tls", "grpc+tls")


def kvd_client(path: str, tcp_target: str, unix_target: str, ca_file: str = "") -> Client:
    """A client of ``path``; ``ca_file`` for the TLS paths (``TLS_PATHS``)."""
    if path in TLS_PATHS:
        tls = Tls(ca_file=ca_file)
        client = Client(tcp_target, timeout_s=60, shm=False, bulk=path == "bulk+tls", tls=tls)
    elif path == "shm":
        client = Client(unix_target, timeout_s=60, pool_reads=False)
    elif path.startswith("shm-pool-direct"):
        client = Client(unix_target, timeout_s=60, verify_pool_reads=path == "shm-pool-direct")
    elif path.startswith("shm-pool"):
        client = Client(
            unix_target,
            timeout_s=60,
            verify_pool_reads=path == "shm-pool",
            direct_pool_reads=False,
        )
    else:
        client = Client(tcp_target, timeout_s=60, shm=False, bulk=path == "bulk")
    if client.paths != _EXPECTED_PATHS[path]:
        client.close()
        raise RuntimeError(f"{path} client uses {sorted(client.paths)}, not the {path} path")
    return client


def expect_size(got: object, size: int) -> None:
    assert got == size, f"get returned {got}, expected {size}"


def value_bytes(size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)


class ClientProcesses:
    """``count`` worker processes; ``measure`` runs a case on all of them."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.count = count
        self._inboxes: list[Any] = [ctx.Queue() for _ in range(count)]
        self._outbox: Any = ctx.Queue()
        self._procs = [
            ctx.Process(target=_serve, args=(i, inbox, self._outbox), daemon=True)
            for i, inbox in enumerate(self._inboxes)
        ]
        for proc in self._procs:
            proc.start()

    def measure(self, case: Case, seconds: float, clients: int, server_pid: int = 0) -> Measured:
        """``clients`` processes running ``case`` at once: aggregate GB/s, and
        CPU per value (the clients', and the server's when ``server_pid``)."""
        assert 1 <= clients <= self.count, "more clients than processes"
        inboxes = self._inboxes[:clients]
        for inbox in inboxes:
            inbox.put(case)
        ready = self._collect("ready", clients)
        failed = [value for kind, value in ready if kind == "error"]
        start = time.time() + START_DELAY_S
        for inbox in inboxes:
            inbox.put(None if failed else (start, seconds))
        if failed:
            raise RuntimeError(f"a client process failed: {failed[0]}")
        server_before = process_cpu_ns(server_pid) if server_pid else None
        done = self._collect("done", clients)
        server_after = process_cpu_ns(server_pid) if server_pid else None
        failed = [value for kind, value in done if kind == "error"]
        if failed:
            raise RuntimeError(f"a client process failed: {failed[0]}")
        values = case.batch * sum(int(value[0]) for _, value in done)
        client_cpu_s = sum(float(value[1]) for _, value in done)
        server_cpu_s = None
        if server_before is not None and server_after is not None:
            # The server's CPU from just before the start to the last report:
            # the start delay and the reports' wait add a little idle time.
            server_cpu_s = (server_after - server_before) / 1e9
        return Measured(case.size * values / seconds / 1e9, values, client_cpu_s, server_cpu_s)

    def _collect(self, phase: str, clients: int) -> list[tuple[str, Any]]:
        """One message from each running process (its phase's, or an error)."""
        got = []
        for _ in range(clients):
            try:
                kind, _, value = self._outbox.get(timeout=REPORT_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"client processes did not report {phase}") from None
            got.append((kind, value))
        return got

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _serve(index: int, inbox: Any, outbox: Any) -> None:
    while True:
        case = inbox.get()
        if case is None:
            return
        try:
            op, close = _prepare(case, index)
        except Exception as exc:  # reported to the parent, which reports the case failed
            outbox.put(("error", index, repr(exc)))
            inbox.get()  # the parent's answer to a failed ready phase: skip
            continue
        try:
            outbox.put(("ready", index, 0))
            go = inbox.get()
            if go is None:
                continue
            start, seconds = go
            while time.time() < start:
                time.sleep(0.001)
            count, stop = 0, start + seconds
            cpu_s = time.process_time()
            while time.time() < stop:
                op(count)
                count += 1
            outbox.put(("done", index, (count, time.process_time() - cpu_s)))
        except Exception as exc:  # as above
            outbox.put(("error", index, repr(exc)))
        finally:
            close()


def _prepare(case: Case, index: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The case's op for process ``index``, warmed up once, and its closer."""
    keys, size = case.keys, case.size
    if case.kind == "redis":
        import redis

        conn = redis.Redis(port=case.port)
        value = value_bytes(size).tobytes()

        def redis_get(n: int) -> None:
            expect_size(len(conn.get(keys[(n + index) % len(keys)]) or b""), size)

        def redis_put(n: int) -> None:
            conn.set(b"p%d-%d" % (index, n % 8), value)

        op = redis_get if case.op == "get" else redis_put
        op(-1)  # warm-up: connection, first touches
        return op, conn.close
    client = kvd_client(case.path, case.tcp_target, case.unix_target, case.ca_file)
    try:
        batch = case.batch
        room = client.buffer(size * batch)
        buffer = room[:size]
        buffer[:] = value_bytes(size).data
        views = [room[i * size : (i + 1) * size] for i in range(batch)]

        def kvd_get(n: int) -> None:
            expect_size(client.get_into(case.ns, keys[(n + index) % len(keys)], buffer), size)

        def kvd_get_batch(n: int) -> None:
            first = (n * batch + index) % len(keys)
            batch_keys = [keys[(first + i) % len(keys)] for i in range(batch)]
            for got in client.get_many_into(case.ns, batch_keys, views):
                expect_size(got, size)

        def kvd_put(n: int) -> None:
            client.put(case.ns, f"{case.tag}-{index}-{n}".encode(), buffer)

        op = {"get": kvd_get, "get-batch": kvd_get_batch, "get-chain": kvd_get_batch,
              "put": kvd_put}[case.op]  # fmt: skip
        op(-1)  # warm-up: connections, regions, first touches
    except BaseException:
        client.close()
        raise
    return op, client.close
