"""A member whose bulk port resets the connection in the middle of a call
(the peer's process died between the idle check and the request: an RST,
not an end of stream) costs misses through the daemon that asked it, never
an error: for a lookup (PEER_EXISTS) and for a get (GET)."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.cluster.router import PEER_DOWN_S
from kvd.wire import bulk
from tests.cluster.cluster import FakeMember, free_ports, keys_owned, recv_all
from tests.sockets import metric
from tests.support import DaemonProcess


class ResettingMember(FakeMember):
    """Says HELLO, offers PEER_EXISTS, then answers every other frame with
    a reset (SO_LINGER 0: the kernel sends RST on close)."""

    def __init__(self, grpc_port: int) -> None:
        self.resets = 0
        super().__init__(grpc_port, bulk_ops=["exists"])

    def serve(self, sock: socket.socket) -> None:
        while True:
            head = recv_all(sock, bulk.REQUEST.size)
            request = bulk.decode_request(head, 1 << 30, bulk.TCP_OPS)
            recv_all(
                sock, request.tail_bytes + (request.length if request.op != bulk.OP_PUT else 0)
            )
            if request.op == bulk.OP_HELLO:
                sock.sendall(bulk.encode_response(bulk.OP_HELLO, request.request_id))
                continue
            self.resets += 1
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return  # closed on return: a reset


def test_a_reset_in_a_call_is_a_miss_not_an_error(tmp_path: Path) -> None:
    port, peer_port = free_ports(2)
    peer = ResettingMember(peer_port)
    target = f"127.0.0.1:{peer_port}"
    daemon = DaemonProcess(tmp_path, ["--listen", f"127.0.0.1:{port}", "--pool-members",
                                      f"static:127.0.0.1:{port},{target}",
                                      "--pool-peer-timeout-ms", "2000"], ssd="")  # fmt: skip
    try:
        placement = Placement([daemon.target, target])
        theirs = keys_owned(placement, target, 2)
        mine = keys_owned(placement, daemon.target, 1)
        with Client(daemon.target, timeout_s=10) as client:
            client.put("ns", mine[0], b"here")
            assert client.get("ns", theirs[1]) is None  # the GET resets: a miss
            assert peer.resets == 1
            # A member whose call failed is skipped for PEER_DOWN_S, then asked again.
            time.sleep(PEER_DOWN_S + 0.2)
            # The chain's first key is the peer's: asking it resets, a miss.
            assert client.lookup("ns", [theirs[0], mine[0]]) == 0
            assert peer.resets == 2
        assert metric(daemon.metrics_port, "kvd_cluster_peer_errors_total") == 2
    finally:
        daemon.discard()
        peer.close()
