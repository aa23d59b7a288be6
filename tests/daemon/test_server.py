"""The daemon over gRPC: codes for bad input, streams, health, reflection, metrics.

Raw stubs are used where the test is about the wire (codes, partial
streams); the client library has its own tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.client import Client
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.checksum import checksum
from kvd.wire.grpc import KVStoreStub
from tests.support import DaemonFactory, DaemonProcess, wait_until

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stub(shared_daemon: DaemonProcess) -> Iterator[KVStoreStub]:
    with grpc.insecure_channel(shared_daemon.target) as channel:
        yield KVStoreStub(channel)


def put_stream(
    ns: str, key: bytes, chunks: list[bytes], size: int | None = None, **header: object
) -> Iterator[pb.PutRequest]:
    total = sum(len(c) for c in chunks) if size is None else size
    yield pb.PutRequest(header=pb.PutHeader(namespace=ns, key=key, size=total, **header))
    for chunk in chunks:
        yield pb.PutRequest(data=chunk)


def code_of(call: object) -> Code:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()  # type: ignore[no-any-return]


def test_put_get_stream_round_trip(stub: KVStoreStub) -> None:
    value = bytes(range(256)) * 12288  # 3 MiB: three 1 MiB messages back
    response = stub.Put(put_stream("t", b"rt", [value[:1000], value[1000:]], meta=b"m"))
    assert not response.existed and response.checksum == checksum(value)
    parts = list(stub.Get(pb.GetRequest(namespace="t", key=b"rt")))
    assert parts[0].header.found and parts[0].header.size == len(value)
    assert parts[0].header.meta == b"m" and parts[0].header.tier == pb.TIER_L1
    assert b"".join(p.data for p in parts) == value
    assert len(parts) == 3


def test_get_miss_is_not_an_error(stub: KVStoreStub) -> None:
    parts = list(stub.Get(pb.GetRequest(namespace="nobody", key=b"k")))
    assert len(parts) == 1 and not parts[0].header.found


@pytest.mark.parametrize(
    ("ns", "key", "size", "meta"),
    [
        ("", b"k", 1, b""),  # empty namespace
        ("t", b"", 1, b""),  # empty key
        ("t", b"k" * 65, 1, b""),  # key over 64 bytes
        ("t", b"k", 1, b"m" * 4097),  # meta over 4 KiB
        ("t", b"k", 300 << 20, b""),  # over max_value_bytes (32 MiB)
    ],
)
def test_bad_put_header_is_invalid_argument(
    stub: KVStoreStub, ns: str, key: bytes, size: int, meta: bytes
) -> None:
    assert code_of(lambda: stub.Put(put_stream(ns, key, [], size=size, meta=meta))) == (
        Code.INVALID_ARGUMENT
    )


def test_value_larger_than_pool_is_invalid_argument(daemon_factory: object) -> None:
    daemon = daemon_factory("--dram-bytes", "2MiB", "--max-value-bytes", "2MiB")  # type: ignore[operator]
    with grpc.insecure_channel(daemon.target) as channel:
        stub = KVStoreStub(channel)
        code = code_of(lambda: stub.Put(put_stream("t", b"k", [], size=3 << 20)))
    assert code in (Code.INVALID_ARGUMENT,)


def test_chunks_not_adding_up_are_refused_and_leave_nothing(stub: KVStoreStub) -> None:
    assert code_of(lambda: stub.Put(put_stream("t", b"short", [b"abc"], size=10))) == (
        Code.INVALID_ARGUMENT
    )
    assert code_of(lambda: stub.Put(put_stream("t", b"long", [b"abc" * 10], size=10))) == (
        Code.INVALID_ARGUMENT
    )
    assert list(stub.Exists(pb.ExistsRequest(namespace="t", keys=[b"short", b"long"])).exists) == [
        False,
        False,
    ]


def test_stream_without_header_or_with_two(stub: KVStoreStub) -> None:
    assert code_of(lambda: stub.Put(iter([pb.PutRequest(data=b"x")]))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: stub.Put(iter([]))) == Code.INVALID_ARGUMENT
    twice = [pb.PutRequest(header=pb.PutHeader(namespace="t", key=b"2h", size=2))] * 2
    assert code_of(lambda: stub.Put(iter(twice))) == Code.INVALID_ARGUMENT


def test_wrong_checksum_is_data_loss(stub: KVStoreStub) -> None:
    bad = put_stream("t", b"crc", [b"hello"], checksum=checksum(b"hellO"))
    assert code_of(lambda: stub.Put(bad)) == Code.DATA_LOSS
    assert list(stub.Exists(pb.ExistsRequest(namespace="t", keys=[b"crc"])).exists) == [False]


def test_write_once_conflict_is_already_exists(stub: KVStoreStub) -> None:
    stub.Put(put_stream("t", b"once", [b"first"]))
    assert stub.Put(put_stream("t", b"once", [b"first"], checksum=checksum(b"first"))).existed
    assert stub.Put(put_stream("t", b"once", [b"first"])).existed
    assert code_of(lambda: stub.Put(put_stream("t", b"once", [b"other"]))) == Code.ALREADY_EXISTS


def test_client_disconnect_mid_put_leaves_nothing(shared_daemon: DaemonProcess) -> None:
    gate = threading.Event()

    def stream() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace="t", key=b"cut", size=4 << 20))
        yield pb.PutRequest(data=b"x" * (1 << 20))
        gate.wait(5)

    channel = grpc.insecure_channel(shared_daemon.target)
    future = KVStoreStub(channel).Put.future(stream())
    with Client(shared_daemon.target) as client:
        assert wait_until(lambda: client.stats()["inflight_bytes"] > 0)
        future.cancel()
        channel.close()
        gate.set()
        assert wait_until(lambda: client.stats()["inflight_bytes"] == 0)
        assert client.exists("t", [b"cut"]) == [False]
        assert client.get("t", b"cut") is None


def test_lookup_limits_and_lease_bound(stub: KVStoreStub) -> None:
    assert code_of(lambda: stub.Lookup(pb.LookupRequest(namespace="t", keys=[]))) == (
        Code.INVALID_ARGUMENT
    )
    too_many = pb.LookupRequest(namespace="t", keys=[b"k"] * 16_385)  # max_lookup_keys + 1
    assert code_of(lambda: stub.Lookup(too_many)) == Code.INVALID_ARGUMENT
    long_lease = pb.LookupRequest(namespace="t", keys=[b"k"], lease_ms=60_001)
    assert code_of(lambda: stub.Lookup(long_lease)) == Code.INVALID_ARGUMENT


def test_batch_limits(stub: KVStoreStub) -> None:
    items = [pb.PutItem(key=b"b%d" % i, value=b"v") for i in range(1025)]
    assert code_of(lambda: stub.BatchPut(pb.BatchPutRequest(namespace="t", items=items))) == (
        Code.INVALID_ARGUMENT
    )
    mixed = [pb.PutItem(key=b"ok", value=b"v"), pb.PutItem(key=b"", value=b"v")]
    statuses = stub.BatchPut(pb.BatchPutRequest(namespace="t", items=mixed)).statuses
    assert statuses[0].code == 0
    assert statuses[1].code == Code.INVALID_ARGUMENT.value[0] and statuses[1].message


def test_delete_keys_and_all(stub: KVStoreStub) -> None:
    stub.BatchPut(
        pb.BatchPutRequest(
            namespace="del",
            items=[pb.PutItem(key=b"a", value=b"1"), pb.PutItem(key=b"b", value=b"2")],
        )
    )
    assert stub.Delete(pb.DeleteRequest(namespace="del", keys=[b"a", b"zz"])).deleted == 1
    assert stub.Delete(pb.DeleteRequest(namespace="del", all_keys=True)).deleted == 1
    both = pb.DeleteRequest(namespace="del", keys=[b"a"], all_keys=True)
    assert code_of(lambda: stub.Delete(both)) == Code.INVALID_ARGUMENT


def test_health_and_reflection(shared_daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(shared_daemon.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvd.v1.KVStore"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(iter(stub.ServerReflectionInfo(iter([request]))))
        names = {s.name for s in response.list_services_response.service}
        assert {"kvd.v1.KVStore", "grpc.health.v1.Health"} <= names


def test_unix_socket(shared_daemon: DaemonProcess) -> None:
    with Client(shared_daemon.socket_target) as client:
        client.put("unix", b"k", b"over the socket")
        assert client.get("unix", b"k") == b"over the socket"


def test_metrics_endpoint(shared_daemon: DaemonProcess) -> None:
    with Client(shared_daemon.target) as client:
        client.put("m", b"k", b"v")
        client.get("m", b"k")
        client.get("m", b"missing")
    url = f"http://127.0.0.1:{shared_daemon.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in (
        "kvd_requests_total",
        "kvd_request_duration_seconds_bucket",
        "kvd_hits_total",
        "kvd_misses_total",
        "kvd_bytes_total",
        "kvd_pool_used_bytes",
        "kvd_pool_free_bytes",
        "kvd_evictions_total",
        "kvd_leases_active",
        "kvd_inflight_bytes",
    ):
        assert name in text, name
    assert 'kvd_misses_total{op="get"}' in text


def test_sigterm_stops_cleanly(daemon: DaemonProcess) -> None:
    with Client(daemon.target) as client:
        client.put("s", b"k", b"v")
    assert daemon.stop() == 0
    assert any("kvd stopped" in line for line in daemon.log)


def test_a_second_daemon_on_a_served_socket_is_refused_and_a_stale_one_replaced(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Two daemons on one socket path (the default one, say) would take it
    from each other in silence: the second is refused, naming the path. A
    socket file nobody serves (a daemon that died) is replaced."""
    first = daemon_factory()
    sock = first.socket
    result = subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--listen", "127.0.0.1:0", "--socket", sock,
         "--metrics-listen", "", "--bulk-listen", "", "--dram-bytes", "64MiB",
         "--shm-dir", str(tmp_path / "shm2"), "--config", str(write_no_l2(tmp_path))],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
    )  # fmt: skip
    assert result.returncode != 0
    assert f"{sock} is served by another process" in result.stdout + result.stderr
    with Client(first.socket_target, timeout_s=5) as client:  # the first keeps its socket
        client.put("s", b"k", b"v")
    first.kill()
    assert os.path.exists(sock)  # left behind by kill -9
    second = daemon_factory(workdir=first.workdir)
    with Client(second.socket_target, timeout_s=5) as client:
        assert client.get("s", b"k") in (b"v", None)


def write_no_l2(tmp_path: Path) -> Path:
    path = tmp_path / "no-l2.toml"
    path.write_text("ssd_path = []\n")
    return path
