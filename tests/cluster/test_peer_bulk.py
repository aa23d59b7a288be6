"""Values read from their owner over its bulk TCP port (kvd.cluster.peer_bulk,
kvd.cluster.peer_reads): small, multi-page and larger than 4 MiB, bytes
checked, through real daemons; and an owner that corrupts its bytes, sends
fewer than it declared, stalls half-way or speaks another protocol version
costs a miss, never wrong bytes, with every reserved pool page given back.
The bad owner is a small gRPC server (DescribePaths) and bulk TCP port in
this process; the daemon reading from it is real."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
import zmq

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.v1 import kvd_pb2 as pb
from kvd.wire import bulk
from kvd.wire.checksum import checksum
from kvd.wire.grpc import POOL_VERSION
from tests.cluster.cluster import (
    FakeMember,
    bound_subscriber,
    free_ports,
    gets_of,
    keys_owned,
    labelled,
    start_static_pool,
)
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

PAGE = 64 * 1024
SIZES = [1, PAGE, PAGE + 1, 4 * 1024 * 1024 + 3, 9 * 1024 * 1024]


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_remote_gets_land_in_l1_with_their_bytes(tmp_path: Path, transport: str) -> None:
    daemons = start_static_pool(tmp_path, 2, "--pool-peer-transport", transport)
    owner, reader = daemons
    try:
        placement = Placement([d.target for d in daemons])
        keys = keys_owned(placement, owner.target, len(SIZES))
        values = {key: os.urandom(size) for key, size in zip(keys, SIZES, strict=True)}
        with Client(owner.target, timeout_s=10) as client:
            for key, value in values.items():
                client.put("ns", key, value)
        with Client(reader.target, timeout_s=10) as client:
            for key, value in values.items():
                assert client.get("ns", key) == value
            # Now a local copy: a second get asks no peer.
            assert client.get("ns", keys[-1]) == values[keys[-1]]
        port = reader.metrics_port
        reads = labelled(port, "kvd_cluster_peer_reads_total", peer=owner.target)
        assert reads == len(SIZES)
        assert labelled(port, "kvd_cluster_peer_reads_total", transport=transport) == len(SIZES)
        read_bytes = labelled(port, "kvd_cluster_peer_read_bytes_total", transport=transport)
        assert read_bytes == sum(SIZES)
        assert metric(port, "kvd_cluster_remote_hits_total") == len(SIZES)
        assert metric(port, "kvd_cluster_peer_errors_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_puts_reach_their_owner_whole_with_their_chain(tmp_path: Path, transport: str) -> None:
    """A put through a member that does not own the key is handed to its
    owner: over ``bulk`` as a PUT on the owner's bulk port (its bytes sent
    from the member's L1 pages), over ``grpc`` as a BatchPut. The owner
    keeps every byte and hands nothing on."""
    daemons = start_static_pool(tmp_path, 2, "--pool-peer-transport", transport)
    owner, member = daemons
    try:
        placement = Placement([d.target for d in daemons])
        keys = keys_owned(placement, owner.target, len(SIZES), b"-put")
        values = {key: os.urandom(size) for key, size in zip(keys, SIZES, strict=True)}
        with Client(member.target, timeout_s=10) as client:
            client.put_many("ns", list(values.items()), chained=True)
        port = member.metrics_port
        assert wait_until(lambda: metric(port, "kvd_cluster_forwards_total") == len(SIZES))
        assert metric(port, "kvd_cluster_forward_errors_total") == 0
        received = labelled(owner.metrics_port, "kvd_bytes_total", op="bulk_put", direction="in")
        assert received == (sum(SIZES) if transport == "bulk" else 0)
        assert metric(owner.metrics_port, "kvd_cluster_forwards_total") == 0
        with Client(owner.target, timeout_s=10) as client:
            assert [client.get("ns", key) for key in keys] == list(values.values())
            assert client.lookup("ns", keys) == len(keys)
    finally:
        for daemon in daemons:
            daemon.discard()


def test_an_owner_stores_the_puts_handed_to_it_in_the_order_they_were_made(
    tmp_path: Path,
) -> None:
    """A chain put through a member, all of it owned by the other: the owner
    links the blocks into its L1 in the chain's order (its KV events say
    so), as its eviction policy expects a chain to be filled."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub, endpoint = bound_subscriber(ctx)
    events = ["--kv-events-endpoint", endpoint]
    daemons = start_static_pool(tmp_path, 2, own=[events])
    owner, member = daemons
    try:
        stored: list[bytes] = []

        def receive(seconds: float) -> None:
            while sub.poll(int(seconds * 1000)):
                batch = msgspec.msgpack.decode(sub.recv_multipart()[-1])
                for event in batch[1]:
                    if event["type"] == "BlockStored" and event["medium"] == "CPU":
                        stored.extend(event["block_hashes"])

        with Client(owner.target, timeout_s=10) as client:
            for probe in range(50):  # until the subscription reached the daemon
                client.put("probe", b"p-%d" % probe, b"p")
                receive(0.2)
                if stored:
                    break
        placement = Placement([d.target for d in daemons])
        chain = keys_owned(placement, owner.target, 64, b"-chain")
        with Client(member.target, timeout_s=10) as client:
            client.put_many("ns", [(key, key * 4000) for key in chain], chained=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not set(chain) <= set(stored):
            receive(0.2)
        assert [key for key in stored if key in set(chain)] == chain
    finally:
        for daemon in daemons:
            daemon.discard()
        sub.close()
        ctx.term()


def test_a_put_its_owner_refuses_is_counted_and_the_next_ones_reach_it(tmp_path: Path) -> None:
    """An owner whose max_value_bytes is below the member's refuses a large
    put handed to it (the frame is over its limit: it closes the
    connection): counted in kvd_cluster_forward_errors, the value stays
    with the member, and puts after it reach the owner."""
    daemons = start_static_pool(
        tmp_path, 2, "--max-value-bytes", "2MiB", own=[["--max-value-bytes", "64KiB"]]
    )
    owner, member = daemons
    try:
        placement = Placement([d.target for d in daemons])
        small, large, later = keys_owned(placement, owner.target, 3, b"-refused")
        port = member.metrics_port
        with Client(member.target, timeout_s=10) as client:
            client.put("ns", small, b"s" * 1000)
            assert wait_until(lambda: metric(port, "kvd_cluster_forwards_total") == 1)
            client.put("ns", large, b"l" * (1 << 20))
            assert wait_until(lambda: metric(port, "kvd_cluster_forward_errors_total") == 1)
            assert client.get("ns", large) == b"l" * (1 << 20)  # still here
            time.sleep(1.2)  # the owner is skipped for a second after a failed call
            client.put("ns", later, b"t" * 1000)
            assert wait_until(lambda: metric(port, "kvd_cluster_forwards_total") == 2)
        with Client(owner.target, timeout_s=10) as client:
            assert client.get("ns", small) == b"s" * 1000
            assert client.get("ns", later) == b"t" * 1000
            assert client.exists("ns", [large]) == [False]
    finally:
        for daemon in daemons:
            daemon.discard()


# ---- a bad owner -----------------------------------------------------------------------
BAD_SIZE = 3 * PAGE + 100  # four pages, the last one partly


class BadOwner(FakeMember):
    """A bulk port answering every GET wrongly according to its key's last
    word (corrupt, short, stall; else a miss); its gRPC Get serves every key
    (for a ``named_bulk_port`` where nothing listens)."""

    def __init__(
        self, grpc_port: int, bulk_version: int = bulk.VERSION, named_bulk_port: int = 0,
        pool_version: int = POOL_VERSION,
    ) -> None:  # fmt: skip
        def get(request: pb.GetRequest, context: Any) -> Any:
            value = request.key * 1000
            header = pb.GetHeader(found=True, size=len(value), checksum=checksum(value))
            yield pb.GetResponse(header=header)
            yield pb.GetResponse(data=value)

        get_handler = grpc.unary_stream_rpc_method_handler(
            get,
            request_deserializer=pb.GetRequest.FromString,
            response_serializer=pb.GetResponse.SerializeToString,
        )
        super().__init__(grpc_port, {"Get": get_handler}, bulk_version=bulk_version,
                         named_bulk_port=named_bulk_port, pool_version=pool_version)  # fmt: skip

    def serve(self, sock: socket.socket) -> None:
        for request, key in gets_of(sock):
            if not self._answer(sock, request.request_id, key):
                return

    def _answer(self, sock: socket.socket, rid: int, key: bytes) -> bool:
        value = b"v" * BAD_SIZE
        if key.endswith(b"corrupt"):
            head = bulk.encode_response(bulk.OP_GET, rid, length=BAD_SIZE, checksum=12345)
            sock.sendall(head + value)
            return True
        if key.endswith(b"short") or key.endswith(b"stall"):
            head = bulk.encode_response(bulk.OP_GET, rid, length=BAD_SIZE, checksum=checksum(value))
            sock.sendall(head + value[: BAD_SIZE // 2])
            if key.endswith(b"stall"):
                self.stop.wait(5)  # SIGSTOP-like: the connection stays open, silent
            return False  # closed mid-value
        sock.sendall(bulk.encode_response(bulk.OP_GET, rid, bulk.CODE_NOT_FOUND))
        return True


def test_bad_owner_costs_misses_and_no_pages(tmp_path: Path) -> None:
    port, bad_port = free_ports(2)
    bad = BadOwner(bad_port)
    peer = f"127.0.0.1:{bad_port}"
    members = f"static:127.0.0.1:{port},{peer}"
    daemon = DaemonProcess(tmp_path, ["--listen", f"127.0.0.1:{port}", "--pool-members", members,
                                      "--pool-peer-timeout-ms", "300",
                                      "--pool-peer-transport", "bulk"], ssd="")  # fmt: skip
    client = Client(daemon.target, timeout_s=5)
    try:
        placement = Placement([daemon.target, peer])
        mport = daemon.metrics_port
        free_bytes = metric(mport, "kvd_pool_free_bytes")
        corrupt = keys_owned(placement, peer, 3, b"-corrupt")
        for key in corrupt:
            assert client.get("ns", key) is None
        assert metric(mport, "kvd_cluster_checksum_mismatches_total") == len(corrupt)
        assert labelled(mport, "kvd_cluster_peer_call_errors_total", kind="checksum") == len(
            corrupt
        )
        assert metric(mport, "kvd_cluster_peer_errors_total") == 0  # it answered: not down
        assert metric(mport, "kvd_pool_free_bytes") == free_bytes

        def failing(tag: bytes, kind: str) -> None:
            key = keys_owned(placement, peer, 1, tag)[0]
            errors = labelled(mport, "kvd_cluster_peer_call_errors_total", kind=kind)
            start = time.monotonic()
            # The peer may still be skipped after the last failure: a miss at once.
            assert wait_until(
                lambda: (
                    client.get("ns", key) is None
                    and labelled(mport, "kvd_cluster_peer_call_errors_total", kind=kind) > errors
                )
            )
            assert time.monotonic() - start < 5
            assert wait_until(lambda: metric(mport, "kvd_pool_free_bytes") == free_bytes)

        failing(b"-short", "short")
        failing(b"-stall", "timeout")
        # A clean miss from the owner is no error.
        missing = keys_owned(placement, peer, 1, b"-none")[0]
        assert wait_until(lambda: client.get("ns", missing) is None
                          and metric(mport, "kvd_cluster_remote_misses_total") >= 1)  # fmt: skip
        # Keys this daemon owns are served all along.
        mine = keys_owned(placement, daemon.target, 1, b"-mine")[0]
        client.put("ns", mine, b"here")
        assert client.get("ns", mine) == b"here"
    finally:
        client.close()
        daemon.discard()
        bad.close()


POOL_VERSION_SAID = f"pool protocol version {POOL_VERSION + 1}, this daemon speaks {POOL_VERSION}"


@pytest.mark.parametrize(
    ("versions", "transport", "said"),
    [
        ({"bulk_version": bulk.VERSION + 1}, "bulk", f"bulk protocol version {bulk.VERSION + 1}"),
        ({"pool_version": POOL_VERSION + 1}, "bulk", POOL_VERSION_SAID),
        ({"pool_version": POOL_VERSION + 1}, "grpc", POOL_VERSION_SAID),
    ],
)
def test_a_member_of_another_version_is_not_called(
    tmp_path: Path, versions: dict[str, int], transport: str, said: str
) -> None:
    """A member whose DescribePaths says another bulk protocol version, or
    another pool version (whatever the transport), is refused before any
    call: its keys are misses (its gRPC Get would have served them), counted
    and logged; this member's own keys are served."""
    port, bad_port = free_ports(2)
    bad = BadOwner(bad_port, **versions)
    peer = f"127.0.0.1:{bad_port}"
    args = ["--listen", f"127.0.0.1:{port}", "--pool-members", f"static:127.0.0.1:{port},{peer}",
            "--pool-peer-transport", transport]  # fmt: skip
    daemon = DaemonProcess(tmp_path, args, ssd="")
    client = Client(daemon.target, timeout_s=5)
    try:
        placement = Placement([daemon.target, peer])
        key = keys_owned(placement, peer, 1)[0]
        assert client.get("ns", key) is None
        assert client.exists("ns", [key]) == [False]
        mport = daemon.metrics_port
        assert labelled(mport, "kvd_cluster_peer_call_errors_total", kind="version") >= 1
        assert wait_until(lambda: any(said in line for line in daemon.log))
        mine = keys_owned(placement, daemon.target, 1, b"-mine")[0]
        client.put("ns", mine, b"here")
        assert client.get("ns", mine) == b"here"
    finally:
        client.close()
        daemon.discard()
        bad.close()


def test_unreachable_bulk_port_is_read_over_grpc(tmp_path: Path) -> None:
    port, owner_port, closed_port = free_ports(3)
    owner = BadOwner(owner_port, named_bulk_port=closed_port)
    peer = f"127.0.0.1:{owner_port}"
    members = f"static:127.0.0.1:{port},{peer}"
    daemon = DaemonProcess(tmp_path, ["--listen", f"127.0.0.1:{port}", "--pool-members", members,
                                      "--pool-peer-timeout-ms", "2000"], ssd="")  # fmt: skip
    client = Client(daemon.target, timeout_s=5)
    try:
        placement = Placement([daemon.target, peer])
        keys = keys_owned(placement, peer, 2)
        assert [client.get("ns", k) for k in keys] == [k * 1000 for k in keys]
        mport = daemon.metrics_port
        assert labelled(mport, "kvd_cluster_peer_reads_total", transport="grpc") == 2
        assert metric(mport, "kvd_cluster_peer_errors_total") == 0
        assert any("bulk TCP port is unreachable" in line for line in daemon.log)
    finally:
        client.close()
        daemon.discard()
        owner.close()
