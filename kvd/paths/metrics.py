"""Prometheus metrics: the instruments the server updates and a collector
that reads the store's plain counters at scrape time.

Per-request instruments (request counts, latency histograms, hits, misses,
bytes per op) are updated by the service; everything the store already
counts (pool usage, evictions, leases, entries) is read when Prometheus
scrapes, so the hot path pays nothing for it. The scrape runs on the HTTP
server's thread and only reads integers, which is safe under the GIL.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import values as client_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvd.util.logs import Throttle

log = logging.getLogger("kvd.requests")

# Error codes that count as a refused request, and the reason label each gets.
REFUSAL_REASONS = {
    "RESOURCE_EXHAUSTED": "resource_exhausted",
    "UNAUTHENTICATED": "unauthenticated",
    "PERMISSION_DENIED": "permission_denied",
    "INVALID_ARGUMENT": "invalid_argument",
    "UNAVAILABLE": "unavailable",
    # A region op past its client's deadline: a late copy is not stored.
    "DEADLINE_EXCEEDED": "deadline_exceeded",
}

# With one of these set, prometheus_client keeps every value in a file named
# after the process id under that directory (for servers of many worker
# processes that export together). kvd is one process exporting its own
# registry, and a file of an earlier process whose id the kernel hands out
# again would start its counts where that process's stopped: a test run's
# daemons inherited the variable from a library that set it in the test
# process, and counted bytes they never moved.
MULTIPROCESS_VARIABLES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")

# Ops that read values, as the hit, miss and fetch metrics label them.
READ_OPS = ("get", "batch_get", "lookup", "bulk_get", "shm_get")

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


M = TypeVar("M", Counter, Histogram)


class Children(Generic[M]):
    """A labelled metric whose children are looked up once per label set: a
    shm get updates six of them, and prometheus_client's ``labels()`` checks
    and locks on every call (an update took 1.25 µs through it, 0.58 µs
    cached, here). The label sets of these metrics are fixed (ops, tiers,
    codes, reasons), so the cache is bounded."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


def values_in_memory() -> str:
    """Keep this process's metric values in memory, whatever its environment
    says (MULTIPROCESS_VARIABLES, dropped from it); the directory it named,
    or "". For the daemon's process only: an engine's may export its workers
    together that way."""
    named = ""
    for variable in MULTIPROCESS_VARIABLES:
        named = os.environ.pop(variable, "") or named
    client_values.ValueClass = client_values.MutexValue
    return named


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Children(
            Counter("kvd_requests", "RPCs finished, by op and status code", ["op", "code"],
                    registry=r)
        )  # fmt: skip
        self.latency = Children(
            Histogram("kvd_request_duration_seconds", "RPC latency by op", ["op"],
                      buckets=LATENCY_BUCKETS_S, registry=r)
        )  # fmt: skip
        self.hits = Children(
            Counter("kvd_hits", "Keys found, by op and tier", ["op", "tier"], registry=r)
        )
        self.misses = Children(Counter("kvd_misses", "Keys not found, by op", ["op"], registry=r))
        self.bytes = Children(
            Counter("kvd_bytes", "Value bytes moved, by op and direction", ["op", "direction"],
                    registry=r)
        )  # fmt: skip
        self.rejected = Children(
            Counter("kvd_rejected_requests", "Requests refused, by reason", ["reason"],
                    registry=r)
        )  # fmt: skip
        self.fetch_latency = Children(
            Histogram("kvd_fetch_duration_seconds",
                      "Store reads by op and the tier that served them (l1, l2, miss)",
                      ["op", "tier"], buckets=LATENCY_BUCKETS_S, registry=r)
        )  # fmt: skip
        self.reloads = Counter(
            "kvd_reloads", "SIGHUP reloads, by result (ok, error)", ["result"], registry=r
        )
        self.up = Gauge("kvd_up", "1 while the daemon serves", registry=r)
        # Every known series exists from the start, so dashboards and rate()
        # see zeros rather than gaps before the first hit, miss or refusal.
        for op in READ_OPS:
            self.misses.labels(op)
            for tier in ("l1", "l2"):
                self.hits.labels(op, tier)
            for tier in ("l1", "l2", "miss"):
                if op != "lookup":  # Lookup reads the index, never a value
                    self.fetch_latency.labels(op, tier)
        for reason in REFUSAL_REASONS.values():
            self.rejected.labels(reason)
        for result in ("ok", "error"):
            self.reloads.labels(result)
        self._http: Any = None
        self._throttle = Throttle()

    def refused(self, code_name: str, op: str, message: str) -> None:
        """Count a refused request by reason; log it, one line per reason per second."""
        reason = REFUSAL_REASONS.get(code_name)
        if reason is None:
            return
        self.rejected.labels(reason).inc()
        held = self._throttle.allow(reason)
        if held is not None:
            log.warning(
                "request refused",
                extra={"op": op, "reason": reason, "error": message, "held_back": held},
            )

    def fetched(self, op: str, tier: str, start_s: float) -> None:
        """Record one store read that began at ``start_s`` (perf_counter) and its tier."""
        self.fetch_latency.labels(op, tier).observe(time.perf_counter() - start_s)

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
        read: Callable[[], Mapping[str, float]],
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


# metric name -> (help, label names, [(label values, value)]): counters with labels.
LabelledRows = Mapping[str, tuple[str, tuple[str, ...], Sequence[tuple[tuple[str, ...], float]]]]


class LabelledCollector(Collector):
    """Turns a ``() -> LabelledRows`` into labelled counter families (the
    pool's per-peer traffic: the label sets are the pool's members)."""

    def __init__(self, read: Callable[[], LabelledRows]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (doc, labels, rows) in self._read().items():
            family = CounterMetricFamily(name, doc, labels=list(labels))
            for values, value in rows:
                family.add_metric(list(values), value)
            yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())


# (name, bytes stored, entries, hits, misses) of one namespace.
NamespaceRow = tuple[str, int, int, int, int]
OTHER_NAMESPACE = "other"


class NamespaceCollector(Collector):
    """Per-namespace usage, the ``limit`` largest by name and the rest as ``other``.

    Namespace names come from clients, so exporting each one would let them
    grow the label set without bound; ``limit`` (metrics_namespaces_max) caps
    the series at limit + 1 per metric. A namespace moving in or out of the
    named set moves its hits between its own series and ``other``: rate()
    sees a counter reset there, which Prometheus tolerates.
    """

    def __init__(self, read: Callable[[], Sequence[NamespaceRow]], limit: int) -> None:
        self._read = read
        self._limit = limit

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = sorted(self._read(), key=lambda row: (-row[1], row[0]))
        named = rows[: self._limit]
        rest = rows[self._limit :]
        if rest:
            named.append(
                (
                    OTHER_NAMESPACE,
                    sum(r[1] for r in rest),
                    sum(r[2] for r in rest),
                    sum(r[3] for r in rest),
                    sum(r[4] for r in rest),
                )
            )
        by_ns = ["namespace"]
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            GaugeMetricFamily(
                "kvd_namespace_bytes", "Value bytes stored in L1, by namespace", labels=by_ns
            ),
            GaugeMetricFamily(
                "kvd_namespace_entries", "Values stored in L1, by namespace", labels=by_ns
            ),
            CounterMetricFamily(
                "kvd_namespace_hits", "Reads that found their key, by namespace", labels=by_ns
            ),
            CounterMetricFamily(
                "kvd_namespace_misses", "Reads that missed, by namespace", labels=by_ns
            ),
            GaugeMetricFamily(
                "kvd_namespace_hit_ratio",
                "Hits over reads since start, by namespace (0 before the first read)",
                labels=by_ns,
            ),
        ]
        for name, nbytes, entries, hits, misses in named:
            for family, value in zip(families, (nbytes, entries, hits, misses), strict=False):
                family.add_metric([name], value)
            reads = hits + misses
            families[4].add_metric([name], hits / reads if reads else 0.0)
        yield from families

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())
