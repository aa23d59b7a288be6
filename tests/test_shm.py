"""Shared-memory path against a real daemon: round trips through the client,
and bad input straight on the region RPCs (offsets outside the region,
foreign or detached ids, files deleted or shrunk under the daemon, a client
killed while holding regions)."""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvd.client import Client, InvalidArgument, ResourceExhausted
from kvd.grpc_handlers import KVStoreStub
from kvd.shm import PIECE_BYTES, copy_slices
from kvd.shm_service import SPLIT_COPY_BYTES
from kvd.v1 import kvd_pb2 as pb
from tests.conftest import DaemonFactory, DaemonProcess, wait_until

NS = "shm-test"


@pytest.fixture
def shm_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory("--region-check-ms", "50", "--max-regions-per-client", "4")


@pytest.fixture
def stub(shm_daemon: DaemonProcess) -> Iterator[KVStoreStub]:
    with grpc.insecure_channel(shm_daemon.socket_target) as channel:
        yield KVStoreStub(channel)


class RawRegion:
    """A region made by hand: file, flock, mapping, attach; nothing unlinked."""

    def __init__(self, stub: KVStoreStub, shm_dir: str, name: str, size: int) -> None:
        self.path = os.path.join(shm_dir, name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        self.map = mmap.mmap(self.fd, size)
        response = stub.AttachRegion(pb.AttachRegionRequest(name=name, size=size))
        self.region_id, self.token = response.region_id, response.token

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


def _shm_dir(stub: KVStoreStub) -> str:
    return str(stub.DescribePaths(pb.DescribePathsRequest()).shm_dir)


def _attached(stub: KVStoreStub) -> int:
    return int(stub.DescribePaths(pb.DescribePathsRequest()).regions_attached)


def test_client_round_trip_through_regions(shm_daemon: DaemonProcess) -> None:
    value = os.urandom(3 << 20)
    with Client(shm_daemon.socket_target) as client:
        assert client.put(NS, b"k", value) is False
        assert client.put(NS, b"k", value) is True
        assert client.get(NS, b"k") == value
        assert client.get(NS, b"missing") is None
        buffer = client.buffer(4 << 20)  # single copy: the daemon writes it directly
        assert client.get_into(NS, b"k", buffer) == len(value)
        assert bytes(buffer[: len(value)]) == value
        plain = bytearray(len(value))  # not in a region: one more copy
        assert client.get_into(NS, b"k", plain) == len(value) and plain == value
        with pytest.raises(InvalidArgument):
            client.get_into(NS, b"k", bytearray(10))
        with pytest.raises(InvalidArgument):  # in a region too (one frame, no batch)
            client.get_into(NS, b"k", buffer[:10])
        assert client.get_into(NS, b"missing", buffer) is None
        assert client.get_into(NS, b"k", buffer[4096:]) == len(value)  # at an offset
        assert bytes(buffer[4096 : 4096 + len(value)]) == value
        buffer[:5] = b"hello"
        assert client.put(NS, b"from-buffer", buffer[:5]) is False
        items = [(b"a", value), (b"b", b"x" * 1000), (b"c", buffer[:5])]
        assert client.put_many(NS, items, chained=True) == [False, False, False]
        assert client.get_many(NS, [b"a", b"b", b"c", b"z"]) == [value, b"x" * 1000, b"hello", None]
        # One batch into region buffers: each value lands where its buffer lies.
        room = client.buffer(8 << 20)
        parts = [room[: 4 << 20], room[4 << 20 : (4 << 20) + 1000], room[(5 << 20) :]]
        assert client.get_many_into(NS, [b"a", b"b", b"z"], parts) == [len(value), 1000, None]
        assert bytes(parts[0][: len(value)]) == value and bytes(parts[1]) == b"x" * 1000
        # Region and plain buffers mixed: the plain one goes through staging.
        mixed = [room[:10], bytearray(1000), room[4 << 20 : 5 << 20]]
        assert client.get_many_into(NS, [b"c", b"b", b"c"], mixed) == [5, 1000, 5]
        assert bytes(mixed[1]) == b"x" * 1000 and bytes(room[:5]) == b"hello"
        del parts, mixed, room
        assert client.stats()["entries"] == 5
        # The files were unlinked once attached: a crash leaves nothing behind.
        assert os.listdir(_shm_dir_of(shm_daemon)) == ["kvd.sock"]  # only the shm socket
        del buffer


def test_large_values_are_copied_by_several_threads(daemon_factory: DaemonFactory) -> None:
    """Values over SPLIT_COPY_BYTES, alone and in a batch: copied in slices
    on several threads, hashed after; every byte arrives, both ways."""
    daemon = daemon_factory("--dram-bytes", "256MiB", "--max-value-bytes", "32MiB")
    size = SPLIT_COPY_BYTES + (3 << 20) + 5  # not a whole number of pieces
    values = [os.urandom(size), os.urandom(size)]
    with Client(daemon.socket_target) as client:
        room = client.buffer(2 * size)
        for i, value in enumerate(values):
            room[:size] = value
            assert client.put(NS, b"big%d" % i, room[:size]) is False
        room[:] = bytes(2 * size)
        assert client.get_into(NS, b"big0", room[:size]) == size  # alone: split
        assert bytes(room[:size]) == values[0]
        halves = [room[:size], room[size:]]
        assert client.get_many_into(NS, [b"big1", b"big0"], halves) == [size, size]
        assert bytes(halves[0]) == values[1] and bytes(halves[1]) == values[0]
        assert client.get(NS, b"big1") == values[1]
        del room, halves


def test_copy_slices_cover_the_value_at_piece_boundaries() -> None:
    for length in (0, 1, PIECE_BYTES, 5 * PIECE_BYTES + 3, 64 * PIECE_BYTES):
        for parts in (1, 2, 3, 8):
            slices = copy_slices(length, parts)
            assert len(slices) <= parts
            assert slices[0][0] == 0 and slices[-1][1] == length
            assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
            assert all(lo % PIECE_BYTES == 0 for lo, _ in slices)


def _shm_dir_of(daemon: DaemonProcess) -> str:
    return str(daemon.workdir / "shm")


def test_offsets_outside_the_region_are_refused_per_item(stub: KVStoreStub) -> None:
    region = RawRegion(stub, _shm_dir(stub), "r1", 1 << 20)
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert region.put(stub, b"k", (1 << 20) - 10, 11) == invalid
    assert region.put(stub, b"k", 1 << 40, 1) == invalid
    assert region.get(stub, b"k", 0, (1 << 20) + 1).code == invalid
    region.map[:4] = b"good"
    assert region.put(stub, b"k", 0, 4) == 0
    assert region.get(stub, b"k", 100, 4).size == 4
    assert region.map[100:104] == b"good"
    assert region.get(stub, b"k", 0, 2).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_detached_and_foreign_regions_are_not_found(stub: KVStoreStub) -> None:
    region = RawRegion(stub, _shm_dir(stub), "r2", 1 << 16)
    request = pb.GetIntoRegionRequest(region_id=region.region_id, token=b"x" * 16, namespace=NS)
    with pytest.raises(grpc.RpcError) as foreign:
        stub.GetIntoRegion(request)
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    stub.DetachRegion(pb.DetachRegionRequest(region_id=region.region_id, token=region.token))
    with pytest.raises(grpc.RpcError) as detached:
        region.put(stub, b"k", 0, 1)
    assert detached.value.code() == grpc.StatusCode.NOT_FOUND
    assert _attached(stub) == 0


def test_attach_checks_name_size_lock_and_limits(stub: KVStoreStub) -> None:
    shm_dir = _shm_dir(stub)
    for name, size in (("../escape", 4096), (".hidden", 4096)):
        with pytest.raises(grpc.RpcError) as bad:
            stub.AttachRegion(pb.AttachRegionRequest(name=name, size=size))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fd = os.open(os.path.join(shm_dir, "unlocked"), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    with pytest.raises(grpc.RpcError) as unlocked:
        stub.AttachRegion(pb.AttachRegionRequest(name="unlocked", size=4096))
    assert "flock" in unlocked.value.details()
    with pytest.raises(grpc.RpcError) as wrong_size:
        fcntl.flock(fd, fcntl.LOCK_SH)
        stub.AttachRegion(pb.AttachRegionRequest(name="unlocked", size=8192))
    assert wrong_size.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    regions = [RawRegion(stub, shm_dir, f"many{i}", 4096) for i in range(4)]
    with pytest.raises(grpc.RpcError) as too_many:
        RawRegion(stub, shm_dir, "one-too-many", 4096)
    assert too_many.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(regions) == _attached(stub) == 4


def test_region_file_deleted_or_shrunk_under_the_daemon(stub: KVStoreStub) -> None:
    region = RawRegion(stub, _shm_dir(stub), "r3", 1 << 16)
    region.map[:3] = b"abc"
    os.unlink(region.path)  # the mapping keeps the memory: still usable
    assert region.put(stub, b"deleted", 0, 3) == 0
    assert region.get(stub, b"deleted", 10, 3).size == 3 and region.map[10:13] == b"abc"
    region.map.close()
    os.ftruncate(region.fd, 4096)  # a copy past the end would SIGBUS: retired instead
    with pytest.raises(grpc.RpcError) as shrunk:
        region.put(stub, b"shrunk", 0, 8192)
    assert shrunk.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _attached(stub) == 0
    assert stub.Exists(pb.ExistsRequest(namespace=NS, keys=[b"shrunk"])).exists == [False]


def test_regions_of_a_killed_client_are_freed(
    shm_daemon: DaemonProcess, stub: KVStoreStub, tmp_path: Path
) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from kvd.client import Client
        client = Client({shm_daemon.socket_target!r})
        buffers = [client.buffer(1 << 20) for _ in range(3)]
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert _attached(stub) == 4  # three buffers and the staging region
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_until(lambda: _attached(stub) == 0, timeout_s=10)
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    assert any("owner is gone" in line for line in shm_daemon.log)
    with Client(shm_daemon.socket_target) as client:  # still serving
        client.put(NS, b"after", b"x" * 100)
        assert client.get(NS, b"after") == b"x" * 100
    # The dead client's regions no longer count against anyone: this process
    # attaches its full max_regions_per_client (4) on the same Unix socket.
    with Client(shm_daemon.socket_target) as client:
        held = [client.buffer(1 << 16) for _ in range(3)]  # plus its staging region
        with pytest.raises(ResourceExhausted):
            client.buffer(1 << 16)
        assert len(held) == 3 and _attached(stub) == 4


def test_region_limit_is_per_process_on_a_shared_unix_socket(
    shm_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    """Every client of a Unix socket has the same gRPC peer string: the
    per-client limit counts regions per process (the flock holder) instead."""
    script = textwrap.dedent(
        f"""
        from kvd.client import Client, ResourceExhausted
        client = Client({shm_daemon.socket_target!r})
        buffers = [client.buffer(1 << 16) for _ in range(3)]
        try:
            client.buffer(1 << 16)
        except ResourceExhausted:
            print("limited", flush=True)
        """
    )
    with Client(shm_daemon.socket_target) as mine:
        held = [mine.buffer(1 << 16) for _ in range(3)]
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == "limited", done.stderr
        assert len(held) == 3


def test_client_reports_the_paths_it_uses(
    shm_daemon: DaemonProcess, daemon_factory: DaemonFactory
) -> None:
    with Client(shm_daemon.socket_target) as client:
        assert client.paths == {"shm", "shm-socket"}
    with Client(shm_daemon.target) as client:
        assert client.paths == {"bulk"}
    with Client(shm_daemon.target, shm=False, bulk=False) as client:
        assert client.paths == frozenset()
    # A second daemon on the same shm directory cannot have its shm socket
    # (the first holds it): its clients' region ops go over gRPC, and say so.
    second = daemon_factory("--shm-dir", _shm_dir_of(shm_daemon))
    with Client(second.socket_target) as client:
        assert client.paths == {"shm"}
        assert client.put(NS, b"k", b"v" * 5000) is False
        assert client.get(NS, b"k") == b"v" * 5000
