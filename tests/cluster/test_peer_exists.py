"""A member's Exists on the owner's bulk port (PEER_EXISTS, kvd.cluster.peer_bulk,
kvd.paths.bulk.peer_ops): a real daemon answers the frame as it answers the
gRPC Exists, to the pool token only, and refuses a malformed one without
losing the connection; it learns from the lookups of a PEER_TELL, answers
nothing, and closes the connection of a tell it cannot take; it gives a
PEER_HISTORY to the put that follows, answers nothing, and ignores bytes
that are no history; a real daemon
looking a chain up asks an owner that offers the op on its bulk port (an
owner here that has no gRPC Exists at all), and one that does not over
gRPC."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.store.eviction.density import DensityPolicy
from kvd.v1 import kvd_pb2 as pb
from kvd.wire import bulk
from kvd.wire.grpc import SERVICE
from kvd.wire.lookup import ChainShare
from tests.cluster.cluster import (
    ENGINE_TOKEN,
    POOL_TOKEN,
    FakeMember,
    free_ports,
    keys_owned,
    pool_auth,
    recv_all,
    start_static_pool,
)
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

NS = "team-a/model"


def _connect(port: int, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = token.encode()
    sock.sendall(bulk.encode_request(bulk.OP_HELLO, 0, length=len(hello)) + hello)
    assert _answer(sock)[0] == bulk.CODE_OK
    return sock


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """(code, payload) of the next answer; its meta and message are dropped."""
    head = bulk.RESPONSE.unpack(recv_all(sock, bulk.RESPONSE.size))
    recv_all(sock, head[6] + head[7])
    return head[5], recv_all(sock, head[8]) if head[5] == bulk.CODE_OK else b""


def _exists(sock: socket.socket, rid: int, payload: bytes, ns: str = NS) -> tuple[int, bytes]:
    request = bulk.encode_request(
        bulk.OP_PEER_EXISTS, rid, ns.encode(), flags=bulk.FLAG_HOP, length=len(payload)
    )
    sock.sendall(request + payload)
    return _answer(sock)


def test_exists_frames_are_answered_to_the_pool_token(tmp_path: Path) -> None:
    daemons = start_static_pool(tmp_path, 2, *pool_auth(tmp_path), peer_timeout_ms=2000)
    owner = daemons[0]
    try:
        held = [b"held-%04d" % i for i in range(3)]
        with Client(owner.target, token=ENGINE_TOKEN, timeout_s=10) as client:
            for key in held:
                client.put(NS, key, key)
        keys = [held[0], b"gone-0000", held[1], held[2]]
        payload = bulk.encode_exists(9, b"".join(keys), None)
        share = bulk.encode_exists(9, b"".join(keys), ChainShare(10, [0, 3, 5, 9]))
        # Each key held is answered kept: an owner pins what it answers held
        # for the asking member's lookup hints (pool_lookup_hint_ms, on by default).
        kept = bytes([bulk.EXISTS_KEPT, bulk.EXISTS_NOT_HELD, bulk.EXISTS_KEPT, bulk.EXISTS_KEPT])
        with _connect(owner.bulk_port, POOL_TOKEN) as sock:
            assert _exists(sock, 1, payload) == (bulk.CODE_OK, kept)
            assert _exists(sock, 2, share) == (bulk.CODE_OK, kept)
            # Parts that do not add up, positions out of order: refused, and
            # the connection goes on.
            bad = bulk.EXISTS_REF.pack(9, 5, 0) + b"".join(keys)
            assert _exists(sock, 3, bad)[0] == bulk.CODE_BY_NAME["INVALID_ARGUMENT"]
            disorder = bulk.encode_exists(9, b"".join(keys), ChainShare(10, [3, 0, 5, 9]))
            assert _exists(sock, 4, disorder)[0] == bulk.CODE_BY_NAME["INVALID_ARGUMENT"]
            assert _exists(sock, 5, payload) == (bulk.CODE_OK, kept)
            # A share after 3 lookups that held none of this member's keys;
            # a meta that is no count is refused.
            metas = [
                (7, bulk.EXISTS_UNTOLD.pack(3), "OK"),
                (8, b"\x03\x00", "INVALID_ARGUMENT"),
                (9, bulk.EXISTS_UNTOLD.pack(4097), "INVALID_ARGUMENT"),
            ]
            for rid, meta, code in metas:
                request = bulk.encode_request(bulk.OP_PEER_EXISTS, rid, NS.encode(), meta=meta,
                                              flags=bulk.FLAG_HOP, length=len(share))  # fmt: skip
                sock.sendall(request + share)
                assert _answer(sock)[0] == bulk.CODE_BY_NAME[code]
            # More key bytes than max_lookup_keys allows: closed before they are read.
            huge = bulk.exists_payload_bytes_max(16_384) + 1
            sock.sendall(bulk.encode_request(bulk.OP_PEER_EXISTS, 6, NS.encode(), length=huge))
            assert sock.recv(1) == b""
        # An engine's token may not ask as a member.
        with _connect(owner.bulk_port, ENGINE_TOKEN) as sock:
            assert _exists(sock, 1, payload)[0] == bulk.CODE_BY_NAME["PERMISSION_DENIED"]
        with grpc.insecure_channel(owner.target) as channel:
            describe = channel.unary_unary(
                f"/{SERVICE}/DescribePaths",
                request_serializer=pb.DescribePathsRequest.SerializeToString,
                response_deserializer=pb.DescribePathsResponse.FromString,
            )
            paths = describe(
                pb.DescribePathsRequest(), metadata=[("authorization", f"Bearer {POOL_TOKEN}")]
            )
            assert list(paths.bulk_ops) == ["exists", "plan", "tell", "put", "history"]
    finally:
        for daemon in daemons:
            daemon.discard()


def _tell(sock: socket.socket, shares: list[tuple[list[bytes], ChainShare]], ns: str = NS) -> None:
    payload = bulk.encode_tell([(len(keys[0]), b"".join(keys), chain) for keys, chain in shares])
    request = bulk.encode_request(
        bulk.OP_PEER_TELL, 99, ns.encode(), flags=bulk.FLAG_HOP, length=len(payload)
    )
    sock.sendall(request + payload)


def test_tells_are_learned_and_never_answered(tmp_path: Path) -> None:
    daemons = start_static_pool(tmp_path, 2, *pool_auth(tmp_path), peer_timeout_ms=2000)
    owner = daemons[0]
    try:
        keys = [b"told-%04d" % i for i in range(4)]
        payload = bulk.encode_exists(9, b"".join(keys), None)
        learned = metric(owner.metrics_port, "kvd_cluster_shares_learned_total")
        with _connect(owner.bulk_port, POOL_TOKEN) as sock:
            _tell(
                sock, [(keys, ChainShare(10, [0, 3, 5, 9])), (keys[:2], ChainShare(2, [0, 1], 3))]
            )
            # No answer for the tell: the next answer on the connection is the Exists'.
            assert _exists(sock, 1, payload) == (bulk.CODE_OK, b"\x00" * 4)
        assert wait_until(
            lambda: metric(owner.metrics_port, "kvd_cluster_shares_learned_total") == learned + 2
        )
        # What cannot be taken closes the connection: there is no answer to refuse it with.
        with _connect(owner.bulk_port, POOL_TOKEN) as sock:
            _tell(sock, [(keys, ChainShare(10, [3, 0, 5, 9]))])  # positions out of order
            assert sock.recv(1) == b""
        with _connect(owner.bulk_port, POOL_TOKEN) as sock:
            request = bulk.encode_request(bulk.OP_PEER_TELL, 2, NS.encode(), length=7)
            sock.sendall(request + bulk.TELL_COUNT.pack(1) + b"\x00" * 3)  # cut short
            assert sock.recv(1) == b""
        with _connect(owner.bulk_port, ENGINE_TOKEN) as sock:  # not a member
            _tell(sock, [(keys, ChainShare(10, [0, 3, 5, 9]))])
            assert sock.recv(1) == b""
        assert metric(owner.metrics_port, "kvd_cluster_shares_learned_total") == learned + 2
    finally:
        for daemon in daemons:
            daemon.discard()


def _history(sock: socket.socket, key: bytes, history: bytes, length: int = 0) -> None:
    request = bulk.encode_request(
        bulk.OP_PEER_HISTORY, 98, NS.encode(), key, meta=history, flags=bulk.FLAG_HOP,
        length=length,
    )  # fmt: skip
    sock.sendall(request)  # a payload it claims is not read: the connection closes first


def test_a_history_goes_with_the_next_put_and_is_never_answered(tmp_path: Path) -> None:
    daemons = start_static_pool(tmp_path, 2, *pool_auth(tmp_path), peer_timeout_ms=2000)
    owner = daemons[0]
    try:
        # A history as a member's density policy makes it.
        policy = DensityPolicy[bytes]()
        policy.on_lookup([b"handed"], 0)
        policy.insert(b"handed", None)
        history = policy.history(b"handed")
        assert history is not None
        taken = metric(owner.metrics_port, "kvd_cluster_histories_taken_total")
        value = b"v" * 1000
        put = bulk.encode_request(
            bulk.OP_PUT, 2, NS.encode(), b"handed", length=len(value), flags=bulk.FLAG_HOP
        )
        with _connect(owner.bulk_port, POOL_TOKEN) as sock:
            _history(sock, b"handed", history)
            # No answer for the history: the next answer on the connection is the put's.
            sock.sendall(put + value)
            assert _answer(sock)[0] == bulk.CODE_OK
            # Bytes that are no history are ignored, and the connection goes on.
            _history(sock, b"other", history[:-1])
            assert _exists(sock, 3, bulk.encode_exists(6, b"handed", None)) == (
                bulk.CODE_OK, bytes([bulk.EXISTS_KEPT]),
            )  # fmt: skip
        assert metric(owner.metrics_port, "kvd_cluster_histories_taken_total") == taken + 1
        # A payload, or a connection without the pool token: closed.
        with _connect(owner.bulk_port, POOL_TOKEN) as sock:
            _history(sock, b"handed", history, length=3)
            assert sock.recv(1) == b""
        with _connect(owner.bulk_port, ENGINE_TOKEN) as sock:
            _history(sock, b"handed", history)
            assert sock.recv(1) == b""
        assert metric(owner.metrics_port, "kvd_cluster_histories_taken_total") == taken + 1
    finally:
        for daemon in daemons:
            daemon.discard()


class FakeOwner(FakeMember):
    """A member holding every key it is asked about, with either a bulk port
    that answers PEER_EXISTS (``bulk_ops`` names it; no gRPC Exists at all)
    or a gRPC Exists (``bulk_ops`` empty, as an older daemon's). Records each
    Exists: its transport, keys and chain."""

    def __init__(self, grpc_port: int, offer_exists: bool) -> None:
        self.asked: list[tuple[str, list[bytes], ChainShare | None]] = []
        self.target = f"127.0.0.1:{grpc_port}"

        def exists(request: pb.ExistsRequest, context: Any) -> pb.ExistsResponse:
            chain = None
            if request.chain_length:
                positions = list(request.chain_positions)
                chain = ChainShare(request.chain_length, positions, request.chain_untold)
            self.asked.append(("grpc", list(request.keys), chain))
            return pb.ExistsResponse(exists=[True] * len(request.keys))

        handlers = {}
        if not offer_exists:
            handlers["Exists"] = grpc.unary_unary_rpc_method_handler(
                exists,
                request_deserializer=pb.ExistsRequest.FromString,
                response_serializer=pb.ExistsResponse.SerializeToString,
            )
        super().__init__(grpc_port, handlers, bulk_ops=["exists"] if offer_exists else [])

    def serve(self, sock: socket.socket) -> None:
        while True:
            head = recv_all(sock, bulk.REQUEST.size)
            request = bulk.decode_request(head, 1 << 30, bulk.TCP_OPS)
            tail = recv_all(sock, request.tail_bytes)
            payload = recv_all(sock, request.length)
            if request.op == bulk.OP_HELLO:
                sock.sendall(bulk.encode_response(bulk.OP_HELLO, request.request_id))
                continue
            if request.op == bulk.OP_PEER_PLAN:  # not offered: never asked
                raise AssertionError("a plan was asked of a member that offers none")
            assert request.op == bulk.OP_PEER_EXISTS
            keys, chain = bulk.decode_exists(payload, bulk.split_tail(request, tail)[3])
            self.asked.append(("bulk", keys, chain))
            answer = b"\x01" * len(keys)
            head = bulk.encode_response(bulk.OP_PEER_EXISTS, request.request_id, length=len(answer))
            sock.sendall(head + answer)


def _beside_a_fake_owner(tmp_path: Path, offer_exists: bool) -> tuple[FakeOwner, DaemonProcess]:
    """A daemon in a pool of two whose other member is a ``FakeOwner``, which
    answers lookups only (the daemon fetches nothing ahead of a get)."""
    port, owner_port = free_ports(2)
    owner = FakeOwner(owner_port, offer_exists)
    members = f"static:127.0.0.1:{port},{owner.target}"
    try:
        args = ["--listen", f"127.0.0.1:{port}", "--pool-members", members,
                "--pool-peer-timeout-ms", "2000", "--pool-prefetch-keys", "0"]  # fmt: skip
        daemon = DaemonProcess(tmp_path, args, ssd="")
    except BaseException:
        owner.close()
        raise
    return owner, daemon


def _lookup_through(
    tmp_path: Path, offer_exists: bool, lease_ms: int = 0
) -> list[tuple[str, list[bytes], Any]]:
    owner, daemon = _beside_a_fake_owner(tmp_path, offer_exists)
    peer = owner.target
    try:
        placement = Placement([daemon.target, peer])
        theirs = keys_owned(placement, peer, 3)
        mine = keys_owned(placement, daemon.target, 1)
        chain = [theirs[0], mine[0], theirs[1], theirs[2]]
        with Client(daemon.target, timeout_s=5) as client:
            client.put("ns", mine[0], b"here")
            found = client.lookup_ex("ns", chain, lease_ms=lease_ms)
            assert found.prefix_len == len(chain)
            # The key held here past the (empty) local prefix is leased with it.
            assert (bool(found.lease_id), found.lease_ms) == (bool(lease_ms), lease_ms)
            if lease_ms:
                assert client.release("ns", found.lease_id)
        return owner.asked
    finally:
        daemon.discard()
        owner.close()


def test_a_lookup_asks_the_owner_on_its_bulk_port(tmp_path: Path) -> None:
    asked = _lookup_through(tmp_path, offer_exists=True, lease_ms=5000)
    assert asked == [("bulk", asked[0][1], ChainShare(4, [0, 2, 3]))]
    assert len(asked[0][1]) == 3


def test_an_owner_without_the_frame_is_asked_over_grpc(tmp_path: Path) -> None:
    asked = _lookup_through(tmp_path, offer_exists=False)
    assert [(how, chain) for how, _, chain in asked] == [("grpc", ChainShare(4, [0, 2, 3]))]


@pytest.mark.parametrize("offer_exists", [True, False], ids=["bulk", "grpc"])
def test_a_member_hears_of_the_lookups_it_owned_no_key_of(
    tmp_path: Path, offer_exists: bool
) -> None:
    """Two lookups reach only member A; the next that holds a key of
    member B's tells B that it missed two (ChainShare.untold), on either
    transport, and A that it missed none."""
    port, a_port, b_port = free_ports(3)
    a, b = FakeOwner(a_port, offer_exists), FakeOwner(b_port, offer_exists)
    peers = [f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"]
    daemon = DaemonProcess(tmp_path, ["--listen", f"127.0.0.1:{port}", "--pool-members",
                                      f"static:127.0.0.1:{port},{','.join(peers)}",
                                      "--pool-peer-timeout-ms", "2000"], ssd="")  # fmt: skip
    try:
        placement = Placement([daemon.target, *peers])
        of_a = keys_owned(placement, peers[0], 3)
        of_b = keys_owned(placement, peers[1], 1)
        with Client(daemon.target, timeout_s=5) as client:
            assert client.lookup("ns", of_a[:1]) == 1
            assert client.lookup("ns", of_a[1:2]) == 1
            assert client.lookup("ns", [of_a[2], of_b[0]]) == 2
        assert [chain for _, _, chain in a.asked] == [ChainShare(1, [0])] * 2 + [ChainShare(2, [0])]
        assert [chain for _, _, chain in b.asked] == [ChainShare(2, [1], untold=2)]
    finally:
        daemon.discard()
        a.close()
        b.close()


def test_an_owner_without_tell_is_told_with_an_exists(tmp_path: Path) -> None:
    """A lookup that needs no owner's answer (it ends at a key this daemon
    owns and lacks) tells the owners of its other keys: an owner that
    offers no PEER_TELL gets an Exists of its share, untold lookups included."""
    owner, daemon = _beside_a_fake_owner(tmp_path, offer_exists=True)  # bulk_ops: "exists"
    peer = owner.target
    try:
        placement = Placement([daemon.target, peer])
        theirs = keys_owned(placement, peer, 2)
        mine = keys_owned(placement, daemon.target, 2)
        with Client(daemon.target, timeout_s=5) as client:
            assert client.lookup("ns", [mine[0]]) == 0  # none of the owner's keys: untold
            assert client.lookup("ns", [mine[1], *theirs]) == 0
        assert wait_until(lambda: len(owner.asked) == 1)
        assert owner.asked == [("bulk", theirs, ChainShare(3, [1, 2], untold=1))]
    finally:
        daemon.discard()
        owner.close()
