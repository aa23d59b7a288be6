"""gRPC path throughput: kvd Put/Get next to a plain gRPC echo and memcpy.

For each value size, in one run: kvd Put and Get GB/s through the client
library (checksums included, as users run it), the plain echo server's
unary and 1 MiB-streamed GB/s for the same sizes (the gRPC ceiling in
Python), and a numpy copy into pre-allocated memory (the memory ceiling).
Every kvd figure is reported as a ratio to the better echo and to memcpy.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import grpc
import numpy as np

from kvd.client import Client
from kvd.tools.bench.echo import SERVICE, encode_size
from kvd.v1 import kvd_pb2 as pb

SIZES_BYTES = (64 << 10, 1 << 20, 4 << 20, 32 << 20)
# Each case moves at least this much and runs at least MIN_ITERATIONS times,
# but stops after CASE_SECONDS_MAX: enough to average out scheduler noise on
# a 2-core machine without making the whole run take minutes.
CASE_BYTES = 256 << 20
MIN_ITERATIONS = 8
CASE_SECONDS_MAX = 3.0


@dataclass
class Row:
    size_bytes: int
    memcpy_gbps: float
    echo_unary_gbps: float
    echo_stream_gbps: float
    kvd_put_gbps: float
    kvd_get_gbps: float

    @property
    def echo_best_gbps(self) -> float:
        return max(self.echo_unary_gbps, self.echo_stream_gbps)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["echo_best_gbps"] = self.echo_best_gbps
        out["get_vs_echo"] = self.kvd_get_gbps / self.echo_best_gbps
        out["put_vs_echo"] = self.kvd_put_gbps / self.echo_best_gbps
        out["get_vs_memcpy"] = self.kvd_get_gbps / self.memcpy_gbps
        return out


def timed_gbps(nbytes: int, op: Callable[[int], object]) -> float:
    """GB/s of calling ``op(i)`` repeatedly, each moving ``nbytes``."""
    iterations = max(MIN_ITERATIONS, CASE_BYTES // nbytes)
    op(0)  # warm-up: connections, first allocations
    start = time.perf_counter()
    done = 0
    while done < iterations:
        op(done + 1)
        done += 1
        if time.perf_counter() - start > CASE_SECONDS_MAX and done >= MIN_ITERATIONS:
            break
    return nbytes * done / (time.perf_counter() - start) / 1e9


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return timed_gbps(nbytes, lambda _: np.copyto(dst, src))


class EchoServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.tools.bench.echo"], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("port="):
            self.proc.kill()
            raise RuntimeError("echo server did not start")
        self.target = f"127.0.0.1:{int(line[5:])}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def echo_gbps(target: str, nbytes: int) -> tuple[float, float]:
    options = [("grpc.max_receive_message_length", 128 << 20)]
    with grpc.insecure_channel(target, options=options) as channel:
        unary = channel.unary_unary(
            f"/{SERVICE}/Unary", response_deserializer=pb.GetResponse.FromString
        )
        stream = channel.unary_stream(
            f"/{SERVICE}/Stream", response_deserializer=pb.GetResponse.FromString
        )
        request = encode_size(nbytes)

        def one_unary(_: int) -> None:
            assert len(unary(request, timeout=60).data) == nbytes

        def one_stream(_: int) -> None:
            parts = [m.data for m in stream(request, timeout=60)]
            assert len(b"".join(parts)) == nbytes

        return timed_gbps(nbytes, one_unary), timed_gbps(nbytes, one_stream)


def kvd_gbps(target: str, nbytes: int) -> tuple[float, float]:
    value = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    ns = f"bench-grpc-{nbytes}"
    with Client(target, timeout_s=60, bulk=False, shm=False) as client:  # the gRPC path alone
        put = timed_gbps(nbytes, lambda i: client.put(ns, b"%d" % i, value))

        def one_get(i: int) -> None:
            got = client.get(ns, b"%d" % (i % 8))
            assert got is not None and len(got) == nbytes

        get = timed_gbps(nbytes, one_get)
        client.delete_namespace(ns)
    return put, get


def run(
    target: str, sizes: tuple[int, ...] = SIZES_BYTES, progress: Callable[[str], None] = print
) -> list[Row]:
    rows = []
    echo = EchoServer()
    try:
        for size in sizes:
            progress(f"grpc path: {size >> 10} KiB")
            unary, stream = echo_gbps(echo.target, size)
            put, get = kvd_gbps(target, size)
            rows.append(Row(size, memcpy_gbps(size), unary, stream, put, get))
    finally:
        echo.close()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| value | memcpy GB/s | echo unary | echo stream | kvd Put | kvd Get "
        "| Get/echo | Put/echo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r.as_dict()
        lines.append(
            f"| {_size(r.size_bytes)} | {r.memcpy_gbps:.2f} | {r.echo_unary_gbps:.3f} | "
            f"{r.echo_stream_gbps:.3f} | {r.kvd_put_gbps:.3f} | {r.kvd_get_gbps:.3f} | "
            f"{d['get_vs_echo']:.2f} | {d['put_vs_echo']:.2f} |"
        )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
