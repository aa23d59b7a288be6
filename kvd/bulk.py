"""Bulk TCP data port: values stream between sockets and pool pages.

The frame format is docs/bulk-protocol.md; this module holds its codec
(shared with ``kvd.bulk_client``) and the server. Per connection, a reader
task parses requests in order and a writer task sends the answers in the
same order, so a client may pipeline many requests on one connection.

- PUT: ``recv_into`` straight into the ticket's pool pages, hashing each
  piece as it lands (cache-hot); published only once the whole payload
  arrived and matches the checksum sent with it. A connection that dies or
  times out half-way aborts the ticket: nothing partial becomes visible.
- GET: the reader pins the value (``store.fetch``) and queues it; the writer
  sends header and pool pages with one ``sendmsg`` (then ``sock_sendall`` for
  what the socket did not take), or from a send thread while another
  connection is sending on a machine with cores to spare
  (``kvd.bulk_send``), and unpins once the last byte
  left. An answer that cannot leave within ``bulk_frame_timeout_ms`` (a
  client that stopped reading) closes the connection. An answer of up to
  ``DIRECT_ANSWER_BYTES`` with nothing queued or being sent before it is
  sent by the reader itself: on a 2-CPU VM the writer's turn cost a lone
  64 KiB get 40-80 µs of a 180-260 µs round trip (A/B runs).
- Backpressure: a connection may have ``bulk_inflight_bytes`` of GET payload
  and ``QUEUE_FRAMES_MAX`` answers queued; past that its reader stops reading
  the socket, and TCP flow control slows the client down.
- Auth: with a token table, the HELLO frame's payload is the bearer token;
  a connection whose token is unknown is answered UNAUTHENTICATED and
  closed, and each PUT/GET on a namespace the token does not name is
  answered PERMISSION_DENIED. The token is checked once per connection.
- Bad input (wrong magic or version, a field over its limit, a frame that
  does not complete within ``bulk_frame_timeout_ms``, EOF inside a frame)
  closes the connection with a logged reason. Expected failures of one
  request (a miss, a full pool, a conflicting put) are answered with a code
  and the connection stays open.

This module imports neither grpc nor the gRPC service.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.aio import settle
from kvd.bulk_send import Sender
from kvd.checksum import Hasher
from kvd.errors import DataLoss, KvdError
from kvd.index import (
    KEY_BYTES_MAX,
    META_BYTES_MAX,
    NAMESPACE_BYTES_MAX,
    TIER_NAMES,
    PutResult,
    Reader,
)

if TYPE_CHECKING:
    from kvd.auth import Authenticator, Principal
    from kvd.metrics import Metrics
    from kvd.store import Store

log = logging.getLogger("kvd.bulk")

# ---- codec --------------------------------------------------------------------------
VERSION = 1
REQUEST_MAGIC = b"KVDQ"
RESPONSE_MAGIC = b"KVDR"
# magic, version, op, flags, request_id, ns_len, key_len, parent_len, meta_len, length, checksum
REQUEST = struct.Struct("<4sBBHQHHHHQQ")
# magic, version, op, flags, request_id, code, meta_len, msg_len, length, checksum
RESPONSE = struct.Struct("<4sBBHQiHHQQ")
assert REQUEST.size == 40 and RESPONSE.size == 40

OP_HELLO = 1
OP_PUT = 2
OP_GET = 3
OPS = frozenset({OP_HELLO, OP_PUT, OP_GET})
# Region ops: only on the shm socket (kvd.shm_channel), never on the TCP port.
OP_REGION_GET = 4
OP_REGION_PUT = 5

FLAG_DURABLE = 1  # request: acknowledge a put once it is on L2
FLAG_CHECKSUM = 2  # request: the checksum field is set; verify the payload against it
FLAG_EXISTED = 1  # response: the put's key already held these bytes

TOKEN_BYTES_MAX = 4096
MESSAGE_BYTES_MAX = 1024
# Codes, as gRPC numbers them (the gRPC path reports the same ones).
CODE_OK = 0
CODE_NOT_FOUND = 5
CODE_RESOURCE_EXHAUSTED = 8
CODE_INTERNAL = 13
CODE_BY_NAME = {
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
NAME_BY_CODE = {code: name for name, code in CODE_BY_NAME.items()}

# Answers queued per connection before its reader pauses: 1024 × 40 bytes of
# put acknowledgements, or as many pinned gets as bulk_inflight_bytes allows.
QUEUE_FRAMES_MAX = 1024
# Answers up to this size skip the queue when nothing is ahead of them. Larger
# ones go through the writer, so that the reader meanwhile starts the next
# pipelined get (an L2 read) and a big send may go to a send thread.
DIRECT_ANSWER_BYTES = 1 << 20
# Requests one connection serves before letting the others run: buffered
# frames are read and answered without the reader ever waiting.
FAIR_SHARE_REQUESTS = 16
# A failed accept (no descriptor or memory left) is tried again after this.
ACCEPT_RETRY_S = 0.1
# Payload of a request answered with an error is read into this and dropped.
_DISCARD_BYTES = 1 << 20


class ProtocolError(Exception):
    """The peer broke the framing; the connection is closed with this reason."""


@dataclass(frozen=True, slots=True)
class Request:
    op: int
    flags: int
    request_id: int
    ns_len: int
    key_len: int
    parent_len: int
    meta_len: int
    length: int
    checksum: int

    @property
    def tail_bytes(self) -> int:
        return self.ns_len + self.key_len + self.parent_len + self.meta_len


def encode_request(
    op: int,
    request_id: int,
    ns: bytes = b"",
    key: bytes = b"",
    *,
    parent: bytes = b"",
    meta: bytes = b"",
    length: int = 0,
    checksum: int | None = None,
    durable: bool = False,
) -> bytes:
    """Header and the variable fields; the payload (``length`` bytes) follows."""
    flags = (FLAG_DURABLE if durable else 0) | (FLAG_CHECKSUM if checksum is not None else 0)
    fields = (ns, key, parent, meta)
    head = (REQUEST_MAGIC, VERSION, op, flags, request_id, *map(len, fields))
    return b"".join((REQUEST.pack(*head, length, checksum or 0), *fields))


def decode_request(
    data: bytes | bytearray | memoryview, max_value_bytes: int, ops: frozenset[int] = OPS
) -> Request:
    magic, version, op, flags, rid, ns_len, key_len, parent_len, meta_len, length, checksum = (
        REQUEST.unpack(data)
    )
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this daemon speaks {VERSION}")
    if op not in ops:
        raise ProtocolError(f"unknown op {op}")
    if ns_len > NAMESPACE_BYTES_MAX or key_len > KEY_BYTES_MAX or parent_len > KEY_BYTES_MAX:
        raise ProtocolError("namespace, key or parent longer than its limit")
    if meta_len > META_BYTES_MAX:
        raise ProtocolError(f"meta of {meta_len} bytes is over {META_BYTES_MAX}")
    if op in (OP_PUT, OP_REGION_PUT) and length > max_value_bytes:
        raise ProtocolError(f"value of {length} bytes is over max_value_bytes={max_value_bytes}")
    if op == OP_HELLO and length > TOKEN_BYTES_MAX:
        raise ProtocolError(f"hello token of {length} bytes is over {TOKEN_BYTES_MAX}")
    return Request(op, flags, rid, ns_len, key_len, parent_len, meta_len, length, checksum)


def encode_response(
    op: int,
    request_id: int,
    code: int = CODE_OK,
    *,
    flags: int = 0,
    meta: bytes = b"",
    message: str = "",
    length: int = 0,
    checksum: int = 0,
) -> bytes:
    text = message.encode()[:MESSAGE_BYTES_MAX]
    header = RESPONSE.pack(
        RESPONSE_MAGIC, VERSION, op, flags, request_id, code, len(meta), len(text), length, checksum
    )
    return b"".join((header, meta, text))


def error_code(exc: KvdError) -> int:
    return CODE_BY_NAME.get(exc.code_name, CODE_BY_NAME["UNKNOWN"])


# ---- socket helpers (non-blocking sockets on the event loop) -----------------------------
async def recv_into_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, hasher: Hasher | None
) -> None:
    """Fill ``view``; EOF first is a ProtocolError (a truncated frame)."""
    pos, size = 0, len(view)
    while pos < size:
        try:
            n = sock.recv_into(view[pos:])
        except BlockingIOError:
            n = await loop.sock_recv_into(sock, view[pos:])
        if n == 0:
            raise ProtocolError(f"connection ended inside a frame ({pos} of {size} bytes)")
        if hasher is not None:
            hasher.update(view[pos : pos + n])
        pos += n


@dataclass(frozen=True)
class BulkLimits:
    max_connections: int = 256
    inflight_bytes: int = 64 << 20
    frame_timeout_s: float = 30.0
    idle_timeout_s: float = 600.0


class _Connection:
    """One client connection: reader and writer tasks, in-order answers."""

    def __init__(self, server: BulkServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.store = server.store
        self.sock = sock
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[bytes, Reader | None]] = asyncio.Queue(QUEUE_FRAMES_MAX)
        self.queued_bytes = 0
        self.drained = asyncio.Event()
        self.header = bytearray(REQUEST.size)
        self.discard = bytearray(0)
        self.token = b""
        self.principal: Principal | None = None
        self.writing = False  # the writer is sending an answer

    async def serve(self) -> None:
        writer = asyncio.create_task(self._write_loop())
        reader = asyncio.create_task(self._read_loop())
        reason = ""
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if isinstance(exc, ProtocolError | TimeoutError | OSError):
                    reason = f"{type(exc).__name__}: {exc}"
                elif exc is not None:
                    raise exc
            if reader in done and not reason:
                await self.queue.put((b"", None))  # clean EOF: flush answers, then close
                await asyncio.wait_for(writer, self.server.limits.frame_timeout_s)
        except (ProtocolError, TimeoutError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            for task in (reader, writer):
                task.cancel()
            # Both end before this task does (then _end runs), even if stop() cancels it here.
            await settle([reader, writer])
        if reason:
            log.warning("bulk connection closed", extra={"peer": self.peer, "reason": reason})

    def _end(self, _task: asyncio.Task[None]) -> None:
        """Once the connection's task ended, however (even cancelled before it ran)."""
        while not self.queue.empty():
            _, reader = self.queue.get_nowait()
            if reader is not None:
                reader.close()
        self.sock.close()

    # ---- reading ---------------------------------------------------------------------
    async def _read_loop(self) -> None:
        limits = self.server.limits
        hello = await self._next_request(limits.frame_timeout_s)
        if hello is None:
            return
        if hello[0].op != OP_HELLO:
            raise ProtocolError("the first frame must be HELLO")
        if not await self._hello(hello[0]):
            return  # refused: the answer is flushed, then the connection closes
        for served in itertools.count(1):
            if served % FAIR_SHARE_REQUESTS == 0:
                await asyncio.sleep(0)  # buffered requests never wait: let others run
            got = await self._next_request(limits.idle_timeout_s)
            if got is None:
                return
            request, tail = got
            if request.op == OP_PUT:
                async with asyncio.timeout(limits.frame_timeout_s):
                    answer = await self._put(request, tail)
                await self._answer(answer)
            elif request.op == OP_GET:
                await self._get(request, tail)
            else:
                raise ProtocolError("HELLO sent twice")

    async def _next_request(self, wait_s: float) -> tuple[Request, bytes] | None:
        """The next header and its variable fields; None on EOF between frames."""
        view = memoryview(self.header)
        try:
            first = self.sock.recv_into(view)
        except BlockingIOError:
            first = await asyncio.wait_for(self.loop.sock_recv_into(self.sock, view), wait_s)
        if first == 0:
            return None
        async with asyncio.timeout(self.server.limits.frame_timeout_s):
            await recv_into_exact(self.loop, self.sock, view[first:], None)
            request = decode_request(self.header, self.store.limits.max_value_bytes)
            tail = bytearray(request.tail_bytes)
            await recv_into_exact(self.loop, self.sock, memoryview(tail), None)
            if request.op == OP_HELLO:
                token = bytearray(request.length)
                await recv_into_exact(self.loop, self.sock, memoryview(token), None)
                self.token = bytes(token)
        return request, bytes(tail)

    async def _hello(self, request: Request) -> bool:
        """Answer HELLO; with auth, only a known token gets CODE_OK (and the connection)."""
        token, self.token = self.token, b""
        auth = self.server.auth
        if auth is not None:
            try:
                try:
                    text = token.decode()
                except UnicodeDecodeError:
                    text = ""
                self.principal = auth.authenticate(text)
            except KvdError as exc:
                self.server.metrics.refused(exc.code_name, "bulk_hello", str(exc))
                answer = encode_response(
                    OP_HELLO, request.request_id, error_code(exc), message=str(exc)
                )
                await self._answer(answer)
                return False
        await self._answer(encode_response(OP_HELLO, request.request_id))
        return True

    def _authorize(self, namespace: str) -> None:
        auth = self.server.auth
        if auth is not None:
            assert self.principal is not None, "HELLO authenticates before any request"
            auth.authorize(self.principal, namespace, admin=False)

    async def _put(self, request: Request, tail: bytes) -> bytes:
        ns, key, parent, meta = _split_tail(request, tail)
        checksum = request.checksum if request.flags & FLAG_CHECKSUM else None
        try:
            self._authorize(ns)
            ticket = await self.store.begin_put(
                ns, key, request.length, meta, parent or None, checksum
            )
        except KvdError as exc:
            self.server.metrics.refused(exc.code_name, "bulk_put", str(exc))
            await self._discard(request.length)
            return encode_response(OP_PUT, request.request_id, error_code(exc), message=str(exc))
        if isinstance(ticket, PutResult):
            await self._discard(request.length)
            return encode_response(
                OP_PUT, request.request_id, flags=FLAG_EXISTED, checksum=ticket.checksum
            )
        try:
            hasher = Hasher()
            for view in ticket.views:
                await recv_into_exact(self.loop, self.sock, view, hasher)
            try:
                result = await self.store.publish(
                    ticket, hasher.value(), bool(request.flags & FLAG_DURABLE)
                )
            except KvdError as exc:
                if isinstance(exc, DataLoss):
                    self.server.metrics.rejected.labels("checksum").inc()
                return encode_response(
                    OP_PUT, request.request_id, error_code(exc), message=str(exc)
                )
        finally:
            self.store.abort_put(ticket)
        self.server.metrics.bytes.labels("bulk_put", "in").inc(request.length)
        flags = FLAG_EXISTED if result.existed else 0
        return encode_response(OP_PUT, request.request_id, flags=flags, checksum=result.checksum)

    async def _discard(self, nbytes: int) -> None:
        if not self.discard:
            self.discard = bytearray(min(nbytes, _DISCARD_BYTES))
        view = memoryview(self.discard)
        while nbytes:
            take = min(nbytes, len(view))
            await recv_into_exact(self.loop, self.sock, view[:take], None)
            nbytes -= take

    async def _get(self, request: Request, tail: bytes) -> None:
        ns, key, _, _ = _split_tail(request, tail)
        rid = request.request_id
        try:
            self._authorize(ns)
            start = time.perf_counter()
            reader = await self.store.fetch(ns, key)
            self.server.metrics.fetched(
                "bulk_get", TIER_NAMES[reader.tier] if reader else "miss", start
            )
        except KvdError as exc:
            self.server.metrics.refused(exc.code_name, "bulk_get", str(exc))
            await self._answer(encode_response(OP_GET, rid, error_code(exc), message=str(exc)))
            return
        if reader is None:
            self.server.metrics.misses.labels("bulk_get").inc()
            await self._answer(encode_response(OP_GET, rid, CODE_NOT_FOUND))
            return
        try:
            if request.length and reader.size > request.length:
                answer = encode_response(
                    OP_GET,
                    rid,
                    CODE_RESOURCE_EXHAUSTED,
                    message=f"value of {reader.size} bytes, room for {request.length}",
                    length=reader.size,
                )
                await self._answer(answer)
                return
            limit = self.server.limits.inflight_bytes
            while self.queued_bytes and self.queued_bytes + reader.size > limit:
                self.drained.clear()
                await self.drained.wait()
            header = encode_response(
                OP_GET, rid, meta=reader.meta, length=reader.size, checksum=reader.checksum
            )
            pinned, reader = reader, None  # _answer closes it
            await self._answer(header, pinned)
        finally:
            if reader is not None:
                reader.close()

    async def _answer(self, header: bytes, reader: Reader | None = None) -> None:
        """Send an answer (and the value ``reader`` pins, closed once sent) after
        every earlier one: now, if none waits and it is small, else through the queue."""
        size = reader.size if reader is not None else 0
        if self.queue.empty() and not self.writing and size <= DIRECT_ANSWER_BYTES:
            await self._send(header, reader)
            return
        self.queued_bytes += size
        try:
            await self.queue.put((header, reader))
        except BaseException:  # cancelled while the queue was full: unpin here
            self.queued_bytes -= size
            if reader is not None:
                reader.close()
            raise

    # ---- writing ---------------------------------------------------------------------
    async def _write_loop(self) -> None:
        while True:
            self.writing = False
            header, reader = await self.queue.get()
            if not header:
                return
            self.writing = True
            try:
                await self._send(header, reader)
            finally:
                if reader is not None:
                    self.queued_bytes -= reader.size
                    self.drained.set()

    async def _send(self, header: bytes, reader: Reader | None) -> None:
        try:
            parts = [memoryview(header)]
            if reader is not None:
                parts.extend(reader.views)
            size = reader.size if reader is not None else 0
            await self.server.sender.send(self.sock, parts, len(header) + size)
        finally:
            if reader is not None:
                reader.close()
                metrics = self.server.metrics
                metrics.hits.labels("bulk_get", "l1").inc()
                metrics.bytes.labels("bulk_get", "out").inc(reader.size)


def _split_tail(request: Request, tail: bytes) -> tuple[str, bytes, bytes, bytes]:
    """(namespace, key, parent, meta) from a request's variable fields."""
    a = request.ns_len
    b = a + request.key_len
    c = b + request.parent_len
    try:
        ns = tail[:a].decode()
    except UnicodeDecodeError:
        raise ProtocolError("namespace is not UTF-8") from None
    return ns, tail[a:b], tail[b:c], tail[c:]


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = asyncio.Event()
    loop.add_reader(sock, ready.set)
    try:
        await ready.wait()
    finally:
        loop.remove_reader(sock)


class BulkServer:
    """The listener and its connections."""

    def __init__(
        self,
        store: Store,
        limits: BulkLimits,
        metrics: Metrics,
        auth: Authenticator | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.auth = auth
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.sender = Sender(limits.frame_timeout_s)
        self.port = 0

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def start(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_task = asyncio.create_task(self._accept_loop(listener))
        return self.port

    async def _accept_loop(self, listener: socket.socket) -> None:
        # Not loop.sock_accept: cancelled (stop()) as a client connects, it can drop the socket.
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0)  # after a stall, the backlog's dead connections end meanwhile
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                await _readable(loop, listener)
                continue
            except OSError as exc:  # out of descriptors or memory: keep the port, retry
                log.warning("bulk accept failed", extra={"reason": str(exc)})
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            peer = f"{address[0]}:{address[1]}"
            if len(self._connections) >= self.limits.max_connections:
                sock.close()
                log.warning(
                    "bulk connection refused",
                    extra={"peer": peer, "reason": f"{self.limits.max_connections} connections"},
                )
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(self, sock, peer)
            task = asyncio.create_task(connection.serve())
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
            task.add_done_callback(connection._end)

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        self.sender.close()
