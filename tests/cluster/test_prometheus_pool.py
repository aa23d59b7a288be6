"""A real Prometheus scrapes a pool of three daemons (and one member that is
down) every second while the pool serves some traffic; every query of
deploy/grafana's dashboard, its pool panels included, then returns data.

The traffic touches what the panels show: puts handed to their owners (and
to the member that is down: forward errors), lookups and gets through
another member (remote lookups, peer reads), gets of keys the down member
owns (peer errors), a miss and a refused request, and KV events."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.wire.errors import InvalidArgument
from tests.cluster.cluster import free_ports
from tests.cluster.prometheus_server import PrometheusServer, prometheus_binary
from tests.support import REPO, DaemonProcess, wait_until

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.slow,
    pytest.mark.skipif(
        prometheus_binary() is None, reason="no prometheus (apt-get install prometheus)"
    ),
]

DASHBOARD = REPO / "deploy" / "grafana" / "kvd-dashboard.json"
# Scrapes every second: a rate over [5m] needs two samples, so a few
# seconds after the traffic every query has its data.
QUERY_WAIT_S = 30.0


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target, ``$instance`` as Grafana's All makes it."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$instance", ".+"))
            for panel in dashboard["panels"] for target in panel["targets"]]  # fmt: skip


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 512  # 16 KiB


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[DaemonProcess], str]]:
    root = tmp_path_factory.mktemp("prompool")
    *ports, down_port, events_port = free_ports(5)
    down = f"127.0.0.1:{down_port}"  # a member nobody answers at
    members = "static:" + ",".join([*(f"127.0.0.1:{p}" for p in ports), down])
    daemons: list[DaemonProcess] = []
    try:
        for i, port in enumerate(ports):
            where = root / f"m{i}"
            where.mkdir()
            args = [
                "--listen", f"127.0.0.1:{port}", "--pool-members", members,
                "--pool-peer-timeout-ms", "200",
                # Connects to a router that is not there: events are sent (and lost).
                "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
            ]  # fmt: skip
            daemons.append(DaemonProcess(where, args, dram="32MiB", max_value="1MiB",
                                         ssd="64MiB", segment="16MiB"))  # fmt: skip
        yield daemons, down
    finally:
        for daemon in daemons:
            daemon.discard()


def drive_traffic(daemons: list[DaemonProcess], down: str) -> None:
    a, b, _ = daemons
    keys = [f"prom-{i:03d}".encode() for i in range(48)]
    owners = Placement([*(d.target for d in daemons), down]).owners("prom", keys)
    with Client(a.target, timeout_s=10) as first, Client(b.target, timeout_s=10) as second:
        parent = None
        for key in keys:
            first.put("prom", key, value_of(key), parent=parent)
            parent = key
        reachable = [k for k, owner in zip(keys, owners, strict=True) if owner != down]
        # Each key reaches its owner in the background; then b finds them there.
        assert wait_until(lambda: all(second.exists("prom", reachable)), 10)
        second.lookup("prom", keys)
        for key, owner in zip(keys, owners, strict=True):
            got = second.get("prom", key)
            assert got is None if owner == down else got == value_of(key)
        assert second.get("prom", b"never-stored") is None
        with pytest.raises(InvalidArgument):
            second.lookup("prom", [])


def test_every_dashboard_query_returns_data(
    pool: tuple[list[DaemonProcess], str], tmp_path: Path
) -> None:
    daemons, down = pool
    server = PrometheusServer(tmp_path, [f"127.0.0.1:{d.metrics_port}" for d in daemons])
    try:
        drive_traffic(daemons, down)
        queries = dashboard_queries()
        assert any("kvd_cluster_" in expr for _, expr in queries)  # the pool panels are there
        deadline = time.monotonic() + QUERY_WAIT_S
        empty = queries
        while empty and time.monotonic() < deadline:
            time.sleep(1.0)
            empty = [(title, expr) for title, expr in empty if not server.query(expr)]
        assert not empty, "dashboard queries without data:\n" + "\n".join(
            f"{title}: {expr}" for title, expr in empty
        )
        members = server.query('kvd_cluster_members{job="kvd"}')
        assert len(members) == 3 and {float(m["value"][1]) for m in members} == {4.0}
    finally:
        server.kill()
