"""Prometheus metrics: the instruments the server updates and a collector
that reads the store's plain counters at scrape time.

Per-request instruments (request counts, latency histograms, hits, misses,
bytes per op) are updated by the service; everything the store already
counts (pool usage, evictions, leases, entries) is read when Prometheus
scrapes, so the hot path pays nothing for it. The scrape runs on the HTTP
server's thread and only reads integers, which is safe under the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# 100 µs (a small L1 lookup) to 10 s (a 64 MiB value over a slow link).
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvd_requests", "RPCs finished, by op and status code", ["op", "code"], registry=r
        )
        self.latency = Histogram(
            "kvd_request_duration_seconds",
            "RPC latency by op",
            ["op"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.hits = Counter("kvd_hits", "Keys found, by op and tier", ["op", "tier"], registry=r)
        self.misses = Counter("kvd_misses", "Keys not found, by op", ["op"], registry=r)
        self.bytes = Counter(
            "kvd_bytes", "Value bytes moved, by op and direction", ["op", "direction"], registry=r
        )
        self.rejected = Counter(
            "kvd_rejected_requests", "Requests refused, by reason", ["reason"], registry=r
        )
        self.up = Gauge("kvd_up", "1 while the daemon serves", registry=r)
        self._http: Any = None

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint on its own thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            server = self._http
            self._http = None
            threading.Thread(target=server.shutdown, daemon=True).start()
            server.server_close()


class SnapshotCollector(Collector):
    """Turns a ``() -> dict`` of gauges and counters into metric families."""

    def __init__(
        self,
        read: Callable[[], dict[str, int]],
        gauges: dict[str, tuple[str, str]],
        counters: dict[str, tuple[str, str]],
    ) -> None:
        self._read = read
        self._gauges = gauges  # stat name -> (metric name, help)
        self._counters = counters

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        values = self._read()
        for stat, (name, doc) in self._gauges.items():
            yield GaugeMetricFamily(name, doc, value=values[stat])
        for stat, (name, doc) in self._counters.items():
            yield CounterMetricFamily(name, doc, value=values[stat])

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())
