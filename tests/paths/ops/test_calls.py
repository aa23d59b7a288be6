"""The op layer's request wrapper (``kvd.paths.ops.calls.Tally``) in process:
a request is counted once, under OK, its typed error's code or CANCELLED,
with its time; a refusal counts its reason; a dropped try counts nothing;
``inflight.requests`` counts it only while it runs. And the op layer, the
shm socket and the bulk port load neither grpc nor protobuf."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import InflightBytes, Tally, refused
from kvd.wire.errors import CODE_NUMBERS, ResourceExhausted
from tests.support import REPO


def _count(metrics: Metrics, op: str, code: str) -> float:
    return float(metrics.requests.labels(op, code)._value.get())


def _rejected(metrics: Metrics, reason: str) -> float:
    return float(metrics.rejected.labels(reason)._value.get())


def _timed(metrics: Metrics, op: str) -> float:
    return float(metrics.latency.labels(op)._sum.get())  # the seconds observed


def test_each_way_out_is_counted_once() -> None:
    metrics, inflight = Metrics(), InflightBytes(1 << 20)
    with Tally(metrics, "op", inflight):
        assert inflight.requests == 1
    with pytest.raises(ResourceExhausted), Tally(metrics, "op", inflight):
        raise ResourceExhausted("full")
    with pytest.raises(RuntimeError), Tally(metrics, "op", inflight):
        raise RuntimeError("a bug")
    with pytest.raises(asyncio.CancelledError), Tally(metrics, "op"):
        raise asyncio.CancelledError
    assert inflight.requests == 0
    assert _count(metrics, "op", "OK") == 1
    assert _count(metrics, "op", "RESOURCE_EXHAUSTED") == 1
    assert _count(metrics, "op", "CANCELLED") == 2
    assert _rejected(metrics, "resource_exhausted") == 1
    assert _timed(metrics, "op") > 0


def test_a_dropped_try_counts_nothing() -> None:
    metrics, inflight = Metrics(), InflightBytes(1 << 20)
    tally = Tally(metrics, "op", inflight)
    with tally:
        tally.drop()
    assert inflight.requests == 0
    assert _count(metrics, "op", "OK") == 0 and _timed(metrics, "op") == 0


def test_refused_counts_the_reason_and_gives_the_number() -> None:
    metrics = Metrics()
    assert (
        refused(metrics, "bulk_get", ResourceExhausted("x")) == CODE_NUMBERS["RESOURCE_EXHAUSTED"]
    )
    assert _rejected(metrics, "resource_exhausted") == 1
    assert _count(metrics, "bulk_get", "RESOURCE_EXHAUSTED") == 0  # no request count of its own


def test_the_op_layer_and_the_socket_transports_load_no_grpc() -> None:
    probe = (
        "import sys\n"
        "import kvd.paths.ops.region_ops, kvd.paths.shm.channel, kvd.paths.bulk.server\n"
        "print(sorted(m for m in sys.modules"
        " if m.split('.')[0] == 'grpc' or m.startswith(('google.protobuf', 'kvd.v1'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
