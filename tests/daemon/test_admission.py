"""A daemon with ``l2_admission = twice``: a put is counted as held back and
not written; a get of it (its second reference) has it written to L2, which
the metrics show; and it survives a restart from L2. A durable put of a key
already stored answers once the value is on L2, on every path (a value held
back is as good a case as any: nothing else would write it). A daemon
refuses an unknown rule at start."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvd.client import Client
from tests.sockets import metric
from tests.support import DaemonFactory, DaemonProcess, wait_until

VALUE = bytes(range(256)) * 256  # 64 KiB


def test_a_value_is_written_once_a_get_references_it(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    workdir = tmp_path / "kvd"
    daemon = daemon_factory("--l2-admission", "twice", workdir=workdir)
    port = daemon.metrics_port
    with Client(daemon.socket_target) as client:
        client.put("ns", b"once", VALUE)
        client.put("ns", b"twice", VALUE)
        assert metric(port, "kvd_l2_held_back_total") == 2
        assert client.get("ns", b"twice") == VALUE
    assert wait_until(lambda: metric(port, "kvd_l2_writes_total") == 1)
    assert metric(port, "kvd_l2_admitted_total") == 1
    assert metric(port, "kvd_l2_never_written_total") == 0
    daemon.stop()
    again = daemon_factory("--l2-admission", "twice", workdir=workdir)
    with Client(again.socket_target) as client:
        assert client.get("ns", b"twice") == VALUE  # from L2
        assert client.get("ns", b"once") is None  # L1 held its only copy


# How a client reaches each put path: shm regions, the bulk port, a gRPC
# BatchPut (values up to 1 MiB) and a gRPC Put stream (larger ones).
PATHS: dict[str, tuple[Callable[[DaemonProcess], Client], int]] = {
    "shm": (lambda d: Client(d.socket_target), 64 << 10),
    "bulk": (lambda d: Client(d.target, shm=False, bulk=True), 64 << 10),
    "grpc-batch": (lambda d: Client(d.target, shm=False, bulk=False), 64 << 10),
    "grpc-stream": (lambda d: Client(d.target, shm=False, bulk=False), 2 << 20),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_durable_put_of_a_stored_key_survives_a_kill(
    daemon_factory: DaemonFactory, tmp_path: Path, path: str
) -> None:
    connect, size = PATHS[path]
    value = (VALUE * (size // len(VALUE) + 1))[:size]
    workdir = tmp_path / "kvd"
    daemon = daemon_factory("--l2-admission", "twice", workdir=workdir)
    with connect(daemon) as client:
        assert client.put("ns", b"k", value) is False  # held back: not on L2
        assert client.put("ns", b"k", value, durable=True) is True  # stored: on L2 now
    daemon.kill()  # SIGKILL: nothing flushed
    again = daemon_factory("--l2-admission", "twice", workdir=workdir)
    with Client(again.socket_target) as client:
        assert client.get("ns", b"k") == value


def test_an_unknown_rule_is_refused_at_start(tmp_path: Path) -> None:
    started = subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--l2-admission", "often"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode != 0
    assert "l2_admission" in started.stderr and "twice" in started.stderr
