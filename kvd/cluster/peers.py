"""Calls from this daemon to the other members of the pool, over their gRPC
``listen``: Exists for a lookup (one call per owner), DescribePaths for
their bulk TCP port (value reads go there: ``kvd.cluster.peer_reads``), Get
for a value from a member without one, BatchPut to hand a put to its owner.

Every call carries the hop header (kvd.cluster.scope) and, with
``pool_token_file``, the pool token as its bearer token, and is bounded by
the time it is given: the gRPC deadline and an asyncio timeout both, so a
stopped peer (SIGSTOP) costs the budget and no more. Any failure is a
``PeerError``, which the router turns into a miss. One channel per member,
opened on first use and closed when the member leaves; with
``pool_tls_ca_file``, a TLS channel (``kvd.cluster.peer_tls``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from kvd.cluster.client_tls import ClientTls
from kvd.cluster.scope import HOP_HEADER
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import POOL_VERSION, KVStoreStub
from kvd.wire.lookup import ChainShare

log = logging.getLogger("kvd.cluster.peers")

# Room over max_message_bytes for framing, as the server allows (kvd.daemon.server).
_MESSAGE_SLACK_BYTES = 1 << 20
# After new TLS files, the old channels are closed this much later: calls on
# them end within their own time, which is shorter.
CHANNEL_DRAIN_S = 30.0


# The kinds of peer failure the metrics count (kvd_cluster_peer_call_errors' kind label).
ERROR_KINDS = (
    "timeout", "unreachable", "auth", "refused", "protocol", "short", "checksum", "version",
    "transfer",
)  # fmt: skip


class PeerError(Exception):
    """A peer did not answer in time, refused, or answered something unusable;
    ``kind`` is one of ``ERROR_KINDS``."""

    def __init__(self, message: str, kind: str = "protocol", status: str = "") -> None:
        assert kind in ERROR_KINDS, kind
        super().__init__(message)
        self.kind = kind
        self.status = status  # the gRPC status name of a refused call


def _kind(code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unreachable"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return "auth"
    return "refused"


@dataclass(frozen=True)
class PeerPaths:
    """What a member's DescribePaths says of its data paths: its bulk TCP
    port (0: none), the bulk protocol version spoken there, the peer ops
    it takes beyond the NIXL ones (``kvd.wire.bulk.BULK_OPS``), the
    largest value it takes (0: not said), the version of the calls
    members make to each other (``kvd.wire.grpc.POOL_VERSION``) and whether
    its bulk port takes TLS only (``bulk_tls``)."""

    bulk_port: int
    bulk_version: int
    bulk_ops: tuple[str, ...] = ()
    max_value_bytes: int = 0
    pool_version: int = POOL_VERSION
    bulk_tls: bool = False


@dataclass(frozen=True)
class PeerValue:
    data: bytes
    checksum: int
    meta: bytes


class Peers:
    """gRPC channels to the members; every method takes the seconds it may use."""

    def __init__(self, token: str, max_message_bytes: int, tls: ClientTls | None = None) -> None:
        """``tls``: the channels' TLS (``kvd.cluster.peer_tls``); None: in clear."""
        self._metadata: tuple[tuple[str, str], ...] = ((HOP_HEADER, "1"),)
        if token:
            self._metadata += (("authorization", f"Bearer {token}"),)
        self._limit = max_message_bytes + _MESSAGE_SLACK_BYTES
        self._channels: dict[str, tuple[Any, KVStoreStub]] = {}
        self.tls = tls

    def _stub(self, member: str) -> KVStoreStub:
        found = self._channels.get(member)
        if found is None:
            options: list[tuple[str, Any]] = [
                ("grpc.max_receive_message_length", self._limit),
                ("grpc.max_send_message_length", self._limit),
                # A peer that went away is retried soon after it is back.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ]
            if self.tls is None:
                channel = grpc.aio.insecure_channel(member, options=options)
            else:
                options += self.tls.options()
                channel = grpc.aio.secure_channel(member, self.tls.credentials(), options=options)
            found = (channel, KVStoreStub(channel))
            self._channels[member] = found
        return found[1]

    def use_tls(self, tls: ClientTls) -> None:
        """New files (SIGHUP): calls from now on open new channels with them;
        the old channels are closed once the calls on them had their time
        (``CHANNEL_DRAIN_S``)."""
        self.tls = tls
        old, self._channels = list(self._channels.values()), {}
        if old:
            loop = asyncio.get_running_loop()
            loop.call_later(CHANNEL_DRAIN_S, _close_later, loop, [c for c, _ in old])

    async def retain(self, members: tuple[str, ...]) -> None:
        """Close the channels of members no longer in the pool."""
        for member in [m for m in self._channels if m not in members]:
            channel, _ = self._channels.pop(member)
            await channel.close()

    async def close(self) -> None:
        await self.retain(())

    async def _call(self, member: str, what: str, timeout_s: float, call: Any) -> Any:
        if timeout_s <= 0:
            raise PeerError(f"{member}: no time left for {what}", "timeout")
        try:
            async with asyncio.timeout(timeout_s):
                return await call
        except TimeoutError:
            raise PeerError(
                f"{member}: {what} took more than {timeout_s * 1000:.0f} ms", "timeout"
            ) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            raise PeerError(
                f"{member}: {what}: {code.name} {exc.details()}", _kind(code), code.name
            ) from None

    async def describe(self, member: str, timeout_s: float) -> PeerPaths:
        """The member's data paths; a member without DescribePaths (UNIMPLEMENTED)
        has none but gRPC."""
        stub = self._stub(member)
        request = pb.DescribePathsRequest()
        call = stub.DescribePaths(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
        try:
            reply = await self._call(member, "DescribePaths", timeout_s, call)
        except PeerError as error:
            if error.status == "UNIMPLEMENTED":
                return PeerPaths(0, 0)
            raise
        return PeerPaths(
            reply.bulk_port, reply.bulk_version, tuple(reply.bulk_ops), reply.max_value_bytes,
            reply.pool_version or 1,  # not said: a daemon from before the field
            reply.bulk_tls,
        )  # fmt: skip

    async def exists(
        self, member: str, namespace: str, keys: list[bytes], timeout_s: float,
        *, chain: ChainShare | None = None,
    ) -> list[bool]:  # fmt: skip
        """Which of ``keys`` the member holds; with ``chain``, ``keys`` are
        its share of a chain being looked up, and its policy learns from it."""
        stub = self._stub(member)
        request = pb.ExistsRequest(namespace=namespace, keys=keys)
        if chain is not None:
            request.chain_length = chain.length
            request.chain_positions.extend(chain.positions)
            request.chain_untold = chain.untold
        call = stub.Exists(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
        reply = await self._call(member, "Exists", timeout_s, call)
        if len(reply.exists) != len(keys):
            raise PeerError(
                f"{member}: Exists answered {len(reply.exists)} of {len(keys)} keys", "protocol"
            )
        return list(reply.exists)

    async def get(
        self, member: str, namespace: str, key: bytes, timeout_s: float
    ) -> PeerValue | None:
        """The value, or None when the peer does not hold it."""
        stub = self._stub(member)
        request = pb.GetRequest(namespace=namespace, key=key)
        stream = stub.Get(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
        try:
            return await self._call(member, "Get", timeout_s, _read_value(stream))  # type: ignore[no-any-return]
        finally:
            stream.cancel()  # a no-op once read in full

    async def put(
        self,
        member: str,
        namespace: str,
        key: bytes,
        value: bytes,
        meta: bytes,
        parent: bytes | None,
        checksum: int,
        timeout_s: float,
    ) -> None:
        """Store a value on ``member`` (its chain link kept); an equal value there is fine."""
        stub = self._stub(member)
        item = pb.PutItem(key=key, value=value, meta=meta, parent=parent or b"", checksum=checksum)
        request = pb.BatchPutRequest(namespace=namespace, items=[item])
        call = stub.BatchPut(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
        reply = await self._call(member, "BatchPut", timeout_s, call)
        status = reply.statuses[0] if reply.statuses else None
        if status is None or status.code not in (0, grpc.StatusCode.ALREADY_EXISTS.value[0]):
            detail = status.message if status is not None else "no status"
            raise PeerError(f"{member}: BatchPut refused: {detail}", "refused")


def _close_later(loop: asyncio.AbstractEventLoop, channels: list[Any]) -> None:
    for channel in channels:
        loop.create_task(channel.close())


async def _read_value(stream: Any) -> PeerValue | None:
    header: Any = None
    pieces: list[bytes] = []
    received = 0
    async for message in stream:
        if header is None:
            if not message.HasField("header"):
                raise PeerError("Get answer without a header", "protocol")
            header = message.header
            if not header.found:
                return None
        received += len(message.data)
        if received > header.size:
            raise PeerError(f"Get sent more than the {header.size} bytes it declared", "protocol")
        pieces.append(message.data)
    if header is None:
        raise PeerError("Get answer was empty", "protocol")
    if received != header.size:
        raise PeerError(f"Get sent {received} of {header.size} bytes", "short")
    return PeerValue(b"".join(pieces), header.checksum, header.meta)
