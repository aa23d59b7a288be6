"""A batch of values read from one owner over its bulk port
(kvd.cluster.peer_reads): the reads asked together go out as GET frames back
to back on each connection, the answers read in order, and each value keeps
its own outcome: good values land with their bytes, a miss, a refusal and a
value whose bytes fail their checksum are misses on their own, the values
after them still read. The owner is a small bulk port in this process that
notes how many GET frames were waiting when it answered the first; the
daemon reading from it is real."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.wire import bulk
from kvd.wire.checksum import checksum
from tests.cluster.cluster import FakeMember, free_ports, gets_of, keys_owned, labelled
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

# More than the reader's connections to one member (8): some carry several.
GOOD = 20
PAGE = 64 * 1024


def value_of(key: bytes) -> bytes:
    return key * 2000


class BatchOwner(FakeMember):
    """A bulk port answering each GET by its key's last word: ``-none`` not
    found, ``-refused`` PERMISSION_DENIED, ``-corrupt`` a wrong checksum,
    else the value; it waits a moment before each answer and notes the GET
    frames that arrived behind it meanwhile."""

    def __init__(self, grpc_port: int) -> None:
        super().__init__(grpc_port)
        self.lock = threading.Lock()
        self.waiting: list[int] = []  # per GET: frames already behind it when answered

    def serve(self, sock: socket.socket) -> None:
        for request, key in gets_of(sock):
            time.sleep(0.005)  # a moment for frames sent back to back to arrive
            try:
                behind = len(sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                behind = 0
            with self.lock:
                self.waiting.append(behind // bulk.REQUEST.size)
            sock.sendall(self._answer(request.request_id, key))

    def _answer(self, rid: int, key: bytes) -> bytes:
        if key.endswith(b"-none"):
            return bulk.encode_response(bulk.OP_GET, rid, bulk.CODE_NOT_FOUND)
        if key.endswith(b"-refused"):
            code = bulk.CODE_BY_NAME["PERMISSION_DENIED"]
            return bulk.encode_response(bulk.OP_GET, rid, code, message="not yours")
        value = value_of(key)
        good = checksum(value) if not key.endswith(b"-corrupt") else 12345
        return bulk.encode_response(bulk.OP_GET, rid, length=len(value), checksum=good) + value


def test_a_batch_from_one_owner_goes_back_to_back_and_each_value_keeps_its_outcome(
    tmp_path: Path,
) -> None:
    port, owner_port = free_ports(2)
    owner = BatchOwner(owner_port)
    peer = f"127.0.0.1:{owner_port}"
    daemon = DaemonProcess(tmp_path, ["--listen", f"127.0.0.1:{port}", "--pool-members",
                                      f"static:127.0.0.1:{port},{peer}",
                                      "--pool-peer-timeout-ms", "2000",
                                      "--pool-peer-transport", "bulk"], ssd="")  # fmt: skip
    try:
        placement = Placement([daemon.target, peer])
        good = keys_owned(placement, peer, GOOD, b"-ok")
        bad = [
            keys_owned(placement, peer, 1, tag)[0] for tag in (b"-none", b"-refused", b"-corrupt")
        ]
        keys = good[:5] + bad[:1] + good[5:10] + bad[1:2] + good[10:15] + bad[2:] + good[15:]
        mport = daemon.metrics_port
        free_bytes = metric(mport, "kvd_pool_free_bytes")
        with Client(daemon.target, timeout_s=10, bulk=False) as client:
            warm = keys_owned(placement, peer, 1, b"-warm")[0]  # the owner's paths asked first
            assert client.get("ns", warm) == value_of(warm)
            owner.waiting.clear()
            got = client.get_many("ns", keys)  # one BatchGet: the owner's share asked at once
        assert got == [None if key in bad else value_of(key) for key in keys]
        # GET frames sent back to back: some arrived before the one ahead was answered.
        assert max(owner.waiting) >= 1, owner.waiting
        assert metric(mport, "kvd_cluster_remote_hits_total") == GOOD + 1
        assert metric(mport, "kvd_cluster_checksum_mismatches_total") == 1
        assert labelled(mport, "kvd_cluster_peer_call_errors_total", kind="auth") == 1
        assert metric(mport, "kvd_cluster_remote_misses_total") == 1
        # The good values are in L1 (a page each), the corrupt one's page went back.
        assert all(len(value_of(key)) <= PAGE for key in good)
        held = (GOOD + 1) * PAGE
        assert wait_until(lambda: metric(mport, "kvd_pool_free_bytes") == free_bytes - held)
    finally:
        daemon.discard()
        owner.close()
