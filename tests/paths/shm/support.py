"""What the shm tests share: regions made by hand (a sealed memfd, its
flock, a mapping, the attach on the shm socket), as a hostile or careless
client could make them."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from kvd.client.regions import SEALS
from kvd.client.shm_socket import RegionOps
from kvd.config.settings import Config
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import ServiceLimits
from kvd.paths.ops.region_ops import RegionOps as DaemonRegionOps
from kvd.paths.ops.values import ValueOps
from kvd.paths.shm.regions import Caller, Region, RegionLimits, RegionRegistry
from kvd.store.index import StoreLimits
from kvd.store.store import Store
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import KVStoreStub

NS = "shm-test"
REGION_BYTES = 16 << 20  # a rig's region
CALLER = Caller(os.geteuid(), os.getpid())  # a rig's caller: this process


def sealed_memfd(size: int, seals: int = SEALS) -> int:
    fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def shared_lock(fd: int) -> int:
    """A shared flock on a file description of its own (the daemon's liveness test)."""
    lock_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(lock_fd, fcntl.LOCK_SH)
    return lock_fd


def attach_fd(stub: KVStoreStub, fd: int, size: int) -> tuple[int, bytes]:
    """Attach ``fd`` on the daemon's shm socket, as the client library does."""
    ops = RegionOps(stub.DescribePaths(pb.DescribePathsRequest()).shm_socket, None, 5.0)
    try:
        return ops.attach(fd, size)
    finally:
        ops.close()


class RawRegion:
    """A region made by hand: sealed memfd, flock, mapping, attach."""

    def __init__(self, stub: KVStoreStub, shm_dir: str, name: str, size: int) -> None:
        del shm_dir, name  # regions are memfds: no file in the shm directory
        self.fd = sealed_memfd(size)
        self.lock_fd = shared_lock(self.fd)
        self.map = mmap.mmap(self.fd, size)
        self.region_id, self.token = attach_fd(stub, self.fd, size)

    def put(self, stub: KVStoreStub, key: bytes, offset: int, length: int) -> int:
        request = pb.PutFromRegionRequest(
            region_id=self.region_id,
            token=self.token,
            namespace=NS,
            items=[pb.RegionItem(key=key, offset=offset, length=length)],
        )
        return int(stub.PutFromRegion(request).results[0].code)

    def get(self, stub: KVStoreStub, key: bytes, offset: int, length: int) -> Any:
        request = pb.GetIntoRegionRequest(
            region_id=self.region_id,
            token=self.token,
            namespace=NS,
            items=[pb.RegionItem(key=key, offset=offset, length=length)],
        )
        return stub.GetIntoRegion(request).results[0]


@dataclass
class Rig:
    """A daemon's region ops in process (a store of 40 MiB), and one region
    attached for ``CALLER`` with this process's mapping of it."""

    ops: DaemonRegionOps
    region: Region
    map: mmap.mmap


@contextlib.contextmanager
def region_rig() -> Iterator[Rig]:
    store = Store(Pool((40 << 20) // PAGE_BYTES * PAGE_BYTES), StoreLimits.from_config(Config()))
    limits = replace(
        ServiceLimits.from_config(Config()),
        max_message_bytes=4 << 20,
        max_inflight_bytes=64 << 20,
        max_batch_items=64,
    )
    ops = DaemonRegionOps(ValueOps(store, limits, Metrics()))
    registry = RegionRegistry(RegionLimits.from_config(Config()))
    ops.enable_fast_paths(registry, 0)
    fd = sealed_memfd(REGION_BYTES)
    lock_fd = shared_lock(fd)
    mapping = mmap.mmap(fd, REGION_BYTES)
    try:
        yield Rig(ops, registry.attach(os.dup(fd), REGION_BYTES, CALLER), mapping)
    finally:
        ops.close_fast_paths()
        mapping.close()
        os.close(fd)
        os.close(lock_fd)
