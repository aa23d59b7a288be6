"""Metrics and logs of a live daemon: the families /metrics exports, the
bounded per-namespace labels, the Grafana dashboard's metric names, and
logs without per-request lines."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvd.client import Client
from kvd.paths.metrics import NamespaceCollector
from kvd.util.logs import Throttle
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import KVStoreStub
from tests import sockets
from tests.support import REPO, DaemonFactory, DaemonProcess, wait_until

DASHBOARD = REPO / "deploy" / "grafana" / "kvd-dashboard.json"
NAMESPACES_MAX = 2
VALUE_BYTES = 128 << 10  # over the bulk threshold: the bulk path is counted too


def scrape(daemon: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as (name, sorted labels) -> value."""
    samples = {}
    for family in text_string_to_metric_families(sockets.scrape(daemon.metrics_port)):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def names(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    return {name for name, _ in samples}


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon that served puts, hits and misses over gRPC, bulk TCP and shm."""
    daemon = DaemonProcess(
        tmp_path_factory.mktemp("kvd"), ["--metrics-namespaces-max", str(NAMESPACES_MAX)]
    )
    value_bytes = bytes(range(256)) * (VALUE_BYTES // 256)
    with Client(daemon.target) as client:
        for i, ns in enumerate(["big", "medium", "small", "tiny"]):
            for k in range(4 - i):
                client.put(ns, b"k%d" % k, value_bytes)
        assert client.get("big", b"k0") == value_bytes
        assert client.get("big", b"absent") is None
        assert client.get_many("tiny", [b"k0"]) == [value_bytes]
        assert client.lookup("big", [b"k0", b"k1", b"nope"]) == 2
    with Client(daemon.socket_target) as client:
        assert client.get("medium", b"k0") == value_bytes
    with grpc.insecure_channel(daemon.target) as channel:  # plain gRPC, no fast path
        stub = KVStoreStub(channel)
        for key in (b"k0", b"absent"):
            list(stub.Get(pb.GetRequest(namespace="big", key=key), timeout=10))
    yield daemon
    daemon.discard()


REQUIRED = [
    # per tier and op: hits, misses, bytes, latency
    "kvd_hits_total", "kvd_misses_total", "kvd_bytes_total", "kvd_requests_total",
    "kvd_request_duration_seconds_bucket", "kvd_fetch_duration_seconds_bucket",
    # pool and SSD space
    "kvd_pool_bytes", "kvd_pool_used_bytes", "kvd_pool_free_bytes",
    "kvd_ssd_bytes", "kvd_ssd_used_bytes", "kvd_ssd_free_bytes",
    # evictions and reclaims, write-back, integrity
    "kvd_evictions_total", "kvd_l2_reclaims_total", "kvd_l2_reclaimed_records_total",
    "kvd_writeback_queue", "kvd_writeback_inflight", "kvd_writeback_backlog_bytes",
    "kvd_checksum_failures_total",
    # leases, in flight, refusals
    "kvd_leases_active", "kvd_inflight_requests", "kvd_inflight_bytes",
    "kvd_rejected_requests_total",
    # per namespace
    "kvd_namespace_bytes", "kvd_namespace_entries", "kvd_namespace_hits_total",
    "kvd_namespace_misses_total", "kvd_namespace_hit_ratio",
    "kvd_up", "kvd_reloads_total",
]  # fmt: skip


def test_every_family_is_exported(busy: DaemonProcess) -> None:
    samples = scrape(busy)
    missing = [name for name in REQUIRED if name not in names(samples)]
    assert not missing, missing
    assert value(samples, "kvd_up") == 1


def test_hits_misses_and_latency_per_tier_and_op(busy: DaemonProcess) -> None:
    samples = scrape(busy)
    assert value(samples, "kvd_hits_total", op="get", tier="l1") >= 1
    assert value(samples, "kvd_hits_total", op="bulk_get", tier="l1") >= 1
    assert value(samples, "kvd_hits_total", op="shm_get", tier="l1") >= 1
    assert value(samples, "kvd_misses_total", op="get") >= 1
    assert value(samples, "kvd_fetch_duration_seconds_count", op="get", tier="miss") >= 1
    assert value(samples, "kvd_fetch_duration_seconds_count", op="bulk_get", tier="l1") >= 1
    # Every tier's series exists before it is first used: zero, not a gap.
    assert ("kvd_hits_total", (("op", "get"), ("tier", "l2"))) in samples
    assert ("kvd_rejected_requests_total", (("reason", "permission_denied"),)) in samples


def test_namespace_labels_are_capped(busy: DaemonProcess) -> None:
    samples = scrape(busy)
    labelled = {
        dict(labels)["namespace"] for name, labels in samples if name == "kvd_namespace_bytes"
    }
    assert labelled == {"big", "medium", "other"}
    assert value(samples, "kvd_namespace_entries", namespace="big") == 4
    assert value(samples, "kvd_namespace_entries", namespace="other") == 3  # small 2 + tiny 1
    assert value(samples, "kvd_namespace_bytes", namespace="other") == 3 * VALUE_BYTES
    assert value(samples, "kvd_namespace_hits_total", namespace="big") >= 1
    assert 0 < value(samples, "kvd_namespace_hit_ratio", namespace="big") < 1


def test_dashboard_uses_only_exported_metrics(busy: DaemonProcess) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 20
    used = {name for expr in exprs for name in re.findall(r"\bkvd_[a-z0-9_]+", expr)}
    # A daemon in a pool exports the pool's panels' metrics: a real Prometheus
    # scraping a pool answers each of those queries (tests/cluster/test_prometheus_pool.py).
    pool_only = {name for name in used if name.startswith(("kvd_cluster_", "kvd_kv_events_"))}
    assert pool_only, "the dashboard shows the pool"
    exported = names(scrape(busy))
    assert used - pool_only - exported == set(), "dashboard names metrics no daemon exports"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_namespace_collector_rolls_the_rest_into_other() -> None:
    rows = [("a", 10, 1, 3, 1), ("b", 30, 2, 0, 0), ("c", 20, 1, 1, 1), ("d", 5, 1, 0, 2)]
    registry = CollectorRegistry()
    registry.register(NamespaceCollector(lambda: rows, 2))
    text = generate_latest(registry).decode()
    assert 'kvd_namespace_bytes{namespace="b"} 30.0' in text
    assert 'kvd_namespace_bytes{namespace="c"} 20.0' in text
    assert 'kvd_namespace_bytes{namespace="other"} 15.0' in text
    assert 'kvd_namespace_hits_total{namespace="other"} 3.0' in text
    assert 'namespace="a"' not in text
    registry = CollectorRegistry()
    registry.register(NamespaceCollector(lambda: rows, 0))
    assert 'kvd_namespace_entries{namespace="other"} 5.0' in generate_latest(registry).decode()


# ---- logs -------------------------------------------------------------------------
def test_a_burst_of_requests_adds_no_info_lines(busy: DaemonProcess) -> None:
    before = len(busy.log)
    with Client(busy.target) as client:
        for i in range(200):
            client.put("burst", b"k%d" % i, b"v" * 100)
            client.get("burst", b"k%d" % i)
            client.get("burst", b"missing%d" % i)
        client.stats()
    added = busy.log[before:]
    assert not [line for line in added if "level=info" in line], added[:5]


def test_start_up_summary_names_config_backends_and_sizes(busy: DaemonProcess) -> None:
    started = next(line for line in busy.log if "kvd started" in line)
    fields = [
        "version=",
        "listen=",
        "bulk=",
        "metrics=",
        "dram_bytes=",
        "ssd_paths=",
        "ssd_bytes=",
        "io_backend=",
        "ssd_direct=",
        "auth=off",
        "tls=off",
        "loop=",
    ]
    for field in fields:
        assert field in started, field
    config = next(line for line in busy.log if "kvd config" in line)
    assert f"metrics_namespaces_max={NAMESPACES_MAX}" in config and "shutdown_grace_ms=" in config


def test_json_logs(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    daemon = daemon_factory("--log-format", "json")
    daemon.stop()
    lines = [json.loads(line) for line in daemon.log if line.startswith("{")]
    messages = [line["msg"] for line in lines]
    assert "kvd started" in messages and "kvd stopped" in messages
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)


def test_values_stay_in_memory_whatever_the_environment(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A PROMETHEUS_MULTIPROC_DIR in the daemon's environment is ignored, and
    said so. With it prometheus_client kept each value in a file named after
    the process id, and a daemon the kernel gave an earlier one's id counted
    on from that one's totals (a library set it in a test run's process, and
    every daemon started after inherited it)."""
    files = tmp_path / "multiproc"
    files.mkdir()
    daemon = daemon_factory(env={"PROMETHEUS_MULTIPROC_DIR": str(files)})
    value_bytes = b"m" * VALUE_BYTES
    with Client(daemon.target, shm=False) as client:
        client.put("ns", b"k", value_bytes)
        assert client.get("ns", b"k") == value_bytes

    # A get's bytes count once its send returned, which can be after the
    # client already read them.
    def sent_out() -> bool:
        return value(scrape(daemon), "kvd_bytes_total", op="bulk_get", direction="out") > 0

    assert wait_until(sent_out)
    samples = scrape(daemon)
    assert value(samples, "kvd_bytes_total", op="bulk_put", direction="in") == VALUE_BYTES
    assert value(samples, "kvd_bytes_total", op="bulk_get", direction="out") == VALUE_BYTES
    assert list(files.iterdir()) == []
    assert any("PROMETHEUS_MULTIPROC_DIR ignored" in line for line in daemon.log)


def test_throttle_lets_one_line_per_key_per_interval() -> None:
    now = [0.0]
    throttle = Throttle(1.0, clock=lambda: now[0])
    assert throttle.allow("a") == 0
    assert throttle.allow("a") is None and throttle.allow("a") is None
    assert throttle.allow("b") == 0
    now[0] = 1.5
    assert throttle.allow("a") == 2  # two lines were held back
