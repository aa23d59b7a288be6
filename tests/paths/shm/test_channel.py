"""The shm socket against a real daemon: the client's region ops go over it,
answers match the gRPC region calls, and bad input (wrong magic, no HELLO,
truncated or slow frames, foreign tokens, bad tokens, namespaces outside the
token) closes the connection or is answered with a code, losing nothing."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvd.client import Client
from kvd.client.bulk import BulkClient
from kvd.paths.bulk.server import (
    CODE_NOT_FOUND,
    CODE_OK,
    OP_HELLO,
    OP_REGION_GET,
    OP_REGION_PUT,
    RESPONSE,
    encode_request,
)
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import PermissionDenied, Unauthenticated, Unavailable
from kvd.wire.grpc import KVStoreStub
from kvd.wire.shm import REGION_REF, SOCKET_NAME, TIER_SHIFT
from tests.paths.shm.support import RawRegion
from tests.paths.support import TOKEN_A, token_file
from tests.sockets import closed_by_daemon, metric, recv_exact
from tests.support import DaemonFactory, DaemonProcess, wait_until

NS = "shm-test"
CODES = {code.name: int(code.value[0]) for code in grpc.StatusCode}


@pytest.fixture
def channel_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory("--bulk-frame-timeout-ms", "300")


@pytest.fixture
def stub(channel_daemon: DaemonProcess) -> Iterator[KVStoreStub]:
    with grpc.insecure_channel(channel_daemon.socket_target) as ch:
        yield KVStoreStub(ch)


def _paths(stub: KVStoreStub) -> pb.DescribePathsResponse:
    return stub.DescribePaths(pb.DescribePathsRequest())


def _connect(path: str, token: bytes = b"") -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    sock.sendall(encode_request(OP_HELLO, 0, length=len(token)) + token)
    header = recv_exact(sock, RESPONSE.size)
    return sock, RESPONSE.unpack(header)[5]


def _frame(
    op: int, region: RawRegion, key: bytes, offset: int, length: int, ns: str = NS, rid: int = 1
) -> bytes:
    header = encode_request(op, rid, ns.encode(), key, length=length)
    ref = REGION_REF.pack(region.region_id, offset, region.token)
    return header[: RESPONSE.size] + ref + header[RESPONSE.size :]


def _answer(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(code, flags, length, message) of one answer."""
    _, _, _, flags, _, code, meta_len, msg_len, length, _ = RESPONSE.unpack(
        recv_exact(sock, RESPONSE.size)
    )
    tail = recv_exact(sock, meta_len + msg_len)
    return code, flags, length, tail[meta_len:]


def _logged(daemon: DaemonProcess, reason: str) -> bool:
    return wait_until(
        lambda: any("shm socket connection closed" in x and reason in x for x in daemon.log),
        timeout_s=5,
    )


def test_client_region_ops_go_over_the_shm_socket(
    channel_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    path = _paths(stub).shm_socket
    assert path == str(channel_daemon.workdir / "shm" / SOCKET_NAME)
    value = bytes(range(256)) * 8192  # 2 MiB: copied on a worker thread
    with Client(channel_daemon.socket_target) as client:
        buffer = client.buffer(len(value))
        buffer[:] = value
        assert client.put(NS, b"big", buffer) is False
        client.put_many(NS, [(b"a", b"x" * 100), (b"b", b"y" * 70_000)])
        assert client.get_many(NS, [b"a", b"b", b"nope"]) == [b"x" * 100, b"y" * 70_000, None]
        buffer[:] = b"\0" * len(value)
        assert client.get_into(NS, b"big", buffer) == len(value)
        assert bytes(buffer) == value
        assert metric(channel_daemon.metrics_port, "kvd_shm_connections") >= 1
    assert wait_until(lambda: metric(channel_daemon.metrics_port, "kvd_shm_connections") == 0)


def test_answers_match_the_grpc_region_calls(
    channel_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    region = RawRegion(stub, _paths(stub).shm_dir, "c1", 1 << 20)
    sock, code = _connect(_paths(stub).shm_socket)
    assert code == CODE_OK
    region.map[:5] = b"hello"
    sock.sendall(_frame(OP_REGION_PUT, region, b"k", 0, 5))
    assert _answer(sock)[0] == CODE_OK
    sock.sendall(_frame(OP_REGION_GET, region, b"k", 4096, 100))
    code, flags, length, _ = _answer(sock)
    assert (code, length, flags >> TIER_SHIFT) == (CODE_OK, 5, pb.TIER_L1)
    assert region.map[4096:4101] == b"hello"
    assert region.get(stub, b"k", 8192, 5).size == 5  # and gRPC sees the same value
    sock.sendall(_frame(OP_REGION_GET, region, b"absent", 0, 100))
    assert _answer(sock)[0] == CODE_NOT_FOUND
    # Per item, like GetIntoRegion: too little room, outside the region.
    sock.sendall(_frame(OP_REGION_GET, region, b"k", 0, 2))
    code, _, length, _ = _answer(sock)
    assert (code, length) == (CODES["RESOURCE_EXHAUSTED"], 5)
    sock.sendall(_frame(OP_REGION_GET, region, b"k", (1 << 20) - 2, 5))
    assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]
    sock.sendall(_frame(OP_REGION_PUT, region, b"k2", 1 << 40, 1))
    assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]
    # Another client's token reads as an unknown region; the connection stays.
    foreign = RawRegion(stub, _paths(stub).shm_dir, "c2", 1 << 16)
    foreign.token = b"x" * 16
    sock.sendall(_frame(OP_REGION_GET, foreign, b"k", 0, 5))
    assert _answer(sock)[0] == CODES["NOT_FOUND"]
    sock.sendall(_frame(OP_REGION_GET, region, b"k", 0, 5))
    assert _answer(sock)[0] == CODE_OK
    sock.close()


def test_pipelined_ops_run_together_and_are_answered_in_order(
    channel_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    """16 frames in one send (hits of different sizes, misses, a bad offset):
    the daemon starts them together, and the answers come back in request
    order, each with its own result; closing right after sending still gets
    every answer."""
    size = 36 << 20  # the six values at 2 MiB steps, then twelve 2 MiB rooms to read into
    region = RawRegion(stub, _paths(stub).shm_dir, "pipe", size)

    def room(rid: int) -> int:
        return (12 << 20) + (rid // 8 * 6 + rid % 8) * (2 << 20)

    sizes = [(i + 1) * 300_000 for i in range(6)]  # 0.3..1.8 MiB: some copy on threads
    for i, n in enumerate(sizes):
        region.map[i << 21 : (i << 21) + n] = bytes([i + 1]) * n
        assert region.put(stub, b"p%d" % i, i << 21, n) == CODE_OK
    frames, expected = [], []
    for rid in range(16):
        i = rid % 8
        if i < 6:  # a hit, read to a new place
            frames.append(_frame(OP_REGION_GET, region, b"p%d" % i, room(rid), 2 << 20, rid=rid))
            expected.append((CODE_OK, sizes[i]))
        elif i == 6:
            frames.append(_frame(OP_REGION_GET, region, b"nope", 0, 100, rid=rid))
            expected.append((CODE_NOT_FOUND, 0))
        else:
            frames.append(_frame(OP_REGION_GET, region, b"p0", size - 10, 100, rid=rid))
            expected.append((CODES["INVALID_ARGUMENT"], 0))
    sock, _ = _connect(_paths(stub).shm_socket)
    sock.sendall(b"".join(frames))
    sock.shutdown(socket.SHUT_WR)  # closed between frames: what was sent is still answered
    for rid, (code, length) in enumerate(expected):
        header = recv_exact(sock, RESPONSE.size)
        _, _, _, _, answered, got, meta_len, msg_len, got_length, _ = RESPONSE.unpack(header)
        recv_exact(sock, meta_len + msg_len)
        assert (answered, got) == (rid, code)
        if code == CODE_OK:
            assert got_length == length
            got_bytes = region.map[room(rid) : room(rid) + length]
            assert got_bytes == bytes([rid % 8 + 1]) * length
    assert sock.recv(1) == b""  # then the daemon closes
    sock.close()
    assert wait_until(lambda: metric(channel_daemon.metrics_port, "kvd_inflight_requests") == 0)
    assert metric(channel_daemon.metrics_port, "kvd_inflight_bytes") == 0


def test_a_client_that_sends_and_never_reads_is_let_go(
    channel_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    """20,000 pipelined misses and no reads: the daemon stops reading once 16
    answers wait and the socket is full (bounded), and when the client hangs
    up, the connection and its ops are cleaned up; others are served."""
    region = RawRegion(stub, _paths(stub).shm_dir, "mute", 1 << 16)
    frame = _frame(OP_REGION_GET, region, b"absent", 0, 100)
    sock, _ = _connect(_paths(stub).shm_socket)
    sock.settimeout(2)
    with pytest.raises(TimeoutError):
        sock.sendall(frame * 20_000)  # blocks: the daemon stopped reading
    assert metric(channel_daemon.metrics_port, "kvd_shm_connections") == 1
    sock.close()
    assert wait_until(lambda: metric(channel_daemon.metrics_port, "kvd_shm_connections") == 0)
    assert metric(channel_daemon.metrics_port, "kvd_inflight_requests") == 0
    with Client(channel_daemon.socket_target) as client:
        client.put(NS, b"after", b"still serving")
        assert client.get(NS, b"after") == b"still serving"


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"XXXX" + bytes(36), "bad magic"),
        (encode_request(OP_REGION_GET, 1, NS.encode(), b"k", length=5) + bytes(32), "HELLO"),
    ],
)
def test_bad_first_frames_close_the_connection(
    channel_daemon: DaemonProcess, stub: KVStoreStub, frame: bytes, reason: str
) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(_paths(stub).shm_socket)
    sock.sendall(frame)
    assert closed_by_daemon(sock)
    assert _logged(channel_daemon, reason)
    with Client(channel_daemon.socket_target) as client:
        client.put(NS, b"canary", b"alive" * 1000)
        assert client.get(NS, b"canary") == b"alive" * 1000


def test_truncated_and_slow_frames_leave_nothing(
    channel_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    region = RawRegion(stub, _paths(stub).shm_dir, "c3", 1 << 16)
    region.map[:5] = b"hello"
    frame = _frame(OP_REGION_PUT, region, b"cut", 0, 5)
    sock, _ = _connect(_paths(stub).shm_socket)
    sock.sendall(frame[:50])  # header, part of the region reference, then EOF
    sock.shutdown(socket.SHUT_WR)
    assert closed_by_daemon(sock)
    assert _logged(channel_daemon, "ended inside a frame")
    sock, _ = _connect(_paths(stub).shm_socket)
    sock.sendall(frame[:20])  # half a header, then silence
    start = time.monotonic()
    assert closed_by_daemon(sock)
    assert time.monotonic() - start < 4  # frame timeout is 300 ms; the check runs every 75 ms
    assert _logged(channel_daemon, "frame not complete within 0.3 s")
    assert region.get(stub, b"cut", 0, 5).code == CODES["NOT_FOUND"]


def test_region_ops_are_refused_on_the_bulk_tcp_port(channel_daemon: DaemonProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", channel_daemon.bulk_port), timeout=5)
    sock.sendall(encode_request(OP_HELLO, 0))
    assert len(recv_exact(sock, RESPONSE.size)) == RESPONSE.size
    sock.sendall(encode_request(OP_REGION_GET, 1, NS.encode(), b"k", length=5) + bytes(32))
    assert closed_by_daemon(sock)


def test_tokens_and_namespaces_are_checked(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    daemon = daemon_factory("--auth-tokens-file", str(token_file(tmp_path / "tokens.toml")))
    path = str(daemon.workdir / "shm" / SOCKET_NAME)
    sock, code = _connect(path, b"not-a-token")
    assert code == CODES["UNAUTHENTICATED"]
    assert closed_by_daemon(sock)
    with (
        BulkClient(path, 0, token="not-a-token", timeout_s=5) as raw,
        pytest.raises(Unauthenticated),
    ):
        raw.with_connection(lambda conn: None)
    with Client(daemon.socket_target, token=TOKEN_A) as client:
        client.put("team-a/x", b"k", b"v" * 5000)
        assert client.get("team-a/x", b"k") == b"v" * 5000
        with pytest.raises(PermissionDenied):
            client.put("team-b/x", b"k", b"v" * 5000)


def test_a_socket_held_by_another_daemon_leaves_the_second_without_shm(
    daemon_factory: DaemonFactory, channel_daemon: DaemonProcess, stub: KVStoreStub
) -> None:
    """Regions are attached on the shm socket: a daemon that cannot have its
    socket offers no shared-memory path, and its clients' values go over gRPC."""
    taken = _paths(stub).shm_socket
    second = daemon_factory("--shm-socket", taken)
    assert wait_until(lambda: any("shared-memory path off" in line for line in second.log))
    with grpc.insecure_channel(second.socket_target) as ch:
        paths = KVStoreStub(ch).DescribePaths(pb.DescribePathsRequest())
        assert paths.shm_socket == "" and paths.shm_dir == ""
    with Client(second.socket_target) as client:
        assert client.paths == frozenset()
        buffer = client.buffer(1 << 20)
        buffer[:] = b"z" * (1 << 20)
        client.put(NS, b"via-grpc", buffer)
        assert client.get(NS, b"via-grpc") == b"z" * (1 << 20)
    assert _paths(stub).shm_socket == taken  # the first daemon still serves it


def test_a_stale_socket_file_is_replaced(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()  # the file stays, nobody listens: a daemon that was killed
    daemon = daemon_factory("--shm-socket", str(stale))
    sock, code = _connect(str(stale))
    assert code == CODE_OK
    sock.close()
    daemon.stop()
    with pytest.raises(Unavailable), BulkClient(str(stale), 0, timeout_s=1) as gone:
        gone.with_connection(lambda conn: None)
