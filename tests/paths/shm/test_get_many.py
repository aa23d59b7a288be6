"""Batched region gets in one REGION_GET_MANY frame against a real daemon:
the client sends a batch as one frame (one request counted, not one per
value), each item gets its own result as with per-item frames (hits by
tier, misses, too little room, an offset outside the region), a daemon that
does not offer the op gets per-item frames, and bad frames are answered
with a code or close the connection, losing nothing."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc
import pytest

from kvd.client import Client
from kvd.client.shm_socket import RegionOps
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.bulk import OP_HELLO, RESPONSE, encode_request
from kvd.wire.grpc import KVStoreStub
from kvd.wire.shm import (
    MANY_ITEM,
    MANY_REF,
    MANY_RESULT,
    OP_REGION_GET_MANY,
    REGION_REF,
    SHM_OPS,
)
from tests.paths.shm.support import NS, RawRegion
from tests.paths.support import TOKEN_A, token_file
from tests.sockets import closed_by_daemon, metric, recv_exact, sample, samples
from tests.support import DaemonFactory, DaemonProcess

CODES = {code.name: int(code.value[0]) for code in grpc.StatusCode}


def _requests(daemon: DaemonProcess, op: str) -> float:
    return sample(daemon.metrics_port, f'kvd_requests_total{{code="OK",op="{op}"}}')


def _all_requests(daemon: DaemonProcess) -> list[str]:
    """Every request count the daemon exports: what to look at when a count is off."""
    return samples(daemon.metrics_port, "kvd_requests_total{")


def test_a_batch_get_is_one_frame(daemon: DaemonProcess) -> None:
    values = {b"key-%02d" % i: os.urandom(1000 + 5000 * i) for i in range(8)}
    with Client(daemon.socket_target) as client:
        assert "shm-socket" in client.paths
        client.put_many(NS, list(values.items()))
        keys = [*values, b"absent"]
        room = client.buffer(50_000 * len(keys))  # one region: one batch
        buffers = [room[i * 50_000 : (i + 1) * 50_000] for i in range(len(keys))]
        before = _requests(daemon, "shm_get_many"), _requests(daemon, "shm_get")
        sizes = client.get_many_into(NS, keys, buffers)
        middle = _requests(daemon, "shm_get_many"), _requests(daemon, "shm_get")
        assert sizes == [len(v) for v in values.values()] + [None]
        for buffer, value in zip(buffers, values.values(), strict=False):
            assert bytes(buffer[: len(value)]) == value
        assert client.get_many(NS, keys) == [*values.values(), None]
        after = _requests(daemon, "shm_get_many"), _requests(daemon, "shm_get")
    counts = f"{before} -> {middle} -> {after}; {_all_requests(daemon)}"
    assert middle[0] - before[0] == 1, counts  # one frame a batch
    assert after[0] - middle[0] == 1, counts
    assert after[1] == before[1], counts  # and no frame per value
    assert metric(daemon.metrics_port, 'kvd_hits_total{op="shm_get",tier="l1"}') >= 16


def test_each_item_gets_its_own_result(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.socket_target) as channel:
        stub = KVStoreStub(channel)
        paths = stub.DescribePaths(pb.DescribePathsRequest())
        assert list(paths.shm_ops) == list(SHM_OPS)
        region = RawRegion(stub, paths.shm_dir, "many", 1 << 20)
        region.map[:5] = b"hello"
        assert region.put(stub, b"k1", 0, 5) == 0
        ops = RegionOps.of(paths, None, 5.0)
        assert ops is not None
        items = [
            pb.RegionItem(key=b"k1", offset=4096, length=100),  # a hit
            pb.RegionItem(key=b"k2", offset=8192, length=100),  # a miss
            pb.RegionItem(key=b"k1", offset=12288, length=2),  # too little room
            pb.RegionItem(key=b"k1", offset=(1 << 20) - 2, length=5),  # outside the region
        ]
        request = pb.GetIntoRegionRequest(
            region_id=region.region_id, token=region.token, namespace=NS, items=items
        )
        try:
            many = [(r.code, r.size) for r in ops.get_into_region(request).results]
            one_by_one = RegionOps(paths.shm_socket, None, 5.0)  # offers nothing: per item
            single = [(r.code, r.size) for r in one_by_one.get_into_region(request).results]
            one_by_one.close()
        finally:
            ops.close()
    assert (
        many
        == single
        == [
            (0, 5),
            (CODES["NOT_FOUND"], 0),
            (CODES["RESOURCE_EXHAUSTED"], 5),
            (CODES["INVALID_ARGUMENT"], 0),
        ]
    )
    assert region.map[4096:4101] == b"hello"


def _hello(path: str, token: bytes = b"") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    sock.sendall(encode_request(OP_HELLO, 0, length=len(token)) + token)
    recv_exact(sock, RESPONSE.size)
    return sock


def _frame(region: RawRegion, ns: str, count: int, width: int, payload: bytes) -> bytes:
    head = encode_request(OP_REGION_GET_MANY, 1, ns.encode(), length=len(payload))
    refs = REGION_REF.pack(region.region_id, 0, region.token) + MANY_REF.pack(count, width)
    return head[: RESPONSE.size] + refs + head[RESPONSE.size :] + payload


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """(code, payload) of one answer."""
    _, _, _, _, _, code, meta_len, msg_len, length, _ = RESPONSE.unpack(
        recv_exact(sock, RESPONSE.size)
    )
    recv_exact(sock, meta_len + msg_len)
    return code, recv_exact(sock, length)


def test_malformed_batches(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.socket_target) as channel:
        stub = KVStoreStub(channel)
        paths = stub.DescribePaths(pb.DescribePathsRequest())
        region = RawRegion(stub, paths.shm_dir, "bad", 1 << 16)
    sock = _hello(paths.shm_socket)
    try:
        good = MANY_ITEM.pack(0, 100) + b"k" * 8
        sock.sendall(_frame(region, NS, 2, 8, good))  # two items announced, one sent
        assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]
        sock.sendall(_frame(region, NS, 1, 0, good))  # keys of no width
        assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]
        sock.sendall(_frame(region, NS, 1025, 1, b""))  # over max_batch_items
        assert _answer(sock)[0] == CODES["INVALID_ARGUMENT"]
        sock.sendall(_frame(region, NS, 1, 8, good))  # whole: the connection served on
        code, payload = _answer(sock)
        assert code == 0 and MANY_RESULT.unpack_from(payload)[0] == CODES["NOT_FOUND"]
    finally:
        sock.close()
    sock = _hello(paths.shm_socket)
    try:  # more item bytes than any batch may carry: cut off before they are read
        head = encode_request(OP_REGION_GET_MANY, 2, NS.encode(), length=1025 * 80)
        refs = REGION_REF.pack(region.region_id, 0, region.token) + MANY_REF.pack(1, 8)
        sock.sendall(head[: RESPONSE.size] + refs + head[RESPONSE.size :])
        assert closed_by_daemon(sock)
    finally:
        sock.close()


def test_batches_are_authorized(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    daemon = daemon_factory("--auth-tokens-file", str(token_file(tmp_path / "tokens.toml")))
    with Client(daemon.socket_target, token=TOKEN_A) as client:
        client.put_many("team-a/m", [(b"a", b"1"), (b"b", b"2")])
        buffers = [client.buffer(16), client.buffer(16)]
        assert client.get_many_into("team-a/m", [b"a", b"b"], buffers) == [1, 1]
        with pytest.raises(Exception, match="team-b"):
            client.get_many_into("team-b/m", [b"a", b"b"], buffers)
