"""What the shm tests share: regions made by hand (a sealed memfd, its
flock, a mapping, the attach on the shm socket), as a hostile or careless
client could make them."""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

from kvd.client.regions import SEALS
from kvd.client.shm_socket import RegionOps
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import KVStoreStub

NS = "shm-test"


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
