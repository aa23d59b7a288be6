"""A peer that answers wrongly (bytes that fail their checksum, fewer bytes
than it declared, an Exists of the wrong length) costs misses through the
daemon that asked it, never wrong bytes or errors. The peer is a small gRPC
server in this process speaking the KVStore service; the daemon is real."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import SERVICE
from tests.cluster.cluster import free_ports
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

VALUE = b"x" * 4096


def _get(request: pb.GetRequest, context: Any) -> Iterator[pb.GetResponse]:
    if request.key.endswith(b"short"):  # declares more than it sends
        yield pb.GetResponse(header=pb.GetHeader(found=True, size=2 * len(VALUE), checksum=1))
        yield pb.GetResponse(data=VALUE)
        return
    # Right size, a checksum these bytes do not have.
    yield pb.GetResponse(header=pb.GetHeader(found=True, size=len(VALUE), checksum=12345))
    yield pb.GetResponse(data=VALUE)


def _exists(request: pb.ExistsRequest, context: Any) -> pb.ExistsResponse:
    return pb.ExistsResponse(exists=[True] * (len(request.keys) + 1))  # one too many


def bad_peer(port: int) -> Any:
    handlers = {
        "Get": grpc.unary_stream_rpc_method_handler(
            _get,
            request_deserializer=pb.GetRequest.FromString,
            response_serializer=pb.GetResponse.SerializeToString,
        ),
        "Exists": grpc.unary_unary_rpc_method_handler(
            _exists,
            request_deserializer=pb.ExistsRequest.FromString,
            response_serializer=pb.ExistsResponse.SerializeToString,
        ),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_wrong_answers_from_a_peer_are_misses(tmp_path: Path) -> None:
    port, peer_port = free_ports(2)
    members = f"static:127.0.0.1:{port},127.0.0.1:{peer_port}"
    server = bad_peer(peer_port)
    daemon = DaemonProcess(tmp_path, ["--listen", f"127.0.0.1:{port}", "--pool-members", members],
                           ssd="")  # fmt: skip
    client = Client(daemon.target, timeout_s=5, bulk=False)
    try:
        placement = Placement([daemon.target, f"127.0.0.1:{peer_port}"])
        names = [b"key-%03d" % i for i in range(40)] + [b"key-%03d-short" % i for i in range(40)]
        on_peer = [k for k in names if placement.owner("ns", k) != daemon.target]
        corrupt = [k for k in on_peer if not k.endswith(b"short")][:3]
        short = [k for k in on_peer if k.endswith(b"short")][:3]
        assert corrupt and short
        errors = "kvd_cluster_peer_errors_total"
        # Bytes that fail their checksum: a miss, and the peer is not marked down.
        assert [client.get("ns", key) for key in corrupt] == [None] * len(corrupt)
        assert metric(daemon.metrics_port, "kvd_cluster_checksum_mismatches_total") == len(corrupt)
        assert metric(daemon.metrics_port, errors) == 0
        # An Exists answer of the wrong length holds nothing.
        assert client.exists("ns", corrupt) == [False] * len(corrupt)
        assert metric(daemon.metrics_port, errors) == 1
        assert client.lookup("ns", corrupt) == 0  # (the peer is skipped for a second)
        # Fewer bytes than declared: a miss, once the peer is tried again.
        assert client.get("ns", short[0]) is None
        assert wait_until(
            lambda: client.get("ns", short[0]) is None and metric(daemon.metrics_port, errors) == 2
        )
    finally:
        client.close()
        daemon.discard()
        server.stop(0)
