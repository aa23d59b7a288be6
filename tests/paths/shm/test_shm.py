"""Shared-memory path against a real daemon: round trips through the client,
and bad input straight on the region calls (offsets outside the region,
foreign or detached ids, descriptors that are not sealed memfds, regions
that try to shrink, a client killed while holding regions)."""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvd.client import Client, InvalidArgument, ResourceExhausted
from kvd.paths.ops.region_ops import SPLIT_COPY_BYTES
from kvd.paths.shm.regions import PIECE_BYTES, POPULATE_BYTES_MAX, _populate, copy_slices
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import KvdError
from kvd.wire.grpc import KVStoreStub
from tests.paths.shm.support import NS, RawRegion, attach_fd, sealed_memfd, shared_lock
from tests.support import DaemonFactory, DaemonProcess, wait_until


@pytest.fixture
def shm_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory("--region-check-ms", "50", "--max-regions-per-client", "4")


@pytest.fixture
def stub(shm_daemon: DaemonProcess) -> Iterator[KVStoreStub]:
    with grpc.insecure_channel(shm_daemon.socket_target) as channel:
        yield KVStoreStub(channel)


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
        # Regions are memfds: the shm directory holds nothing but the socket.
        assert os.listdir(_shm_dir_of(shm_daemon)) == ["kvd.sock"]
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


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_a_fresh_region_is_mapped_with_its_pages_in_place(daemon_factory: DaemonFactory) -> None:
    """The daemon maps a region's pages at attach, so the first get into it
    does not fault one 4 KiB page at a time (4,096 faults for 16 MiB)."""
    daemon = daemon_factory("--dram-bytes", "256MiB", "--max-value-bytes", "32MiB")
    value = os.urandom(16 << 20)
    with Client(daemon.socket_target) as client:
        assert client.put(NS, b"v", value) is False
        room = client.buffer(len(value))  # a region the daemon has never written
        before = _minor_faults(daemon.proc.pid)
        assert client.get_into(NS, b"v", room) == len(value)
        faults = _minor_faults(daemon.proc.pid) - before
        assert bytes(room) == value
        assert faults < 256, f"{faults} page faults in the daemon for one 16 MiB get"
        del room


def test_a_region_with_holes_is_not_populated() -> None:
    """The daemon maps only a region the client allocated in full with all
    its pages: populating holes would allocate them on the daemon's account."""
    fd = os.memfd_create("holes", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 1 << 20)
        assert not _populate(os.fstat(fd), 1 << 20)
        os.posix_fallocate(fd, 0, 1 << 20)
        assert _populate(os.fstat(fd), 1 << 20)
        assert not _populate(os.fstat(fd), POPULATE_BYTES_MAX + 4096)  # too large: no stall
    finally:
        os.close(fd)


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
    region = RawRegion(stub, "", "", 1 << 20)
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
    region = RawRegion(stub, "", "", 1 << 16)
    request = pb.GetIntoRegionRequest(region_id=region.region_id, token=b"x" * 16, namespace=NS)
    with pytest.raises(grpc.RpcError) as foreign:
        stub.GetIntoRegion(request)
    assert foreign.value.code() == grpc.StatusCode.NOT_FOUND
    stub.DetachRegion(pb.DetachRegionRequest(region_id=region.region_id, token=region.token))
    with pytest.raises(grpc.RpcError) as detached:
        region.put(stub, b"k", 0, 1)
    assert detached.value.code() == grpc.StatusCode.NOT_FOUND
    assert _attached(stub) == 0


def _refused(stub: KVStoreStub, fd: int, size: int) -> KvdError:
    with pytest.raises(KvdError) as refused:
        attach_fd(stub, fd, size)
    return refused.value


def test_attach_takes_only_sealed_locked_memfds_within_limits(
    stub: KVStoreStub, tmp_path: Path
) -> None:
    with pytest.raises(grpc.RpcError) as by_name:  # the old way: a file named in shm_dir
        stub.AttachRegion(pb.AttachRegionRequest(name="r1", size=4096))
    assert by_name.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)  # not a memfd
    os.ftruncate(plain, 4096)
    shared_lock(plain)
    assert "memfd" in str(_refused(stub, plain, 4096))
    unsealed = sealed_memfd(4096, seals=0)  # could shrink under the daemon
    shared_lock(unsealed)
    assert "F_SEAL_SHRINK" in str(_refused(stub, unsealed, 4096))
    half = sealed_memfd(4096, seals=fcntl.F_SEAL_SHRINK)  # could still grow and take a write seal
    shared_lock(half)
    assert "F_SEAL_SHRINK" in str(_refused(stub, half, 4096))
    unlocked = sealed_memfd(4096)
    assert "flock" in str(_refused(stub, unlocked, 4096))
    locked = sealed_memfd(4096)
    shared_lock(locked)
    assert isinstance(_refused(stub, locked, 8192), InvalidArgument)  # not its size
    reader = os.open(f"/proc/self/fd/{locked}", os.O_RDONLY)  # no write access
    assert "reading and writing" in str(_refused(stub, reader, 4096))
    regions = [RawRegion(stub, "", "", 4096) for _ in range(4)]
    with pytest.raises(ResourceExhausted):
        RawRegion(stub, "", "", 4096)
    assert len(regions) == _attached(stub) == 4


def test_a_sealed_region_cannot_shrink_or_grow_under_the_daemon(stub: KVStoreStub) -> None:
    region = RawRegion(stub, "", "", 1 << 16)
    region.map[:3] = b"abc"
    for size in (0, 4096, 1 << 20):
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, size)
    with pytest.raises(PermissionError):  # nor be unsealed
        fcntl.fcntl(region.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert region.put(stub, b"sealed", 0, 3) == 0
    assert region.get(stub, b"sealed", 10, 3).size == 3 and region.map[10:13] == b"abc"
    assert _attached(stub) == 1


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
    per-client limit counts regions per process (the attaching peer's pid)."""
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
    # (the first holds it): regions are attached there, so it has no
    # shared-memory path, and its clients use gRPC.
    second = daemon_factory("--shm-dir", _shm_dir_of(shm_daemon))
    with Client(second.socket_target) as client:
        assert client.paths == frozenset()
        assert client.put(NS, b"k", b"v" * 5000) is False
        assert client.get(NS, b"k") == b"v" * 5000


def test_a_gone_daemon_is_logged_once_a_minute_not_once_a_call(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Every shm call meets a daemon that is gone; the client says so once
    (a warning, then at most one a minute), not once per call."""
    daemon = daemon_factory()
    with Client(daemon.socket_target, timeout_s=2) as client:
        room = client.buffer(1000)
        client.put("ns", b"k", b"v" * 1000)
        assert daemon.stop() == 0
        for _ in range(5):
            with pytest.raises(KvdError):
                client.get_into("ns", b"k", room)
    gone = [
        r for r in caplog.records if r.name == "kvd.client" and "none answers" in r.getMessage()
    ]
    assert len(gone) == 1, [r.getMessage() for r in caplog.records]
    assert getattr(gone[0], "reason", "") and getattr(gone[0], "held_back", None) == 0


def test_a_restarted_daemon_gets_the_client_regions_again(
    daemon_factory: DaemonFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon restart (new pid, no regions) is met by the next call: the
    client attaches its regions to the new daemon and tries that call once
    more, says so in a warning with the reason, and buffers handed out
    before the restart keep working."""
    where = tmp_path / "restarted"
    first = daemon_factory(workdir=where)
    value = os.urandom(300_000)
    with Client(first.socket_target, timeout_s=5) as client:
        room = client.buffer(len(value))
        client.put("ns", b"k", value)
        assert client.get_into("ns", b"k", room) == len(value) and bytes(room) == value
        assert first.stop() == 0
        second = daemon_factory(workdir=where)
        room[:] = bytes(len(value))
        # The first call meets the restart, attaches the regions anew and retries once.
        assert client.get_into("ns", b"k", room) == len(value) and bytes(room) == value
        assert "shm-socket" in client.paths
        assert client.stats()["l2_hits"] == 1
        batch = [client.buffer(len(value)), room]
        client.put("ns", b"k2", value[::-1])
        assert second.stop() == 0
        third = daemon_factory(workdir=where)
        # A new buffer is the first call to meet this restart.
        batch.append(client.buffer(len(value)))
        assert client.get_many_into("ns", [b"k2", b"k", b"k"], batch) == [len(value)] * 3
        assert bytes(batch[0]) == value[::-1] and bytes(batch[1]) == bytes(batch[2]) == value
    assert third.alive()
    renewals = [r for r in caplog.records if r.name == "kvd.client" and "again" in r.getMessage()]
    assert len(renewals) == 2, [r.getMessage() for r in renewals]
    assert all(getattr(r, "reason", "") for r in renewals)
