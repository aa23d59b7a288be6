"""The shm socket: region gets and puts without gRPC.

A shared-memory get or put moves no value bytes over any socket, so what it
costs beyond the copy is the round trip that asks for it. Over gRPC that is
~0.6 ms on a small machine; over this Unix socket, with the bulk protocol's
40-byte frames (docs/bulk-protocol.md, "Region ops"), it is a few tens of µs.
Regions are still attached and detached over gRPC (rare calls); the per-item
work is the gRPC handlers' own (``RegionHandlers.get_into_region`` and
``put_from_region``), so both ways give the same answers, limits and metrics.

Server: per connection, a reader task reads frames and starts each op as
its own task (at most ``PIPELINE_FRAMES`` unanswered), and a writer task
sends the answers in request order. Ops of one connection therefore run
concurrently: on a machine with cores to spare (``kvd.cpus``) a batch's
copies go to the copy threads together, while a lone get still copies on
the event loop (the hand-off costs more than a few MiB of copying). A get
that arrives with nothing unanswered and needs no waiting (an L1 value
copied on the loop: ``get_now``; a put likewise, ``put_now``) is answered
by the reader itself.

HELLO first, with the bearer token when auth is on; every op then names its
namespace and is authorized like a gRPC call, and names its region by id
and token like ``GetIntoRegion`` does. Bad framing, a
frame slower than ``bulk_frame_timeout_ms`` or silence past
``bulk_idle_timeout_ms`` closes the connection with a logged reason.

Client: ``RegionOps`` turns the gRPC-shaped batch requests of
``kvd.shm_client`` into frames over ``BulkClient``'s connection pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvd.bulk import (
    FLAG_CHECKSUM,
    FLAG_DURABLE,
    FLAG_EXISTED,
    OP_HELLO,
    OP_REGION_GET,
    OP_REGION_PUT,
    REQUEST,
    ProtocolError,
    Request,
    decode_request,
    encode_request,
    encode_response,
    error_code,
)
from kvd.bulk_client import Answer, BulkClient, Connection
from kvd.errors import InvalidArgument, KvdError
from kvd.v1 import kvd_pb2 as pb

if TYPE_CHECKING:
    from kvd.auth import Principal
    from kvd.bulk import BulkLimits
    from kvd.shm_service import RegionHandlers

log = logging.getLogger("kvd.shm")
T = TypeVar("T")

CHANNEL_OPS = frozenset({OP_HELLO, OP_REGION_GET, OP_REGION_PUT})
# After the header of a region op: region id, offset in the region, region token.
REGION_REF = struct.Struct("<QQ16s")
SOCKET_NAME = "kvd.sock"
# Answer flags above the protocol's: the tier a get was served from.
TIER_SHIFT = 8
# Frames one client sends before reading answers: 16 × (72-byte header and
# ref + ≤ 4.5 KiB of names and meta) stays below a Unix socket's buffer.
PIPELINE_FRAMES = 16
_OPS = {OP_REGION_GET: "shm_get", OP_REGION_PUT: "shm_put"}


def socket_path(shm_dir: str, configured: str) -> str:
    return configured or os.path.join(shm_dir, SOCKET_NAME)


# ---- server ---------------------------------------------------------------------------
_BUSY, _IDLE, _IN_FRAME = 0, 1, 2  # what a connection waits for


@dataclass(eq=False)
class _Peer:
    writer: asyncio.StreamWriter
    since: float  # loop time the current wait began (or the last answer left)
    waiting: int = _BUSY
    reason: str = ""
    unanswered: int = 0  # ops read and not yet answered: the client waits on us

    def close(self, reason: str) -> None:
        self.reason = reason
        self.writer.transport.abort()


class ShmChannel:
    """Serves region ops on a Unix socket for ``RegionHandlers``."""

    def __init__(self, service: RegionHandlers, path: str, limits: BulkLimits) -> None:
        self.service = service
        self.path = path
        self.limits = limits
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[asyncio.Task[None], _Peer] = {}
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind the socket; OSError when it cannot (the daemon then serves gRPC only)."""
        _claim(self.path)
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)
        os.chmod(self.path, 0o660)  # the shm directory (0o770) already limits who gets here
        self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for task in list(self._peers):
            task.cancel()
        await asyncio.gather(*self._peers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    @property
    def connection_count(self) -> int:
        return len(self._peers)

    async def _watch(self) -> None:
        """Close connections that wait too long for their client's bytes.

        One task for all connections: a timeout per read (``asyncio.wait_for``)
        costs ~20 µs a frame here, as much as the whole round trip."""
        limits = self.limits
        period_s = min(1.0, limits.frame_timeout_s / 4, limits.idle_timeout_s / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period_s)
            now = loop.time()
            for peer in self._peers.values():
                waited_s = now - peer.since
                idle = peer.waiting == _IDLE and not peer.unanswered
                if idle and waited_s > limits.idle_timeout_s:
                    peer.close(f"no frame for {limits.idle_timeout_s:g} s")
                elif peer.waiting == _IN_FRAME and waited_s > limits.frame_timeout_s:
                    peer.close(f"frame not complete within {limits.frame_timeout_s:g} s")

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._peers) >= self.limits.max_connections:
            log.warning("shm socket connection refused", extra={"reason": "too many connections"})
            writer.close()
            return
        peer = self._peers[task] = _Peer(writer, asyncio.get_running_loop().time())
        try:
            await self._serve(reader, peer)
        except (ProtocolError, asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = peer.reason or (
                "ended inside a frame" if isinstance(exc, asyncio.IncompleteReadError) else str(exc)
            )
            log.warning("shm socket connection closed", extra={"reason": reason})
        finally:
            del self._peers[task]
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, peer: _Peer) -> None:
        principal: Principal | None = None
        first = True
        writer = peer.writer
        loop = asyncio.get_running_loop()
        max_value_bytes = self.service.store.limits.max_value_bytes
        answers: asyncio.Queue[asyncio.Task[bytes] | None] = asyncio.Queue(PIPELINE_FRAMES)
        answering: asyncio.Task[None] | None = None
        running: set[asyncio.Task[bytes]] = set()
        answered_now = 0
        try:
            while answering is None or not answering.done():
                peer.waiting, peer.since = _IDLE, loop.time()
                try:
                    # One byte starts a frame: from then on the frame timeout runs.
                    start = await reader.readexactly(1)
                except asyncio.IncompleteReadError:
                    if peer.reason:
                        raise
                    break  # closed between frames: what was read is still answered
                peer.waiting, peer.since = _IN_FRAME, loop.time()
                header = start + await reader.readexactly(REQUEST.size - 1)
                request = decode_request(header, max_value_bytes, CHANNEL_OPS)
                if first != (request.op == OP_HELLO):
                    raise ProtocolError("HELLO must come first, and only once")
                tail = request.tail_bytes + (request.length if first else REGION_REF.size)
                rest = await reader.readexactly(tail)
                peer.waiting = _BUSY
                if first:
                    first = False
                    principal, answer = self._hello(request, rest)
                    writer.write(answer)
                    await writer.drain()
                    if principal is None and self.service.auth is not None:
                        return
                    answering = asyncio.create_task(self._answer(answers, peer))
                    continue
                assert answering is not None, "HELLO started the writer"
                if not peer.unanswered:  # nothing ahead of it: it may answer at once
                    now = self._op_now(request, rest, principal)
                    if now is not None:
                        writer.write(now)
                        await writer.drain()
                        answered_now += 1
                        if answered_now % PIPELINE_FRAMES == 0:
                            # Frames already buffered are read without a pause:
                            # let other connections run, as a full window does.
                            await asyncio.sleep(0)
                        continue
                op = self._start(request, rest, principal, peer)
                running.add(op)
                op.add_done_callback(running.discard)
                await _queue(answers, op, answering)
            if answering is not None:
                await _queue(answers, None, answering)  # the end of the answers
                await answering  # raises what stopped the writer
        finally:
            if answering is not None:
                answering.cancel()
                # Ops already started run to their end: their copies pin pages.
                await asyncio.gather(answering, *running, return_exceptions=True)

    def _start(
        self, request: Request, rest: bytes, principal: Principal | None, peer: _Peer
    ) -> asyncio.Task[bytes]:
        """Start one op. It counts as in flight from now on, so an op that
        sees others hands its copy to a thread and a batch copies in parallel."""
        service = self.service
        service.inflight.requests += 1
        peer.unanswered += 1
        op = asyncio.create_task(self._op(request, rest, principal))

        def done(_: asyncio.Task[bytes]) -> None:  # also when cancelled before it ran
            service.inflight.requests -= 1

        op.add_done_callback(done)
        return op

    @staticmethod
    async def _answer(answers: asyncio.Queue[asyncio.Task[bytes] | None], peer: _Peer) -> None:
        """Send each op's answer in request order; a None ends the connection's answers."""
        loop = asyncio.get_running_loop()
        try:
            while (op := await answers.get()) is not None:
                peer.writer.write(await op)
                peer.unanswered -= 1
                if not peer.unanswered:
                    peer.since = loop.time()  # the idle timeout counts from the last answer
                await peer.writer.drain()
        except Exception:
            peer.writer.transport.abort()  # the reader stops too
            raise

    def _hello(self, request: Request, token: bytes) -> tuple[Principal | None, bytes]:
        auth = self.service.auth
        if auth is None:
            return None, encode_response(OP_HELLO, request.request_id)
        try:
            principal = auth.authenticate(token.decode(errors="replace"))
        except KvdError as exc:
            self.service.metrics.refused(exc.code_name, "shm_hello", str(exc))
            return None, encode_response(
                OP_HELLO, request.request_id, error_code(exc), message=str(exc)
            )
        return principal, encode_response(OP_HELLO, request.request_id)

    async def _op(self, request: Request, rest: bytes, principal: Principal | None) -> bytes:
        start = time.perf_counter()
        try:
            ref = self._ref(request, rest, principal)
            if request.op == OP_REGION_GET:
                got = await self.service.get_into_region(
                    pb.GetIntoRegionRequest(
                        region_id=ref.region_id, token=ref.token, namespace=ref.ns, items=[ref.item]
                    )
                )
                result = got.results[0]
            else:
                result = await self._put(request, ref)
        except KvdError as exc:
            return self._refused(request, exc, start)
        except BaseException:
            self._count(request, "CANCELLED", start)
            raise
        return self._answered(request, result, start)

    def _op_now(self, request: Request, rest: bytes, principal: Principal | None) -> bytes | None:
        """The answer of an op that needs no waiting (``get_now``, ``put_now``),
        else None: the op then runs as a task. Without a task and the writer's
        turn a lone get's round trip on a 2-CPU VM fell from ~280 to ~200 µs."""
        start = time.perf_counter()
        try:
            ref = self._ref(request, rest, principal)
            if request.op == OP_REGION_GET:
                result = self.service.get_now(ref.region_id, ref.token, ref.ns, ref.item)
            else:
                durable = bool(request.flags & FLAG_DURABLE)
                result = self.service.put_now(ref.region_id, ref.token, ref.ns, ref.item, durable)
        except KvdError as exc:
            return self._refused(request, exc, start)
        if result is None:
            return None
        return self._answered(request, result, start)

    def _count(self, request: Request, code: str, start: float) -> None:
        metrics = self.service.metrics
        op = _OPS[request.op]
        metrics.requests.labels(op, code).inc()
        metrics.latency.labels(op).observe(time.perf_counter() - start)

    def _refused(self, request: Request, exc: KvdError, start: float) -> bytes:
        self.service.metrics.refused(exc.code_name, _OPS[request.op], str(exc))
        self._count(request, exc.code_name, start)
        return encode_response(request.op, request.request_id, error_code(exc), message=str(exc))

    def _answered(self, request: Request, result: pb.RegionItemResult, start: float) -> bytes:
        self._count(request, "OK", start)
        flags = (FLAG_EXISTED if result.existed else 0) | (result.tier << TIER_SHIFT)
        return encode_response(
            request.op,
            request.request_id,
            result.code,
            flags=flags,
            meta=result.meta,
            message=result.message,
            length=result.size,
            checksum=result.checksum,
        )

    def _ref(self, request: Request, rest: bytes, principal: Principal | None) -> _Ref:
        """The op's region reference and item, once its namespace is authorized."""
        region_id, offset, token = REGION_REF.unpack_from(rest)
        pos = REGION_REF.size
        fields = []
        for size in (request.ns_len, request.key_len, request.parent_len, request.meta_len):
            fields.append(rest[pos : pos + size])
            pos += size
        try:
            ns = fields[0].decode()
        except UnicodeDecodeError:
            raise InvalidArgument("namespace is not UTF-8") from None
        auth = self.service.auth
        if auth is not None:
            assert principal is not None, "HELLO authenticated the connection"
            auth.authorize(principal, ns, admin=False)
        item = pb.RegionItem(key=fields[1], offset=offset, length=request.length)
        if request.op == OP_REGION_PUT:
            item.parent, item.meta = fields[2], fields[3]
            if request.flags & FLAG_CHECKSUM:
                item.checksum = request.checksum
        return _Ref(region_id, token, ns, item)

    async def _put(self, request: Request, ref: _Ref) -> pb.RegionItemResult:
        put = await self.service.put_from_region(
            pb.PutFromRegionRequest(
                region_id=ref.region_id,
                token=ref.token,
                namespace=ref.ns,
                durable=bool(request.flags & FLAG_DURABLE),
                items=[ref.item],
            )
        )
        return put.results[0]


@dataclass(frozen=True)
class _Ref:
    region_id: int
    token: bytes
    ns: str
    item: pb.RegionItem


async def _queue(queue: asyncio.Queue[T], item: T, consumer: asyncio.Task[None]) -> bool:
    """Put ``item``, waiting for room while ``consumer`` runs; False if it stopped first."""
    if not queue.full():
        queue.put_nowait(item)
        return True
    put = asyncio.ensure_future(queue.put(item))
    await asyncio.wait({put, consumer}, return_when=asyncio.FIRST_COMPLETED)
    if put.done():
        return True
    put.cancel()
    return False


def _claim(path: str) -> None:
    """Remove a stale socket file; refuse one that another daemon still serves."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left by a daemon that died
        return
    finally:
        probe.close()
    raise OSError(f"{path} is served by another process")


# ---- client ---------------------------------------------------------------------------
class RegionOps:
    """``GetIntoRegion``/``PutFromRegion`` batches over the shm socket: each batch on
    one connection (the daemon runs its frames concurrently; spreading it over
    connections only added client threads), the pool's others for other threads."""

    def __init__(self, path: str, token: str | None, timeout_s: float, connections: int = 2):
        self.client = BulkClient(path, 0, token=token, connections=connections, timeout_s=timeout_s)

    def close(self) -> None:
        self.client.close()

    def get_into_region(self, request: pb.GetIntoRegionRequest) -> pb.RegionBatchResponse:
        ns = request.namespace.encode()
        frames = [
            _with_ref(
                encode_request(OP_REGION_GET, i, ns, item.key, length=item.length),
                REGION_REF.pack(request.region_id, item.offset, request.token),
            )
            for i, item in enumerate(request.items)
        ]
        return self._exchange(frames)

    def get_one(
        self, region_id: int, token: bytes, ns: str, key: bytes, offset: int, room: int
    ) -> pb.RegionItemResult:
        """One get into a region: ``get_into_region`` of one item, with one frame."""
        frame = _with_ref(
            encode_request(OP_REGION_GET, 0, ns.encode(), key, length=room),
            REGION_REF.pack(region_id, offset, token),
        )
        return _result(self.client.with_connection(lambda conn: _exchange_one(conn, frame)))

    def put_from_region(self, request: pb.PutFromRegionRequest) -> pb.RegionBatchResponse:
        ns = request.namespace.encode()
        frames = []
        previous = b""
        for i, item in enumerate(request.items):
            parent = item.parent or (previous if request.chained else b"")
            previous = item.key
            frames.append(
                _with_ref(
                    encode_request(
                        OP_REGION_PUT,
                        i,
                        ns,
                        item.key,
                        parent=parent,
                        meta=item.meta,
                        length=item.length,
                        checksum=item.checksum if item.HasField("checksum") else None,
                        durable=request.durable,
                    ),
                    REGION_REF.pack(request.region_id, item.offset, request.token),
                )
            )
        return self._exchange(frames)

    def _exchange(self, frames: list[bytes]) -> pb.RegionBatchResponse:
        answers: list[Answer | None] = [None] * len(frames)
        self.client.with_connection(lambda conn: _window(conn, frames, 0, len(frames), answers))
        results = []
        for answer in answers:
            assert answer is not None, "every frame was answered"
            results.append(_result(answer))
        return pb.RegionBatchResponse(results=results)


def _result(answer: Answer) -> pb.RegionItemResult:
    return pb.RegionItemResult(
        code=answer.code,
        message=answer.message,
        size=answer.length,
        checksum=answer.checksum,
        existed=bool(answer.flags & FLAG_EXISTED),
        meta=answer.meta,
        tier=answer.flags >> TIER_SHIFT,  # type: ignore[arg-type]
    )


def _exchange_one(conn: Connection, frame: bytes) -> Answer:
    conn.send([memoryview(frame)])
    answer = conn.answer()
    if answer.request_id != 0:
        raise ConnectionError(f"answer {answer.request_id} to request 0: out of order")
    return answer


def _with_ref(frame: bytes, ref: bytes) -> bytes:
    """The region reference goes right after the 40-byte header, before the names."""
    return frame[: REQUEST.size] + ref + frame[REQUEST.size :]


def _window(
    conn: Connection, frames: Sequence[bytes], start: int, end: int, out: list[Answer | None]
) -> None:
    sent = start
    for done in range(start, end):
        if sent < end and sent - done < PIPELINE_FRAMES:
            # A window in one send: the daemon reads the frames together and
            # starts their ops at once, so their copies run in parallel.
            top = min(end, done + PIPELINE_FRAMES)
            conn.send([memoryview(frame) for frame in frames[sent:top]])
            sent = top
        answer = conn.answer()
        if answer.request_id != done:
            raise ConnectionError(f"answer {answer.request_id} to request {done}: out of order")
        out[done] = answer
