"""What the daemon starts and stops for its fast paths: the shared-memory
region registry and the task that frees regions of clients that exited, the
shm socket (``kvd.paths.shm.channel``) and the bulk TCP server (``kvd.paths.bulk.server``),
with their gauges. The ops they serve are the gRPC service's ``RegionOps``
(``kvd.paths.ops.region_ops``) and ``ValueOps`` (``kvd.paths.ops.values``).

Regions are attached on the shm socket only (their memfds travel with
SCM_RIGHTS), so a daemon without its shm socket has no shared-memory path;
the socket has the gRPC socket's ``socket_mode`` and ``socket_group``.
"""

from __future__ import annotations

import asyncio
import grp
import logging
from typing import TYPE_CHECKING

from kvd.config.addresses import parse_address
from kvd.io.backend import CopyMany, native_copy_many
from kvd.paths.bulk.limits import BulkLimits
from kvd.paths.bulk.server import BulkServer
from kvd.paths.metrics import Metrics, SnapshotCollector
from kvd.paths.shm.channel import ShmChannel
from kvd.paths.shm.regions import RegionLimits, RegionRegistry
from kvd.wire.shm import socket_path

if TYPE_CHECKING:
    from kvd.config.settings import Config
    from kvd.daemon.tls import ServerTls
    from kvd.paths.grpc.service import KVStoreService
    from kvd.paths.ops.region_ops import RegionOps

log = logging.getLogger("kvd.fastpaths")


class FastPaths:
    """The daemon's shared-memory registry, its reaper task and the bulk TCP server."""

    def __init__(self, ops: RegionOps, regions: RegionRegistry | None) -> None:
        self.ops = ops
        self.regions = regions
        self.bulk: BulkServer | None = None
        self.bulk_address = ""
        self.channel: ShmChannel | None = None
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls, config: Config, service: KVStoreService, metrics: Metrics, tls: ServerTls | None
    ) -> FastPaths:
        """``tls``: the listeners' certificates, for the bulk port with ``bulk_tls``."""
        ops = service.region_ops
        regions: RegionRegistry | None = RegionRegistry(
            RegionLimits.from_config(config),
        )
        paths = cls(ops, regions)
        limits = BulkLimits.from_config(config)
        channel = ShmChannel(
            ops,
            socket_path(config.shm_dir, config.shm_socket),
            limits,
            mode=config.socket_mode,
            group_id=_group_id(config.socket_group),
        )
        try:
            await channel.start()
            paths.channel = channel
            ops.shm_socket = channel.path
        except OSError as exc:
            # Regions are attached on the socket: without it, gRPC and bulk TCP only.
            log.warning("shared-memory path off", extra={"path": channel.path, "reason": str(exc)})
            regions = paths.regions = None
        if config.bulk_listen:
            host, port = parse_address(config.bulk_listen)
            bulk_tls = tls.bulk_context if tls is not None and config.bulk_tls else None
            paths.bulk = BulkServer(ops.values, limits, ops.auth, bulk_tls)
            bound = await paths.bulk.start(host, port)
            paths.bulk_address = f"{host}:{bound}"
        bulk = paths.bulk
        ops.enable_fast_paths(
            regions, bulk.port if bulk else 0, bulk is not None and bulk.tls is not None
        )
        ops.copy_many = _region_copies(config.io_backend)
        ops.l2_direct_min_bytes = config.shm_l2_direct_min_bytes
        ops.pool_reads = config.shm_pool_reads and regions is not None
        metrics.add_collector(
            SnapshotCollector(paths._snapshot, _FAST_PATH_GAUGES, _FAST_PATH_COUNTERS)
        )
        if regions is not None:
            paths._reaper = asyncio.create_task(
                _reap_forever(regions, config.region_check_ms / 1000)
            )
        return paths

    def _snapshot(self) -> dict[str, int]:
        regions = self.ops.regions
        return {
            "regions": regions.count if regions else 0,
            "region_bytes": regions.mapped_bytes if regions else 0,
            "regions_reaped": regions.reaped if regions else 0,
            "bulk_connections": self.bulk.connection_count if self.bulk else 0,
            "shm_connections": self.channel.connection_count if self.channel else 0,
            "shm_pool_pins": self.channel.pool_pins if self.channel else 0,
        }

    async def stop(self, grace_s: float) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        if self.bulk is not None:
            await self.bulk.stop(grace_s)
        if self.channel is not None:
            await self.channel.stop()
        self.ops.close_fast_paths()


_FAST_PATH_GAUGES = {
    "regions": ("kvd_regions", "Shared-memory regions attached"),
    "region_bytes": ("kvd_region_bytes", "Bytes of shared-memory regions mapped"),
    "bulk_connections": ("kvd_bulk_connections", "Bulk TCP connections open"),
    "shm_connections": ("kvd_shm_connections", "shm socket connections open"),
    "shm_pool_pins": ("kvd_shm_pool_pins", "L1 pins held for clients that read the pool"),
}
_FAST_PATH_COUNTERS = {
    "regions_reaped": ("kvd_regions_reaped", "Regions freed because their owner exited"),
}


def _region_copies(io_backend: str) -> CopyMany | None:
    """The region copies' native batch, or None for numpy and xxhash; logged.
    The threads I/O backend means no native code, as for the L2 record checks."""
    native = native_copy_many()
    if native is not None and io_backend != "threads":
        log.info("region copies native", extra={"impl": "kvd.io._uring.copy_many"})
        return native
    reason = "io_backend threads" if native is not None else "kvd.io._uring is not built"
    log.info("region copies in Python", extra={"impl": "numpy and xxhash", "reason": reason})
    return None


def _group_id(group: str) -> int:
    """The gid ``socket_group`` names; -1 (the daemon's own) when empty or unknown
    (the gRPC socket's set-up has already refused an unknown one)."""
    if not group:
        return -1
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return -1


async def _reap_forever(regions: RegionRegistry, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        regions.reap()
