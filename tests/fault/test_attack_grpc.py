"""The gRPC port under attack by a network peer, against a real daemon.

Put streams that declare large values and stall, Get streams that are never
read, and the daemon stays up, an honest client's calls succeed within their
deadline, and the values cached before the attack stay in L1.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvd.client import Client
from kvd.tools.bench.daemon import written_back
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import KVStoreStub
from tests.support import WRITE_BACK_WAIT_S, DaemonFactory, DaemonProcess, wait_until

pytestmark = pytest.mark.fault

NS = "attack-grpc"
MiB = 1 << 20
CACHED = 48  # 1 MiB values cached before each attack, in a 128 MiB pool
DEADLINE_S = 5.0


def _daemon(factory: DaemonFactory, *args: str) -> DaemonProcess:
    return factory("--dram-bytes", "128MiB", "--max-value-bytes", "32MiB", *args)


def _value(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def _cache(client: Client) -> list[bytes]:
    keys = [b"cached-%03d" % i for i in range(CACHED)]
    for key in keys:
        client.put(NS, key, _value(key, MiB))
    assert written_back(client, WRITE_BACK_WAIT_S), "write-back did not settle"
    return keys


def _stalled_put(key: bytes, size: int, sent: int, release: threading.Event) -> Iterator[Any]:
    yield pb.PutRequest(header=pb.PutHeader(namespace=NS, key=key, size=size))
    yield pb.PutRequest(data=b"s" * sent)
    release.wait(30)


def _honest_round_trip(client: Client, key: bytes) -> float:
    value = _value(key, 2 * MiB)  # over the BatchPut size: a Put stream and a Get stream
    start = time.monotonic()
    client.put(NS, key, value)
    assert client.get(NS, key) == value
    return time.monotonic() - start


def test_stalled_put_streams_hold_only_what_they_sent(daemon_factory: DaemonFactory) -> None:
    """40 Put streams declare 32 MiB, send 4 KiB and stall: before, each
    reserved its 32 MiB at the header, evicting every cached value."""
    daemon = _daemon(daemon_factory)
    release = threading.Event()
    with (
        Client(daemon.target, timeout_s=DEADLINE_S, bulk=False) as client,
        grpc.insecure_channel(daemon.target) as channel,
    ):
        keys = _cache(client)
        evictions = client.stats()["evictions"]
        stub = KVStoreStub(channel)
        calls = [
            stub.Put.future(_stalled_put(b"stall-%d" % i, 32 * MiB, 4096, release), timeout=20)
            for i in range(40)
        ]
        try:
            assert wait_until(lambda: client.stats()["upload_bytes"] >= 40 * 64 * 1024, 10)
            took = _honest_round_trip(client, b"honest")
            print(f"honest gRPC round trip during the stall: {took * 1000:.1f} ms")
            assert took < DEADLINE_S
            stats = client.stats()
            assert stats["evictions"] == evictions, "cached values evicted"
            assert client.lookup_ex(NS, keys).l1_hits == CACHED
            assert stats["upload_bytes"] == 40 * 64 * 1024  # one page per stalled stream
        finally:
            release.set()
            for call in calls:
                call.cancel()
        assert wait_until(lambda: client.stats()["upload_bytes"] == 0, 10)
    assert daemon.alive()


def test_a_stalled_put_stream_times_out(daemon_factory: DaemonFactory) -> None:
    daemon = _daemon(daemon_factory, "--grpc-put-timeout-ms", "500")
    release = threading.Event()
    with grpc.insecure_channel(daemon.target) as channel:
        stub = KVStoreStub(channel)
        call = stub.Put.future(_stalled_put(b"slow", 8 * MiB, 4096, release), timeout=20)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            call.result()
        release.set()
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 5
    with Client(daemon.target, timeout_s=DEADLINE_S, bulk=False) as client:
        assert client.stats()["upload_bytes"] == 0
        assert client.get(NS, b"slow") is None
    assert daemon.alive()


def test_get_streams_never_read(daemon_factory: DaemonFactory) -> None:
    """50 Get streams of a 1 MiB value whose answers are never read: the
    values stay pinned, nothing is evicted, others are served."""
    daemon = _daemon(daemon_factory)
    with (
        Client(daemon.target, timeout_s=DEADLINE_S, bulk=False) as client,
        grpc.insecure_channel(daemon.target) as channel,
    ):
        keys = _cache(client)
        evictions = client.stats()["evictions"]
        stub = KVStoreStub(channel)
        streams = [
            stub.Get(pb.GetRequest(namespace=NS, key=keys[i % CACHED]), timeout=20)
            for i in range(50)
        ]
        try:
            time.sleep(0.5)
            assert _honest_round_trip(client, b"honest") < DEADLINE_S
            assert client.stats()["evictions"] == evictions
        finally:
            for stream in streams:
                stream.cancel()
    assert daemon.alive()
