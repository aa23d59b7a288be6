"""Lookups and lease releases over the shm socket against a real daemon: the
client sends them there on the daemon's node, the answers equal gRPC's, the
lease pins what it found, and bad input (keys that are not whole, too many
keys, a namespace outside the token, a frame over the limit) is answered
with a code or closes the connection, losing nothing."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import grpc
import pytest

from kvd.client import Client, InvalidArgument, PermissionDenied
from kvd.client.shm_socket import lookup_answer
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.bulk import OP_HELLO, RESPONSE, encode_request
from kvd.wire.grpc import KVStoreStub
from kvd.wire.lookup import LookupResult
from kvd.wire.shm import LOOKUP_REF, OP_LOOKUP
from tests.paths.support import TOKEN_A, token_file
from tests.sockets import closed_by_daemon, metric, recv_exact
from tests.support import DaemonFactory, DaemonProcess

NS = "lookup-test"
CODES = {code.name: int(code.value[0]) for code in grpc.StatusCode}


def _keys(count: int, width: int = 32) -> list[bytes]:
    return [hashlib.sha256(b"key %d" % i).digest()[:width] for i in range(count)]


def _over_socket(client: Client, ns: str, keys: list[bytes], lease_ms: int = 0) -> LookupResult:
    """A lookup that must go over the shm socket (the client's own path)."""
    shm, _ = client._fast_paths()
    assert shm is not None and shm.over_socket
    answer = shm.index_op(lambda ops: ops.lookup(ns, keys, lease_ms))
    assert answer is not None, "the lookup went over the shm socket"
    return lookup_answer(answer)


def _over_grpc(daemon: DaemonProcess, ns: str, keys: list[bytes]) -> pb.LookupResponse:
    with grpc.insecure_channel(daemon.socket_target) as channel:
        return KVStoreStub(channel).Lookup(pb.LookupRequest(namespace=ns, keys=keys))


def test_a_lookup_goes_over_the_socket_and_answers_as_grpc(daemon: DaemonProcess) -> None:
    keys = _keys(300)
    with Client(daemon.socket_target) as client:
        client.put_many(NS, [(key, b"v" * 100) for key in keys[:200]], chained=True)
        found = _over_socket(client, NS, keys)
        assert (found.prefix_len, found.l1_hits, found.l2_hits) == (200, 200, 0)
        by_grpc = _over_grpc(daemon, NS, keys)
        assert (by_grpc.prefix_len, by_grpc.l1_hits) == (found.prefix_len, found.l1_hits)
        assert client.lookup(NS, keys) == 200  # the public call takes the same path
        assert client.lookup(NS, [keys[250], *keys[:10]]) == 0  # the prefix stops at a miss
        assert _over_socket(client, "nothing-here", keys).prefix_len == 0
    # Counted like a gRPC lookup: one per call, hits by tier.
    assert metric(daemon.metrics_port, 'kvd_requests_total{code="OK",op="lookup"}') >= 5
    assert metric(daemon.metrics_port, 'kvd_hits_total{op="lookup",tier="l1"}') >= 600


def test_a_lease_taken_over_the_socket_pins_until_released(daemon: DaemonProcess) -> None:
    keys = _keys(8)
    with Client(daemon.socket_target) as client:
        client.put_many(NS, [(key, b"x" * 64) for key in keys], chained=True)
        found = client.lookup_ex(NS, keys, lease_ms=30_000)
        assert found.prefix_len == 8 and found.lease_id > 0 and found.lease_ms == 30_000
        assert client.stats()["leases_active"] == 1
        assert not client.release("another-namespace", found.lease_id)
        assert client.release(NS, found.lease_id)
        assert not client.release(NS, found.lease_id)  # once
        assert client.stats()["leases_active"] == 0


def test_keys_of_different_widths_go_over_grpc(daemon: DaemonProcess) -> None:
    keys = [b"short", b"a-longer-key", b"k"]
    with Client(daemon.socket_target) as client:
        client.put_many(NS, [(key, b"v") for key in keys], chained=True)
        shm, _ = client._fast_paths()
        assert shm is not None
        assert shm.index_op(lambda ops: ops.lookup(NS, keys, 0)) is None
        assert client.lookup(NS, keys) == 3  # answered, over gRPC


def test_bad_lookups_get_their_codes(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_target) as client:
        with pytest.raises(InvalidArgument, match="max_lookup_keys"):
            client.lookup(NS, _keys(16_385))
        with pytest.raises(InvalidArgument, match="lease_ms"):
            client.lookup(NS, _keys(2), lease_ms=10**9)
        with pytest.raises(InvalidArgument):
            client.lookup(NS, [b"x" * 65] * 2)  # too long a key: gRPC says so
        assert client.lookup(NS, _keys(3)) == 0  # the connection still serves


def _hello(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    sock.sendall(encode_request(OP_HELLO, 0))
    recv_exact(sock, RESPONSE.size)
    return sock


def _lookup_frame(ns: bytes, data: bytes, width: int, lease_ms: int = 0) -> bytes:
    header = encode_request(OP_LOOKUP, 1, ns, length=len(data))
    return header[: RESPONSE.size] + LOOKUP_REF.pack(lease_ms, width) + header[RESPONSE.size :]


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """(code, meta) of one answer."""
    _, _, _, _, _, code, meta_len, msg_len, _, _ = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    return code, recv_exact(sock, meta_len + msg_len)[:meta_len]


def test_malformed_lookup_frames(daemon: DaemonProcess) -> None:
    path = _describe(daemon).shm_socket
    sock = _hello(path)
    try:
        # Keys that are not whole: INVALID_ARGUMENT, and the connection serves on.
        sock.sendall(_lookup_frame(NS.encode(), b"x" * 33, 32) + b"x" * 33)
        assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]
        sock.sendall(_lookup_frame(NS.encode(), b"y" * 64, 0) + b"y" * 64)
        assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]  # keys of no width
        sock.sendall(_lookup_frame(NS.encode(), b"y" * 64, 32) + b"y" * 64)
        assert _answer(sock)[0] == CODES["OK"]
    finally:
        sock.close()
    # A frame announcing more key bytes than any lookup may carry is cut off
    # before they are read.
    sock = _hello(path)
    try:
        sock.sendall(_lookup_frame(NS.encode(), b"z" * (16_384 * 64 + 32), 32))
        assert closed_by_daemon(sock)
    finally:
        sock.close()
    with Client(daemon.socket_target) as client:
        assert client.lookup(NS, _keys(2)) == 0  # the daemon serves on


def test_lookups_are_authorized(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    daemon = daemon_factory("--auth-tokens-file", str(token_file(tmp_path / "tokens.toml")))
    keys = _keys(4)
    with Client(daemon.socket_target, token=TOKEN_A) as client:
        client.put_many("team-a/m", [(key, b"v") for key in keys], chained=True)
        assert _over_socket(client, "team-a/m", keys).prefix_len == 4
        with pytest.raises(PermissionDenied):
            _over_socket(client, "team-b/m", keys)
        with pytest.raises(PermissionDenied):
            client.lookup("team-b/m", keys)
        assert client.lookup("team-a/m", keys) == 4


def _describe(daemon: DaemonProcess) -> pb.DescribePathsResponse:
    with grpc.insecure_channel(daemon.socket_target) as channel:
        return KVStoreStub(channel).DescribePaths(pb.DescribePathsRequest())
