"""Values read from their owner with one-sided NIXL READs into the reader's
L1 pages (kvd.cluster.nixl_node, the control step on the bulk port:
kvd.paths.bulk.peer_ops), through real daemons: small, multi-page and
larger than 4 MiB, bytes checked; a member that offers no NIXL is read over
bulk TCP; an owner killed costs misses; and an owner whose pinned pages
hold other bytes than its checksum says, or whose segments lie outside its
registered memory, costs a miss, with every reserved pool page given back.
The bad owner is a NIXL agent and a bulk port in this process."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.nixl_node import NixlNode, segments
from kvd.cluster.rendezvous import Placement
from kvd.wire import bulk
from kvd.wire.checksum import checksum
from tests.cluster.cluster import (
    ENGINE_TOKEN,
    POOL_TOKEN,
    FakeMember,
    free_ports,
    keys_owned,
    labelled,
    pool_auth,
    recv_all,
    start_static_pool,
)
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

try:
    from kvd.cluster.nixl_node import _import_api

    _import_api()
except ImportError as exc:  # the pool extra is not installed
    pytest.skip(f"nixl does not import: {exc}", allow_module_level=True)

PAGE = 64 * 1024
SIZES = [1, PAGE, PAGE + 1, 4 * 1024 * 1024 + 3, 9 * 1024 * 1024]


def test_nixl_reads_land_in_l1_with_their_bytes(tmp_path: Path) -> None:
    daemons = start_static_pool(tmp_path, 3, "--pool-peer-transport", "nixl",
                                peer_timeout_ms=2000)  # fmt: skip
    owner, reader, old = daemons
    try:
        assert any("peer_transport=nixl" in line for line in reader.log), reader.log[-5:]
        placement = Placement([d.target for d in daemons])
        keys = keys_owned(placement, owner.target, len(SIZES))
        values = {key: os.urandom(size) for key, size in zip(keys, SIZES, strict=True)}
        with Client(owner.target, timeout_s=10) as client:
            for key, value in values.items():
                client.put("ns", key, value)
        port = reader.metrics_port
        free_bytes = metric(port, "kvd_pool_free_bytes")
        with Client(reader.target, timeout_s=10) as client:
            for key, value in values.items():
                assert client.get("ns", key) == value
        assert labelled(port, "kvd_cluster_peer_reads_total", transport="nixl") == len(SIZES)
        assert labelled(port, "kvd_cluster_peer_read_bytes_total", transport="nixl") == sum(SIZES)
        held = sum(-(-size // PAGE) * PAGE for size in SIZES)
        assert metric(port, "kvd_pool_free_bytes") == free_bytes - held
        assert metric(port, "kvd_cluster_peer_errors_total") == 0
        # The owner killed: its keys are misses through the others, no error.
        owner.kill()
        others = keys_owned(placement, owner.target, 3, b"-late")
        with Client(old.target, timeout_s=10) as client:
            free_old = metric(old.metrics_port, "kvd_pool_free_bytes")
            assert [client.get("ns", k) for k in others] == [None] * 3
            assert metric(old.metrics_port, "kvd_pool_free_bytes") == free_old
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_batched_get_reads_an_owners_values_in_one_batch(tmp_path: Path) -> None:
    """A batched get over shared memory of values another member owns pins
    them on one connection and READs them in one transfer
    (kvd.cluster.nixl_reads): every
    byte right, a value the owner lacks a miss among hits, L1 holding the
    values read and nothing else."""
    daemons = start_static_pool(tmp_path, 2, "--pool-peer-transport", "nixl",
                                peer_timeout_ms=2000)  # fmt: skip
    owner, reader = daemons
    try:
        placement = Placement([d.target for d in daemons])
        small = [size for size in SIZES if size < 1 << 20] * 4  # one frame of the client's
        keys = keys_owned(placement, owner.target, len(small) + 1)
        values = {key: os.urandom(size) for key, size in zip(keys, small, strict=False)}
        large_keys = keys_owned(placement, owner.target, 4, b"-large")
        large = {k: os.urandom(size) for k, size in zip(large_keys, SIZES[-2:] * 2, strict=True)}
        with Client(owner.target, timeout_s=10) as client:
            client.put_many("ns", [*values.items(), *large.items()])
        port = reader.metrics_port
        with Client(reader.socket_target, timeout_s=10) as client:
            # The reader learns the owner's ports and agent (the reads of a
            # batch that waited for them would come in more than one turn).
            assert client.get("ns", keys_owned(placement, owner.target, 1, b"-warm")[0]) is None
        reads_before = labelled(port, "kvd_cluster_peer_reads_total", transport="nixl")
        free_bytes = metric(port, "kvd_pool_free_bytes")
        with Client(reader.socket_target, timeout_s=10) as client:
            got = client.get_many("ns", keys)  # the last key: the owner lacks it
        assert got == [*values.values(), None]
        assert metric(port, "kvd_cluster_nixl_read_batches_total") == 1
        assert metric(port, "kvd_cluster_nixl_batched_reads_total") == len(keys)
        # (The key the owner lacks may be asked again by the get of its item.)
        reads = labelled(port, "kvd_cluster_peer_reads_total", transport="nixl")
        assert reads >= reads_before + len(keys)
        assert labelled(port, "kvd_cluster_peer_read_bytes_total", transport="nixl") == sum(small)
        held = sum(-(-size // PAGE) * PAGE for size in small)
        assert metric(port, "kvd_pool_free_bytes") == free_bytes - held
        assert metric(port, "kvd_cluster_peer_errors_total") == 0
        # Read again, every value is in the reader's L1: no more peer reads.
        with Client(reader.socket_target, timeout_s=10) as client:
            assert client.get_many("ns", keys[:-1]) == list(values.values())
        assert labelled(port, "kvd_cluster_peer_reads_total", transport="nixl") == reads
        # Values of several pages, as many batches as the client's frames.
        with Client(reader.socket_target, timeout_s=10) as client:
            assert client.get_many("ns", list(large)) == list(large.values())
        assert metric(port, "kvd_cluster_peer_errors_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()


def test_member_without_nixl_is_read_over_bulk(tmp_path: Path) -> None:
    ports = free_ports(2)
    members = "static:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    common = ["--pool-members", members, "--pool-peer-timeout-ms", "2000"]
    for name in ("r", "o"):
        (tmp_path / name).mkdir()
    reader = DaemonProcess(tmp_path / "r", ["--listen", f"127.0.0.1:{ports[0]}", *common,
                                            "--pool-peer-transport", "nixl"], ssd="")  # fmt: skip
    owner = DaemonProcess(tmp_path / "o", ["--listen", f"127.0.0.1:{ports[1]}", *common,
                                           "--pool-peer-transport", "bulk"], ssd="")  # fmt: skip
    try:
        placement = Placement([reader.target, owner.target])
        key = keys_owned(placement, owner.target, 1)[0]
        value = os.urandom(PAGE * 3 + 7)
        with Client(owner.target, timeout_s=10) as client:
            client.put("ns", key, value)
        with Client(reader.target, timeout_s=10) as client:
            assert client.get("ns", key) == value
        assert labelled(reader.metrics_port, "kvd_cluster_peer_reads_total", transport="bulk") == 1
        assert any("peer offers no NIXL" in line for line in reader.log)
    finally:
        reader.discard()
        owner.discard()


# ---- a bad owner -----------------------------------------------------------------------
BAD_SIZE = 3 * PAGE + 100


class BadNixlOwner(FakeMember):
    """A bulk port and a NIXL agent over a buffer of its own; NIXL_PIN
    answers by the key's last word: ``corrupt`` pins bytes that do not match
    the checksum it sends, ``outside`` segments outside its registered
    memory."""

    def __init__(self, grpc_port: int) -> None:
        self.buffer = mmap.mmap(-1, 4 * BAD_SIZE)
        self.buffer[:BAD_SIZE] = b"v" * BAD_SIZE
        node = NixlNode.start(memoryview(self.buffer), "bad-owner")
        assert isinstance(node, NixlNode), node
        self.node = node
        super().__init__(grpc_port)
        self.progressing = threading.Thread(target=self._progress, daemon=True)
        self.progressing.start()

    def _progress(self) -> None:
        """The target side of the daemon's READs (a daemon does it while it holds pins)."""
        while not self.stop.wait(0.0005):
            self.node.progress()

    def close(self) -> None:
        super().close()
        self.progressing.join(5)
        self.node.close()

    def serve(self, sock: socket.socket) -> None:
        while True:
            head = recv_all(sock, bulk.REQUEST.size)
            request = bulk.decode_request(head, 1 << 30, bulk.TCP_OPS)
            tail = recv_all(sock, request.tail_bytes)
            if request.op == bulk.OP_HELLO:
                recv_all(sock, request.length)
            sock.sendall(self._answer(request, tail))

    def _answer(self, request: bulk.Request, tail: bytes) -> bytes:
        rid = request.request_id
        if request.op in (bulk.OP_HELLO, bulk.OP_NIXL_RELEASE):
            return bulk.encode_response(request.op, rid)
        if request.op == bulk.OP_NIXL_META:
            metadata = self.node.metadata
            return bulk.encode_response(request.op, rid, length=len(metadata)) + metadata
        _, key, _, _ = bulk.split_tail(request, tail)
        if request.op != bulk.OP_NIXL_PIN or not key.endswith((b"corrupt", b"outside")):
            return bulk.encode_response(request.op, rid, bulk.CODE_NOT_FOUND)
        ((address, _),) = segments([memoryview(self.buffer)[:BAD_SIZE]])
        if key.endswith(b"outside"):
            address += 1 << 40  # no memory of its agent's
        sent = checksum(b"w" * BAD_SIZE)  # not what the pages hold
        payload = bulk.NIXL_PIN.pack(BAD_SIZE, 1, 1) + bulk.NIXL_SEGMENT.pack(address, BAD_SIZE)
        head = bulk.encode_response(request.op, rid, length=len(payload), checksum=sent)
        return head + payload


@contextlib.contextmanager
def _beside_a_bad_owner(tmp_path: Path) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon reading over NIXL in a pool of two whose other member (its
    address given too) is a ``BadNixlOwner``."""
    port, bad_port = free_ports(2)
    bad = BadNixlOwner(bad_port)
    (tmp_path / "d").mkdir()
    peer = f"127.0.0.1:{bad_port}"
    members = f"static:127.0.0.1:{port},{peer}"
    daemon = DaemonProcess(tmp_path / "d", ["--listen", f"127.0.0.1:{port}",
                                            "--pool-members", members,
                                            "--pool-peer-timeout-ms", "2000",
                                            "--pool-peer-transport", "nixl"], ssd="")  # fmt: skip
    try:
        yield daemon, peer
    finally:
        daemon.discard()
        bad.close()


def test_bad_nixl_owner_costs_misses_and_no_pages(tmp_path: Path) -> None:
    with (
        _beside_a_bad_owner(tmp_path) as (daemon, peer),
        Client(daemon.target, timeout_s=10) as client,
    ):
        placement = Placement([daemon.target, peer])
        mport = daemon.metrics_port
        free_bytes = metric(mport, "kvd_pool_free_bytes")
        corrupt = keys_owned(placement, peer, 2, b"-corrupt")
        for key in corrupt:
            assert client.get("ns", key) is None
        assert metric(mport, "kvd_cluster_checksum_mismatches_total") == len(corrupt)
        assert labelled(mport, "kvd_cluster_peer_reads_total", transport="nixl") == 0
        assert metric(mport, "kvd_pool_free_bytes") == free_bytes
        outside = keys_owned(placement, peer, 1, b"-outside")[0]
        assert wait_until(
            lambda: (
                client.get("ns", outside) is None
                and labelled(mport, "kvd_cluster_peer_call_errors_total", kind="transfer") >= 1
            )
        )
        assert wait_until(lambda: metric(mport, "kvd_pool_free_bytes") == free_bytes)


def test_a_bad_owners_batch_costs_misses_and_no_pages(tmp_path: Path) -> None:
    """In one batch, values whose bytes fail their checksum are misses each;
    a batch whose transfer fails (a segment outside the owner's memory) is
    a miss for every value in it; every reserved page goes back."""
    with (
        _beside_a_bad_owner(tmp_path) as (daemon, peer),
        Client(daemon.socket_target, timeout_s=10) as client,
    ):
        placement = Placement([daemon.target, peer])
        mport = daemon.metrics_port
        free_bytes = metric(mport, "kvd_pool_free_bytes")
        corrupt = keys_owned(placement, peer, 3, b"-corrupt")
        absent = keys_owned(placement, peer, 2, b"-absent")
        assert client.get("ns", absent[1]) is None  # the owner's ports and agent learnt
        assert client.get_many("ns", corrupt + absent[:1]) == [None] * 4
        assert metric(mport, "kvd_cluster_nixl_read_batches_total") == 1
        assert metric(mport, "kvd_cluster_checksum_mismatches_total") == len(corrupt)
        assert metric(mport, "kvd_pool_free_bytes") == free_bytes
        outside = keys_owned(placement, peer, 1, b"-outside")
        more = keys_owned(placement, peer, 5, b"-corrupt")[3:]
        assert wait_until(
            lambda: (
                client.get_many("ns", outside + more) == [None] * 3
                and labelled(mport, "kvd_cluster_peer_call_errors_total", kind="transfer") >= 1
            )
        )
        assert metric(mport, "kvd_cluster_nixl_read_batches_total") >= 2
        assert wait_until(lambda: metric(mport, "kvd_pool_free_bytes") == free_bytes)
        assert labelled(mport, "kvd_cluster_peer_read_bytes_total", transport="nixl") == 0


def test_with_auth_only_the_pool_token_may_pin(tmp_path: Path) -> None:
    auth = [*pool_auth(tmp_path), "--pool-peer-transport", "nixl"]
    daemons = start_static_pool(tmp_path, 2, *auth, peer_timeout_ms=2000)
    owner, reader = daemons
    try:
        ns = "team-a/model"
        key = _keys_owned_in(Placement([d.target for d in daemons]), ns, owner.target)
        value = os.urandom(2 * PAGE + 5)
        with Client(owner.target, token=ENGINE_TOKEN, timeout_s=10) as client:
            client.put(ns, key, value)
        with Client(reader.target, token=ENGINE_TOKEN, timeout_s=10) as client:
            assert client.get(ns, key) == value
        port = reader.metrics_port
        assert labelled(port, "kvd_cluster_peer_reads_total", transport="nixl") == 1
        # An engine's token reads its namespaces on the bulk port, but not the
        # agent metadata that would let it READ the whole arena.
        for token, code in ((ENGINE_TOKEN, "PERMISSION_DENIED"), (POOL_TOKEN, "OK")):
            with socket.create_connection(("127.0.0.1", owner.bulk_port), timeout=5) as sock:
                hello = token.encode()
                sock.sendall(bulk.encode_request(bulk.OP_HELLO, 0, length=len(hello)) + hello)
                assert _answer(sock)[0] == 0
                sock.sendall(bulk.encode_request(bulk.OP_NIXL_META, 1))
                got, length = _answer(sock)
                assert bulk.NAME_BY_CODE[got] == code
                assert (length > 0) == (code == "OK")
    finally:
        for daemon in daemons:
            daemon.discard()


def _keys_owned_in(placement: Placement, ns: str, owner: str) -> bytes:
    return next(k for k in (b"t-%04d" % i for i in range(1000)) if placement.owner(ns, k) == owner)


def _answer(sock: socket.socket) -> tuple[int, int]:
    """(code, length) of the next answer; its meta and message are read and dropped."""
    head = bulk.RESPONSE.unpack(recv_all(sock, bulk.RESPONSE.size))
    recv_all(sock, head[6] + head[7])
    return head[5], head[8]


def test_a_daemon_that_ran_nixl_stops_cleanly(tmp_path: Path) -> None:
    """SIGTERM ends a NIXL daemon with status 0: UCX's teardown at exit
    crashed it (SIGSEGV) here, so it ends with os._exit once shut down."""
    daemons = start_static_pool(tmp_path, 2, "--pool-peer-transport", "nixl")
    assert all(any("peer_transport=nixl" in line for line in d.log) for d in daemons)
    assert [daemon.stop() for daemon in daemons] == [0, 0]
    assert all(any("kvd stopped" in line for line in d.log) for d in daemons)  # logs flushed
