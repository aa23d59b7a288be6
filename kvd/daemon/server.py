"""The daemon process: builds the pool and store, serves gRPC (TCP and an
optional Unix socket), health, reflection and /metrics, and shuts down
gracefully on SIGTERM/SIGINT.

One asyncio event loop (uvloop when installed) owns all state.

Lifecycle: SIGTERM/SIGINT stop accepting RPCs, let those in flight finish
(up to half of ``shutdown_grace_ms``), close the fast paths, flush the L2
write-back within what is left of the deadline, and exit. SIGHUP re-reads the
config file, the token table and the TLS files: log settings, tokens and
certificates apply at once; any other changed setting is logged as needing a
restart. Under systemd (``Type=notify``) readiness and stopping are reported
on ``$NOTIFY_SOCKET``.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvd import __version__
from kvd.cluster.events import (
    KV_EVENTS_COUNTERS,
    KV_EVENTS_GAUGES,
    KvEventPublisher,
    start_kv_events,
)
from kvd.cluster.node import POOL_COUNTERS, POOL_GAUGES, PoolNode, start_pool
from kvd.config.addresses import is_loopback_host, parse_address
from kvd.config.rules import l2_capacity_warning
from kvd.config.settings import SETTINGS, ConfigError
from kvd.daemon.fast_paths import FastPaths
from kvd.daemon.tls import ServerTls
from kvd.io import faults
from kvd.io.backend import open_backend
from kvd.l1.pool import Pool
from kvd.l2 import DeviceSet, L2Tier
from kvd.paths.auth import Authenticator
from kvd.paths.grpc.service import KVStoreService
from kvd.paths.metrics import (
    LabelledCollector,
    Metrics,
    NamespaceCollector,
    NamespaceRow,
    SnapshotCollector,
    values_in_memory,
)
from kvd.paths.ops.calls import ServiceLimits
from kvd.paths.socket_dirs import claim_socket_path, secure_directory
from kvd.store.eviction.density_learn import LEARNING
from kvd.store.eviction.policy import make_policy
from kvd.store.index import StoreLimits
from kvd.store.store import Store
from kvd.util import collector, crashpoints, logs
from kvd.util.hugepages import shmem_mode
from kvd.v1 import kvd_pb2
from kvd.wire.grpc import add_kvstore

if TYPE_CHECKING:
    from kvd.config.settings import Config

log = logging.getLogger("kvd.daemon.server")

SERVICE_NAME = "kvd.v1.KVStore"

_STORE_GAUGES = {
    "pool_bytes": ("kvd_pool_bytes", "DRAM pool size"),
    "pool_used_bytes": ("kvd_pool_used_bytes", "DRAM pool bytes holding values"),
    "pool_free_bytes": ("kvd_pool_free_bytes", "DRAM pool bytes free"),
    "entries": ("kvd_entries", "Values stored"),
    "guests": ("kvd_guest_entries", "Values held for the pool member that owns them"),
    "namespaces": ("kvd_namespaces", "Namespaces with values"),
    "leases_active": ("kvd_leases_active", "Leases from Lookup not yet released or expired"),
    "inflight_bytes": ("kvd_inflight_bytes", "Value bytes held by requests in progress"),
    "inflight_requests": ("kvd_inflight_requests", "Requests in progress"),
}
_L2_GAUGES = {
    "l2_bytes": ("kvd_ssd_bytes", "L2 capacity"),
    "l2_used_bytes": ("kvd_ssd_used_bytes", "L2 bytes holding live records"),
    "l2_free_bytes": ("kvd_ssd_free_bytes", "L2 bytes not holding live records"),
    "l2_entries": ("kvd_l2_entries", "Values stored on L2"),
    "writeback_queue": ("kvd_writeback_queue", "Values waiting for their L2 write"),
    "writeback_writing": ("kvd_writeback_inflight", "L2 writes in flight"),
    "writeback_backlog_bytes": ("kvd_writeback_backlog_bytes", "Value bytes waiting for L2"),
    "l2_write_amplification": (
        "kvd_l2_write_amplification",
        "Value bytes written to L2 over bytes of puts written to L2 (1 before any; at most 1.5)",
    ),
}
_L2_COUNTERS = {
    "checksum_failures": ("kvd_checksum_failures", "L2 reads whose bytes failed their checksum"),
    "l2_writes": ("kvd_l2_writes", "Records appended to L2"),
    "l2_write_bytes": ("kvd_l2_write_bytes", "Value bytes appended to L2"),
    "l2_write_errors": ("kvd_l2_write_errors", "L2 appends that failed"),
    "l2_reads": ("kvd_l2_reads", "Records read from L2"),
    "l2_read_bytes": ("kvd_l2_read_bytes", "Value bytes read from L2"),
    "l2_read_errors": ("kvd_l2_read_errors", "L2 reads that failed"),
    "l2_reclaims": ("kvd_l2_reclaims", "L2 segments reclaimed"),
    "l2_reclaimed_records": ("kvd_l2_reclaimed_records", "Records dropped by reclaim"),
    "l2_rewrites": ("kvd_l2_rewrites", "Reclaimed records still in L1 written again"),
    "l2_rewrite_bytes": ("kvd_l2_rewrite_bytes", "Value bytes written again after a reclaim"),
    "l2_rewrites_skipped": (
        "kvd_l2_rewrites_skipped",
        "Reclaimed records still in L1 left there only (rewrite credit spent)",
    ),
    "l1_dropped_unwritten": ("kvd_l1_dropped_unwritten", "L1 values evicted before reaching L2"),
    "l2_held_back": ("kvd_l2_held_back", "Puts not written to L2 at once (l2_admission = twice)"),
    "l2_admitted": ("kvd_l2_admitted", "Held-back values written once referenced again"),
    "l2_never_written": (
        "kvd_l2_never_written",
        "Held-back values evicted from L1 before a second reference",
    ),
    "promotions": ("kvd_l2_promotions", "Values read from L2 into L1"),
}
_STORE_COUNTERS = {
    "evictions": ("kvd_evictions", "Values evicted from L1"),
    "eviction_failures": ("kvd_eviction_failures", "Puts refused: nothing evictable"),
    "put_conflicts": ("kvd_put_conflicts", "Puts refused: key stored with other content"),
    "leases_granted": ("kvd_leases_granted", "Leases granted by Lookup"),
}


def open_l2(config: Config) -> L2Tier | None:
    """The L2 tier over the configured SSD paths, or None without any."""
    if not config.ssd_path:
        return None
    devices = DeviceSet(
        config.ssd_path, config.ssd_bytes, config.ssd_segment_bytes, config.ssd_stripe_bytes
    )
    small = l2_capacity_warning(
        config.dram_bytes, devices.capacity_bytes, devices.logical_segment_bytes
    )
    if small is not None:
        log.warning(small)
    try:
        io = open_backend(config.io_backend, depth=config.io_depth, threads=config.io_threads)
        if config.io_faults:
            log.warning("injecting L2 I/O faults (tests only)", extra={"faults": config.io_faults})
            io = faults.wrap(io, config.io_faults)
    except BaseException:
        devices.close()
        raise
    return L2Tier(devices, io)


class Daemon:
    """Everything one kvd process runs; ``start()`` then ``wait()``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        ignored = values_in_memory()
        if ignored:
            log.warning(
                "PROMETHEUS_MULTIPROC_DIR ignored: kvd keeps its own metrics in memory",
                extra={"dir": ignored},
            )
        self.metrics = Metrics()
        self.pool = Pool(config.dram_bytes, shared=config.shm_pool_reads)
        limits = StoreLimits.from_config(config)
        crashpoints.configure(config.test_crash_point, config.test_crash_after)
        self.l2 = open_l2(config)
        self.store = Store(self.pool, limits, make_policy(config.eviction_policy), l2=self.l2)
        self.auth = Authenticator(config.auth_tokens_file) if config.auth_tokens_file else None
        self.tls = ServerTls.from_config(config)
        self.service = KVStoreService(
            self.store,
            ServiceLimits.from_config(config),
            self.metrics,
            self.auth,
        )
        self.metrics.add_collector(
            SnapshotCollector(self._snapshot, _STORE_GAUGES, _STORE_COUNTERS)
        )
        if self.l2 is not None:
            self.metrics.add_collector(
                SnapshotCollector(self._l2_snapshot, _L2_GAUGES, _L2_COUNTERS)
            )
        self.metrics.add_collector(
            NamespaceCollector(self._namespace_rows, config.metrics_namespaces_max)
        )
        self.health = health.aio.HealthServicer()
        self._server: Any = None
        self._collector: collector.Collector | None = None
        self.fast_paths: FastPaths | None = None
        self.pool_node: PoolNode | None = None
        self.kv_events: KvEventPublisher | None = None
        self._stopping = asyncio.Event()
        self.port = 0
        self.metrics_port = 0

    def _snapshot(self) -> dict[str, int]:
        values = self.store.stats()
        values["inflight_bytes"] = self.service.inflight.bytes
        values["inflight_requests"] = self.service.inflight.requests
        return values

    def _l2_snapshot(self) -> dict[str, float]:
        values: dict[str, float] = dict(self.store.stats())
        writeback = self.store.writeback
        values["writeback_backlog_bytes"] = writeback.backlog_bytes if writeback else 0
        first = values["l2_first_write_bytes"]
        values["l2_write_amplification"] = (
            (first + values["l2_rewrite_bytes"]) / first if first else 1.0
        )
        return values

    def _namespace_rows(self) -> list[NamespaceRow]:
        return [
            (ns.name, ns.bytes_stored, len(ns.entries), ns.hits, ns.misses)
            for ns in self.store.namespaces()
        ]

    async def start(self) -> None:
        cfg = self.config
        # Before recovery: the L2 records it finds are announced as KV events.
        self.kv_events = start_kv_events(cfg, self.store)
        if self.kv_events is not None:
            self.metrics.add_collector(
                SnapshotCollector(self.kv_events.stats, KV_EVENTS_GAUGES, KV_EVENTS_COUNTERS)
            )
        recovered = await self.l2.recover() if self.l2 is not None else 0
        self.store.start()
        # Room for the largest value's framing on top of max_message_bytes.
        message_limit = cfg.max_message_bytes + (1 << 20)
        server = grpc.aio.server(
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", message_limit),
                ("grpc.max_send_message_length", message_limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        add_kvstore(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                kvd_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        if cfg.listen and self.tls is not None:
            self.port = server.add_secure_port(cfg.listen, self.tls.credentials())
            if self.port == 0:
                raise OSError(f"cannot listen on {cfg.listen}")
        elif cfg.listen:
            self.port = server.add_insecure_port(cfg.listen)
            if self.port == 0:
                raise OSError(f"cannot listen on {cfg.listen}")
        if cfg.socket:
            where = os.path.dirname(os.path.abspath(cfg.socket))
            if where == os.path.abspath(cfg.shm_dir):  # the default: made as the shm path makes it
                group = _group_id(cfg.socket_group) if cfg.socket_group else -1
                secure_directory(where, group)
            else:
                os.makedirs(where, exist_ok=True)
            # A socket left by a daemon that died goes; one another daemon
            # still serves is refused (two daemons on the default socket
            # would otherwise take it from each other in silence).
            claim_socket_path(cfg.socket)
            server.add_insecure_port("unix:" + cfg.socket)
        await server.start()
        if cfg.socket:
            os.chmod(cfg.socket, cfg.socket_mode)
            if cfg.socket_group:
                os.chown(cfg.socket, -1, _group_id(cfg.socket_group))
        self._server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.pool_node = await start_pool(cfg, self.store, self.port)
        if self.pool_node is not None:
            self.service.values.pool = self.pool_node.router
            self.metrics.add_collector(
                SnapshotCollector(self.pool_node.stats, POOL_GAUGES, POOL_COUNTERS)
            )
            self.metrics.add_collector(LabelledCollector(self.pool_node.router.reads.traffic.rows))
        if cfg.metrics_listen:
            host, port = parse_address(cfg.metrics_listen)
            self.metrics_port = self.metrics.serve(host, port)
        self.fast_paths = await FastPaths.start(cfg, self.service, self.metrics, self.tls)
        if self.pool_node is not None and self.fast_paths.bulk is not None:
            # Members pin values for their NIXL reads on the bulk port.
            reads = self.pool_node.router.reads
            self.fast_paths.bulk.nixl = reads.nixl
            self.fast_paths.bulk.pool_token = reads.bulk.token.encode()
        if self.pool_node is not None:
            await self.pool_node.join()  # seen by the others once every listener is up
        # Full garbage collections on a clock of the daemon's, not every few
        # seconds for the whole heap (kvd.util.collector).
        self._collector = collector.take_over()
        self.metrics.up.set(1)
        log.info(
            "kvd started",
            extra={
                "version": __version__,
                "listen": f"{cfg.listen.rpartition(':')[0]}:{self.port}" if cfg.listen else "",
                "socket": cfg.socket,
                "bulk": self.fast_paths.bulk_address,
                "shm_dir": cfg.shm_dir if self.service.regions else "",
                "metrics": f"{cfg.metrics_listen.rpartition(':')[0]}:{self.metrics_port}"
                if cfg.metrics_listen
                else "",
                "dram_bytes": self.pool.capacity_bytes,
                "dram_huge_page_bytes": self.pool.huge_page_bytes(),
                "shmem_huge_pages": shmem_mode() if self.pool.shared else "",
                "ssd_paths": ",".join(cfg.ssd_path),
                "ssd_bytes": self.l2.capacity_bytes if self.l2 is not None else 0,
                "ssd_direct": self.l2.devices.direct if self.l2 is not None else False,
                "io_backend": self.l2.io.name if self.l2 is not None else "",
                "l2_recovered": recovered,
                "pages": self.pool.page_count,
                "eviction_policy": cfg.eviction_policy,
                "eviction_learning": LEARNING,
                "max_value_bytes": cfg.max_value_bytes,
                "max_inflight_bytes": cfg.max_inflight_bytes,
                "max_concurrent_rpcs": cfg.max_concurrent_rpcs,
                "auth": f"{self.auth.token_count} tokens" if self.auth is not None else "off",
                "tls": self.tls.mode if self.tls is not None else "off",
                "bulk_tls": "on" if cfg.bulk_tls else "off",
                "pool": len(self.pool_node.membership.members) if self.pool_node else 0,
                "kv_events": cfg.kv_events_endpoint,
                "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
            },
        )
        log.info("kvd config", extra=cfg.describe())
        if cfg.listen and self.tls is None and not is_loopback_host(parse_address(cfg.listen)[0]):
            log.warning(
                "gRPC listens beyond loopback without TLS: tokens and values travel in clear",
                extra={"listen": cfg.listen},
            )
        sd_notify("READY=1")

    def reload(self, new: Config | None) -> None:
        """SIGHUP: apply what can change live; name what needs a restart."""
        failed = False
        if new is not None:
            changed = [
                s.name for s in SETTINGS if getattr(new, s.name) != getattr(self.config, s.name)
            ]
            logs.configure(new.log_level, new.log_format)
            later = [name for name in changed if name not in _LIVE_SETTINGS]
            if later:
                log.warning(
                    "settings changed; they apply at the next restart",
                    extra={"settings": ",".join(later)},
                )
        parts = (("auth_tokens_file", self.auth), ("tls", self.tls), ("pool_tls", self.pool_node))
        for what, part in parts:
            if part is None:
                continue
            try:
                part.reload()
            except ConfigError as exc:
                failed = True
                log.error(
                    "reload failed; keeping the old one", extra={"what": what, "error": str(exc)}
                )
        self.metrics.reloads.labels("error" if failed else "ok").inc()
        log.info(
            "kvd reloaded",
            extra={
                "auth": f"{self.auth.token_count} tokens" if self.auth is not None else "off",
                "tls": self.tls.mode if self.tls is not None else "off",
                "log_level": logging.getLevelName(logging.getLogger().level).lower(),
            },
        )

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait(self) -> None:
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        grace_s = self.config.shutdown_grace_ms / 1000
        log.info("kvd stopping", extra={"grace_ms": self.config.shutdown_grace_ms})
        sd_notify("STOPPING=1")
        self.metrics.up.set(0)
        await self.health.enter_graceful_shutdown()
        if self.pool_node is not None:  # its hand-off comes before the grace
            await self.pool_node.leave(self.config.pool_leave_handoff_ms / 1000)
        deadline = time.monotonic() + grace_s
        # Requests in flight get half the deadline; the write-back flush the rest.
        if self._server is not None:
            await self._server.stop(grace_s / 2)
        if self.fast_paths is not None:
            await self.fast_paths.stop(max(0.0, deadline - time.monotonic()) / 2)
        if self.pool_node is not None:
            await self.pool_node.close()
        left = await self.store.close(flush_s=max(0.0, deadline - time.monotonic()))
        if left:
            log.warning("write-back not finished at shutdown", extra={"values_left": left})
        if self.l2 is not None:
            self.l2.close()
            self.l2.io.close()
            self.l2.devices.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.metrics.close()
        if self._collector is not None:
            collector.give_back(self._collector)
        if self.config.socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)
        log.info("kvd stopped")


# Settings a SIGHUP applies at once; tokens and certificates are re-read from
# their files whether or not their paths changed (a changed path needs a restart).
_LIVE_SETTINGS = frozenset({"log_level", "log_format"})


def _group_id(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise OSError(f"socket_group: no group named {group!r}") from None


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) a state change; a no-op outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return
    if address.startswith("@"):  # abstract socket namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError as exc:
            log.warning("cannot notify systemd", extra={"state": state, "error": str(exc)})


ConfigLoader = Callable[[], "Config"]


def _reload(daemon: Daemon, load: ConfigLoader | None) -> None:
    new: Config | None = None
    if load is not None:
        try:
            new = load()
        except ConfigError as exc:
            log.error(
                "config reload failed; keeping the running settings", extra={"error": str(exc)}
            )
    daemon.reload(new)


async def _serve(config: Config, load: ConfigLoader | None) -> int:
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    loop.add_signal_handler(signal.SIGHUP, _reload, daemon, load)
    await daemon.start()
    await daemon.wait()
    return 0


def run(config: Config, load: ConfigLoader | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT; ``load`` re-reads the config on SIGHUP."""
    logs.configure(config.log_level, config.log_format)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        log.warning("uvloop not installed, using the default asyncio loop")
        return asyncio.run(_serve(config, load))
    return uvloop.run(_serve(config, load))
