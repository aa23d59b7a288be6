"""Several real kvd daemons on loopback forming one pool, for tests/pool;
and a member played by the test process (``FakeMember``)."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import zmq

from kvd.cluster.rendezvous import Placement
from kvd.v1 import kvd_pb2 as pb
from kvd.wire import bulk
from kvd.wire.grpc import POOL_VERSION, SERVICE
from tests.sockets import scrape
from tests.support import DaemonProcess, free_ports


def start_static_pool(
    root: Path, count: int, *extra: str, peer_timeout_ms: int = 200,
    own: Sequence[Sequence[str]] = (),
) -> list[DaemonProcess]:  # fmt: skip
    """``count`` daemons without L2, each naming all of them in pool_members;
    ``own[i]``: member i's flags of its own."""
    ports = free_ports(count)
    members = "static:" + ",".join(f"127.0.0.1:{port}" for port in ports)
    daemons: list[DaemonProcess] = []
    try:
        for i, port in enumerate(ports):
            where = root / f"m{i}"
            where.mkdir(parents=True, exist_ok=True)
            args = [
                "--listen", f"127.0.0.1:{port}",
                "--pool-members", members,
                "--pool-peer-timeout-ms", str(peer_timeout_ms),
                *extra,
                *(own[i] if i < len(own) else ()),
            ]  # fmt: skip
            daemons.append(DaemonProcess(where, args, ssd=""))
    except BaseException:
        for daemon in daemons:
            daemon.kill()
        raise
    return daemons


# An engine's token, admitted to team-a's namespaces, and the pool's token.
ENGINE_TOKEN = "engine-token-team-a"
POOL_TOKEN = "pool-token-of-this-fleet"


def pool_auth(root: Path) -> list[str]:
    """Daemon flags for auth with ``ENGINE_TOKEN`` (namespaces ``team-a/*``)
    and ``POOL_TOKEN`` (every namespace, and the pool token), written under ``root``."""
    digest = {t: hashlib.sha256(t.encode()).hexdigest() for t in (ENGINE_TOKEN, POOL_TOKEN)}
    tokens = root / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "team-a"\nsha256 = "{digest[ENGINE_TOKEN]}"\n'
        'namespaces = ["team-a/*"]\n'
        f'[[tokens]]\nname = "pool"\nsha256 = "{digest[POOL_TOKEN]}"\nnamespaces = ["*"]\n'
    )
    (root / "pool-token").write_text(POOL_TOKEN + "\n")
    return ["--auth-tokens-file", str(tokens), "--pool-token-file", str(root / "pool-token")]


def labelled(port: int, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in scrape(port).splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def keys_owned(placement: Placement, owner: str, count: int, suffix: bytes = b"") -> list[bytes]:
    """``count`` keys of namespace ``ns`` ending in ``suffix`` that ``owner`` owns."""
    keys = (b"k-%04d" % i + suffix for i in range(10_000))
    return [k for k in keys if placement.owner("ns", k) == owner][:count]


def recv_all(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; ConnectionError if the peer closes first."""
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise ConnectionError("closed")
        data += piece
    return bytes(data)


def gets_of(sock: socket.socket) -> Iterator[tuple[bulk.Request, bytes]]:
    """A fake member's bulk connection: its HELLO answered, then each
    request and its key (for a GET), in order; ends when the peer closes."""
    while True:
        head = recv_all(sock, bulk.REQUEST.size)
        request = bulk.decode_request(head, 1 << 30)
        tail = recv_all(sock, request.tail_bytes)
        if request.op == bulk.OP_HELLO:
            recv_all(sock, request.length)
            sock.sendall(bulk.encode_response(bulk.OP_HELLO, request.request_id))
            continue
        yield request, bulk.split_tail(request, tail)[1]


class FakeMember:
    """A pool member played by this process, for a member that misbehaves or
    is old: kvd's gRPC methods in ``handlers`` and DescribePaths (naming its
    bulk port, ``bulk_version``, ``bulk_ops`` and ``pool_version``) on
    ``grpc_port``, and a
    bulk TCP port whose every connection ``serve`` answers on a thread.
    ``named_bulk_port``: the port DescribePaths names instead, where nothing
    listens (a loopback bulk_listen seen from another node)."""

    def __init__(
        self, grpc_port: int, handlers: dict[str, Any] | None = None, *,
        bulk_version: int = bulk.VERSION, named_bulk_port: int = 0, bulk_ops: Sequence[str] = (),
        pool_version: int = POOL_VERSION,
    ) -> None:  # fmt: skip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.bulk_port = named_bulk_port or self.listener.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        paths = pb.DescribePathsResponse(
            bulk_port=self.bulk_port, bulk_version=bulk_version, bulk_ops=list(bulk_ops),
            pool_version=pool_version,
        )  # fmt: skip
        describe = grpc.unary_unary_rpc_method_handler(
            lambda request, context: paths,
            request_deserializer=pb.DescribePathsRequest.FromString,
            response_serializer=pb.DescribePathsResponse.SerializeToString,
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        methods = {"DescribePaths": describe, **(handlers or {})}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, methods),)
        )
        self.server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        self.server.start()

    def serve(self, sock: socket.socket) -> None:
        """Answer one bulk connection (closed when this returns)."""
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.server.stop(0)
        # A blocked accept() keeps the socket listening past close(); a
        # shutdown ends it, and its thread with it.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                self.serve(sock)
            except (OSError, ConnectionError):
                return


def bound_subscriber(ctx: zmq.Context[Any], topic: bytes = b"") -> tuple[zmq.Socket[bytes], str]:
    """A ZMQ SUB socket bound on a loopback port (as llm-d's indexer binds;
    a daemon's KV-event publisher connects to it), subscribed to ``topic``,
    and its endpoint."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind("tcp://127.0.0.1:0")
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub, sub.getsockopt(zmq.LAST_ENDPOINT).decode()
