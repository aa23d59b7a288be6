"""Bulk TCP data port: values stream between sockets and pool pages.

The frame format is docs/bulk-protocol.md, its codec ``kvd.wire.bulk``
(shared with ``kvd.client.bulk``); this module is the server. Per connection, a reader
task parses requests in order and a writer task sends the answers in the
same order, so a client may pipeline many requests on one connection.

- PUT: ``recv_into`` straight into the ticket's pool pages, hashing each
  piece as it lands (cache-hot); published only once the whole payload
  arrived and matches the checksum sent with it. A connection that dies or
  times out half-way aborts the ticket: nothing partial becomes visible.
  A payload already all in the socket's receive queue gets its pages at
  once; any other takes pages only for the bytes that arrived
  (``kvd.store.uploads``, ``kvd.paths.bulk.receive``), so a sender that
  declares 64 MiB and stalls holds what it sent, not what it declared.
- Admission (``kvd.paths.bulk.admission``): caps per peer address and on
  connections without HELLO, which have ``bulk_hello_timeout_ms`` to send it.
- TLS (``bulk_tls``): every connection's bytes go through its TLS session
  (``kvd.wire.tls_socket``), whose handshake is part of the time to HELLO;
  with ``tls_client_ca_file`` the client's certificate is required. A
  handshake that fails is counted as an unauthenticated refusal, logged,
  and closes the connection; a connection refused at admission is closed
  before the handshake.
- GET: the reader pins a value in L1 and queues it; a value elsewhere (L2,
  a pool member) with more frames behind it is read by a task queued in its
  answer's place while the reader goes on (``kvd.paths.bulk.fetches``). The
  writer sends header and pool pages with one ``sendmsg`` (the rest with
  ``sock_sendall``), or from a send thread while another connection sends
  on a machine with cores to spare (``kvd.wire.send``), and unpins once the
  last byte left; one that cannot leave within ``bulk_frame_timeout_ms``
  closes the connection. An answer of up to ``DIRECT_ANSWER_BYTES`` with
  nothing ahead of it is sent by the reader itself (on a 2-CPU VM the
  writer's turn cost a lone 64 KiB get 40-80 µs of a 180-260 µs round trip).
- Backpressure: a connection may have ``bulk_inflight_bytes`` of GET payload
  queued, ``FETCHES_MAX`` values being read or unsent, ``QUEUE_FRAMES_MAX`` answers
  queued; past that its reader stops reading, and TCP slows the client down.
- Auth: with a token table, the HELLO frame's payload is the bearer token;
  a connection whose token is unknown is answered UNAUTHENTICATED and
  closed, and each PUT/GET on a namespace the token does not name is
  answered PERMISSION_DENIED. The token is checked once per connection.
- Pool peers: a GET with ``FLAG_HOP`` (``kvd.cluster.peer_bulk``) is answered
  from this daemon alone, and a PUT with it is kept here (a put handed on to
  its owner); the other peer ops are ``kvd.paths.bulk.peer_ops``.
- Bad input (wrong magic or version, a field over its limit, a frame that
  does not complete within ``bulk_frame_timeout_ms``, EOF inside a frame)
  closes the connection with a logged reason. Expected failures of one
  request (a miss, a full pool, a conflicting put) are answered with a code
  and the connection stays open.

Store reads and writes and their counts are the op layer's ``ValueOps``
(``kvd.paths.ops.values``), refusals its ``refused`` (``kvd.paths.ops.calls``),
as on the other transports. Bulk requests count no ``kvd_requests``.

This module imports neither grpc nor the gRPC service.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd.cluster import scope
from kvd.paths.bulk.admission import Admission, Slot
from kvd.paths.bulk.fetches import Answer, Fetches, get_answer
from kvd.paths.bulk.limits import BulkLimits
from kvd.paths.bulk.peer_ops import PeerOps
from kvd.paths.bulk.receive import buffered, discard, receive_upload, recv_into_exact
from kvd.paths.ops.calls import refused
from kvd.store.index import TIER_NAMES, PutResult, Reader
from kvd.util.aio import readable, settle
from kvd.wire.bulk import (
    CODE_BY_NAME,
    CODE_INTERNAL,
    CODE_NOT_FOUND,
    CODE_OK,
    CODE_RESOURCE_EXHAUSTED,
    FLAG_CHECKSUM,
    FLAG_DURABLE,
    FLAG_EXISTED,
    FLAG_HOP,
    FLAG_KEEP,
    MESSAGE_BYTES_MAX,
    NAME_BY_CODE,
    OP_GET,
    OP_HELLO,
    OP_PEER_EXISTS,
    OP_PEER_TELL,
    OP_PUT,
    OP_REGION_GET,
    OP_REGION_PUT,
    OPS,
    PEER_OPS,
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    TCP_OPS,
    TOKEN_BYTES_MAX,
    VERSION,
    ProtocolError,
    Request,
    decode_request,
    encode_request,
    encode_response,
    error_code,
    exists_payload_bytes_max,
    split_tail,
    tell_payload_bytes_max,
)
from kvd.wire.checksum import Hasher
from kvd.wire.errors import DataLoss, KvdError, error_number
from kvd.wire.send import Sender
from kvd.wire.tls_socket import TlsSocket, Wire, handshake, recv_some

if TYPE_CHECKING:
    from kvd.cluster.nixl_node import NixlNode
    from kvd.paths.auth import Authenticator, Principal
    from kvd.paths.ops.values import ValueOps

__all__ = [  # the codec's names (kvd.wire.bulk) stay importable from here
    "CODE_BY_NAME", "CODE_INTERNAL", "CODE_NOT_FOUND", "CODE_OK", "CODE_RESOURCE_EXHAUSTED",
    "FLAG_CHECKSUM", "FLAG_DURABLE", "FLAG_EXISTED", "MESSAGE_BYTES_MAX", "NAME_BY_CODE",
    "OPS", "OP_GET", "OP_HELLO", "OP_PUT", "OP_REGION_GET", "OP_REGION_PUT", "REQUEST",
    "REQUEST_MAGIC", "RESPONSE", "RESPONSE_MAGIC", "TOKEN_BYTES_MAX", "VERSION",
    "BulkLimits", "BulkServer", "ProtocolError", "Request", "decode_request",
    "encode_request", "encode_response", "error_code", "recv_into_exact",
]  # fmt: skip

log = logging.getLogger("kvd.paths.bulk.server")

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


class _Connection:
    """One client connection: reader and writer tasks, in-order answers."""

    def __init__(self, server: BulkServer, sock: Wire, peer: str) -> None:
        self.slot: Slot | None = None
        self.task: asyncio.Task[None] | None = None
        self.server = server
        self.values = server.values
        self.sock = sock
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Answer | asyncio.Task[Answer]] = asyncio.Queue(QUEUE_FRAMES_MAX)
        self.fetches = Fetches()
        self.queued_bytes = 0
        self.drained = asyncio.Event()
        self.header = bytearray(REQUEST.size)
        self.discard = bytearray(0)
        self.token = b""
        self.principal: Principal | None = None
        self.writing = False  # the writer is sending an answer
        self.peer_ops = PeerOps(server.values, server.nixl, server.pool_token, self._authorize,
                                self._answer)  # fmt: skip

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

    def push_out(self) -> None:
        """Closed to admit a newer connection (this one has not sent its HELLO)."""
        if self.task is not None:
            self.task.cancel()
        log.warning(
            "bulk connection closed",
            extra={
                "peer": self.peer,
                "reason": "no HELLO yet, "
                "pushed out by a newer connection (bulk_max_unauthenticated)",
            },
        )

    def _end(self, _task: asyncio.Task[None]) -> None:
        """Once the connection's task ended, however (even cancelled before it ran)."""
        self.peer_ops.close()
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if not isinstance(item, asyncio.Task) and item[1] is not None:
                item[1].close()
        self.fetches.close()
        if self.slot is not None:
            self.server.admission.release(self.slot)
        self.sock.close()

    # ---- reading ---------------------------------------------------------------------
    async def _read_loop(self) -> None:
        limits = self.server.limits
        try:
            async with asyncio.timeout(limits.hello_timeout_s):
                if isinstance(self.sock, TlsSocket):
                    try:
                        await handshake(self.loop, self.sock)
                    except ssl.SSLError:  # not TLS, or a certificate refused
                        self.server.metrics.rejected.labels("unauthenticated").inc()
                        raise
                hello = await self._next_request(limits.hello_timeout_s)
        except TimeoutError:
            raise ProtocolError(f"no HELLO within {limits.hello_timeout_s:g} s") from None
        if hello is None:
            return
        if hello[0].op != OP_HELLO:
            raise ProtocolError("the first frame must be HELLO")
        if not await self._hello(hello[0]):
            return  # refused: the answer is flushed, then the connection closes
        if self.slot is not None:
            self.server.admission.authenticated(self.slot)
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
                if answer:
                    await self._answer(answer)
            elif request.op == OP_GET:
                await self._get(request, tail)
            elif request.op in PEER_OPS:
                payload = await self._peer_payload(request)
                await self.peer_ops.handle(request, tail, payload)
            else:
                raise ProtocolError("HELLO sent twice")

    async def _next_request(self, wait_s: float) -> tuple[Request, bytes] | None:
        """The next header and its variable fields; None on EOF between frames."""
        view = memoryview(self.header)
        try:
            first = self.sock.recv_into(view)
        except BlockingIOError:
            first = await asyncio.wait_for(recv_some(self.loop, self.sock, view), wait_s)
        if first == 0:
            return None
        async with asyncio.timeout(self.server.limits.frame_timeout_s):
            await recv_into_exact(self.loop, self.sock, view[first:], None)
            max_value_bytes = self.values.store.limits.max_value_bytes
            request = decode_request(self.header, max_value_bytes, TCP_OPS)
            tail = bytearray(request.tail_bytes)
            await recv_into_exact(self.loop, self.sock, memoryview(tail), None)
            if request.op == OP_HELLO:
                token = bytearray(request.length)
                await recv_into_exact(self.loop, self.sock, memoryview(token), None)
                self.token = bytes(token)
        return request, bytes(tail)

    async def _peer_payload(self, request: Request) -> bytes:
        """A peer op's payload: a PEER_EXISTS's or PEER_TELL's keys (bounded
        by max_lookup_keys: past it the connection closes before they are
        read); the other peer ops have none."""
        if request.op not in (OP_PEER_EXISTS, OP_PEER_TELL) or not request.length:
            return b""
        max_keys = self.values.store.limits.max_lookup_keys
        if request.op == OP_PEER_EXISTS:
            what, limit = "an exists", exists_payload_bytes_max(max_keys)
        else:
            what, limit = "a tell", tell_payload_bytes_max(max_keys)
        if request.length > limit:
            raise ProtocolError(f"{what} payload of {request.length} bytes, over {limit}")
        payload = bytearray(request.length)
        async with asyncio.timeout(self.server.limits.frame_timeout_s):
            await recv_into_exact(self.loop, self.sock, memoryview(payload), None)
        return bytes(payload)

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
                self.peer_ops.pool_peer = self.peer_ops.is_pool_token(token)
            except KvdError as exc:
                code = refused(self.server.metrics, "bulk_hello", exc)
                answer = encode_response(OP_HELLO, request.request_id, code, message=str(exc))
                await self._answer(answer)
                return False
        await self._answer(encode_response(OP_HELLO, request.request_id))
        return True

    def _authorize(self, namespace: str) -> None:
        auth = self.server.auth
        if auth is not None:
            assert self.principal is not None, "HELLO authenticates before any request"
            auth.authorize(self.principal, namespace, admin=False)

    async def _put(self, request: Request, tail: bytes) -> bytes | None:
        """The answer to a PUT; None where it was sent before the payload was
        dropped (refused: the client learns it without waiting for its send)."""
        ns, key, parent, meta = split_tail(request, tail)
        checksum = request.checksum if request.flags & FLAG_CHECKSUM else None
        values, durable = self.values, bool(request.flags & FLAG_DURABLE)
        try:
            self._authorize(ns)
            if buffered(self.sock) >= request.length:  # all arrived: pages at once, no extra turn
                begin = values.begin_put
            else:
                begin = values.begin_upload
            ticket = await begin(ns, key, request.length, meta, parent or None, checksum, durable)
        except KvdError as exc:
            code = refused(self.server.metrics, "bulk_put", exc)
            await self._answer(encode_response(OP_PUT, request.request_id, code, message=str(exc)))
            await self._discard(request.length)
            return None
        if isinstance(ticket, PutResult):
            await self._discard(request.length)
            return encode_response(
                OP_PUT, request.request_id, flags=FLAG_EXISTED, checksum=ticket.checksum
            )
        try:
            hasher = Hasher()
            if ticket.upload:
                try:
                    await receive_upload(self.loop, self.sock, ticket, hasher, self.values.grow)
                except KvdError as exc:  # no room for what arrived: drop the rest
                    code = refused(self.server.metrics, "bulk_put", exc)
                    await self._answer(
                        encode_response(OP_PUT, request.request_id, code, message=str(exc))
                    )
                    await self._discard(request.length - ticket.covered_bytes)
                    return None
            else:
                for view in ticket.views:
                    await recv_into_exact(self.loop, self.sock, view, hasher)
            flags = request.flags  # KEEP: from a member leaving, this daemon's own
            hop = (
                scope.as_hop(bool(flags & FLAG_KEEP))
                if flags & FLAG_HOP
                else contextlib.nullcontext()
            )
            try:
                with hop:  # a put a pool member handed on: kept here, never handed on
                    result = await values.publish("bulk_put", ticket, hasher.value(), durable)
            except KvdError as exc:
                if isinstance(exc, DataLoss):
                    values.metrics.rejected.labels("checksum").inc()
                return encode_response(
                    OP_PUT, request.request_id, error_number(exc), message=str(exc)
                )
        finally:
            values.abort(ticket)
        flags = FLAG_EXISTED if result.existed else 0
        return encode_response(OP_PUT, request.request_id, flags=flags, checksum=result.checksum)

    async def _discard(self, nbytes: int) -> None:
        self.discard = await discard(self.loop, self.sock, nbytes, self.discard)

    async def _get(self, request: Request, tail: bytes) -> None:
        ns, key, _, _ = split_tail(request, tail)
        try:
            self._authorize(ns)
        except KvdError as exc:
            await self._answer(*self._refusal(request, exc))
            return
        reader = self.values.open_now("bulk_get", ns, key)
        if reader is None:  # on L2 or at its owner: with more asked, read meanwhile
            if buffered(self.sock) or not self.queue.empty() or self.writing:
                await self.queue.put(await self.fetches.start(self._fetch(request, ns, key)))
            else:
                await self._answer(*await self._fetch(request, ns, key))
            return
        header, pinned = get_answer(request, reader)
        try:
            size, limit = (pinned.size if pinned else 0), self.server.limits.inflight_bytes
            while self.queued_bytes and self.queued_bytes + size > limit:
                self.drained.clear()
                await self.drained.wait()
        except BaseException:
            if pinned is not None:
                pinned.close()
            raise
        await self._answer(header, pinned)  # closes it

    async def _fetch(self, request: Request, ns: str, key: bytes) -> Answer:
        """A GET's answer once its value was read (``kvd.paths.bulk.fetches``)."""
        # A pool member's read (FLAG_HOP) is answered from here alone.
        hop = scope.as_hop() if request.flags & FLAG_HOP else contextlib.nullcontext()
        try:
            with hop:
                reader = await self.values.fetch("bulk_get", ns, key)
        except KvdError as exc:
            return self._refusal(request, exc)
        return get_answer(request, reader)

    def _refusal(self, request: Request, exc: KvdError) -> Answer:
        code = refused(self.server.metrics, "bulk_get", exc)
        return encode_response(OP_GET, request.request_id, code, message=str(exc)), None

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
            item = await self.queue.get()
            self.writing = True
            if isinstance(item, asyncio.Task):  # a GET whose value was being read
                header, reader = await self.fetches.answer(item)
                counted = 0
            else:
                header, reader = item
                counted = reader.size if reader is not None else 0
                if not header:
                    return
            try:
                await self._send(header, reader)
            finally:
                if counted:
                    self.queued_bytes -= counted
                    self.drained.set()

    async def _send(self, header: bytes, reader: Reader | None) -> None:
        sent = False
        try:
            parts = [memoryview(header)]
            if reader is not None:
                parts.extend(reader.views)
            size = reader.size if reader is not None else 0
            await self.server.sender.send(self.sock, parts, len(header) + size)
            sent = True
        finally:
            if reader is not None:
                reader.close()
                # A hit either way; bytes moved only once they left (not a timed-out send).
                self.values.served("bulk_get", TIER_NAMES[reader.tier], reader.size * sent)


def _refuse(sock: socket.socket, reason: str) -> None:
    """Answer a HELLO not yet read with RESOURCE_EXHAUSTED and close (best
    effort: a full socket drops the answer). What the client already sent is
    read first, so the close is a FIN, not a reset that could discard the answer."""
    with contextlib.suppress(OSError):
        sock.send(encode_response(OP_HELLO, 0, CODE_RESOURCE_EXHAUSTED, message=reason))
        sock.recv(TOKEN_BYTES_MAX + REQUEST.size)
    sock.close()


class BulkServer:
    """The listener and its connections."""

    def __init__(
        self,
        values: ValueOps,
        limits: BulkLimits,
        auth: Authenticator | None = None,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        """``tls``: the listener's TLS context as it is now (``bulk_tls``;
        SIGHUP makes a new one); None: in clear."""
        self.values = values
        self.tls = tls
        self.limits = limits
        self.metrics = values.metrics
        self.auth = auth
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.admission = Admission(
            limits.max_connections, limits.max_connections_per_peer, limits.max_unauthenticated
        )
        self.sender = Sender(limits.frame_timeout_s)
        self.port = 0
        # This daemon's NIXL agent, for the pool's peer ops (kvd.paths.bulk.peer_ops),
        # and the pool token that alone may use them; set by the daemon in a pool.
        self.nixl: NixlNode | None = None
        self.pool_token = b""

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
                await readable(loop, listener)
                continue
            except OSError as exc:  # out of descriptors or memory: keep the port, retry
                log.warning("bulk accept failed", extra={"reason": str(exc)})
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            peer = f"{address[0]}:{address[1]}"
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire: Wire = sock if self.tls is None else TlsSocket.wrap(sock, self.tls())
            connection = _Connection(self, wire, peer)
            slot = self.admission.admit(address[0], connection.push_out)
            if isinstance(slot, str):
                if isinstance(wire, TlsSocket):
                    wire.close()  # before the handshake: no answer can be read
                else:
                    _refuse(wire, slot)
                log.warning("bulk connection refused", extra={"peer": peer, "reason": slot})
                continue
            connection.slot = slot
            task = asyncio.create_task(connection.serve())
            connection.task = task
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
