"""The shm socket: region gets and puts, and lookups, without gRPC.

A shared-memory get or put moves no value bytes over any socket, so what it
costs beyond the copy is the round trip that asks for it. Over gRPC that is
~0.6 ms on a small machine; over this Unix socket, with the bulk protocol's
40-byte frames (docs/bulk-protocol.md, "Region ops"), it is a few tens of µs.
Regions are attached here too: a REGION_ATTACH frame passes the region's sealed
memfd with SCM_RIGHTS (``kvd.paths.shm.regions`` says what it checks), on a
connection of its own, since only a connection's first frame is read with
room for a descriptor (asyncio's streams read with plain ``recv``, which
drops them). Detaching is a gRPC call. This module only parses frames into
plain values (``kvd.paths.ops.items``), calls the op layer's
``RegionOps.get_into_region`` and ``put_from_region`` (the gRPC region
calls' own) inside its ``Tally``, and encodes the answer: both ways give the
same answers, limits and metrics. A chain's LOOKUP and its lease's RELEASE
are answered the same way by ``kvd.paths.shm.index_ops``. No protobuf here.

Who may get here: the socket's directory is the daemon's alone (created with
mode ``kvd.paths.socket_dirs.DIR_MODE`` set by ``chmod``, whatever the umask; an existing one
must be owned by the daemon's uid or root and, if others may write it,
sticky), so nobody else can unlink, rename or replace the socket; the
socket has the gRPC socket's ``socket_mode`` and ``socket_group``. Every
connection's peer credentials (``SO_PEERCRED``) are kept: a region belongs
to the uid that attached it. A client, before it sends a token, checks that
its peer is the daemon: the uid (and, in the daemon's pid namespace, the
pid) that ``DescribePaths`` reported over gRPC (``DaemonIdentity``).

Server: per connection, a reader task reads frames and starts each op as
its own task (at most ``PIPELINE_FRAMES`` unanswered), and a writer task
sends the answers in request order. Ops of one connection therefore run
concurrently: on a machine with cores to spare (``kvd.util.cpus``) a batch's
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

The client side is ``kvd.client.shm_socket``; what both sides agree on, ``kvd.wire.shm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvd.paths.ops.calls import Tally, refused
from kvd.paths.ops.items import ItemResult, RegionBatch, RegionItem
from kvd.paths.shm import get_many, pool_reads
from kvd.paths.shm.descriptors import close_all, recv_with_fds, send_with_fd
from kvd.paths.shm.index_ops import (
    INDEX_OPS,
    OP_NAMES,
    index_now,
    index_rest_bytes,
    lookup,
    refusal,
)
from kvd.paths.shm.regions import Caller
from kvd.paths.socket_dirs import claim_socket_path, secure_directory
from kvd.wire.bulk import (
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
    encode_response,
)
from kvd.wire.errors import InvalidArgument, KvdError
from kvd.wire.shm import (
    ATTACHED,
    DEADLINE,
    FLAG_DEADLINE,
    FLAG_NO_ANSWER,
    OP_LOOKUP,
    OP_POOL_ATTACH,
    OP_POOL_GET,
    OP_POOL_TOUCH,
    OP_REGION_ATTACH,
    OP_REGION_GET_MANY,
    PEERCRED,
    PIPELINE_FRAMES,
    REGION_REF,
    TIER_SHIFT,
    region_ref_bytes,
)

if TYPE_CHECKING:
    from kvd.paths.auth import Principal
    from kvd.paths.bulk.limits import BulkLimits
    from kvd.paths.ops.region_ops import RegionOps

log = logging.getLogger("kvd.paths.shm.regions")
T = TypeVar("T")

CHANNEL_OPS = (
    frozenset(
        {OP_HELLO, OP_REGION_GET, OP_REGION_PUT, OP_REGION_GET_MANY, OP_POOL_GET, OP_POOL_TOUCH}
    )
    | INDEX_OPS
)
FIRST_OPS = frozenset({OP_HELLO, OP_REGION_ATTACH, OP_POOL_ATTACH})
LISTEN_BACKLOG = 128
# A failed accept (no descriptor or memory left) is tried again after this.
ACCEPT_RETRY_S = 0.1
_OPS = {OP_REGION_GET: "shm_get", OP_REGION_PUT: "shm_put", OP_REGION_GET_MANY: "shm_get_many",
        OP_POOL_GET: pool_reads.OP_NAME, OP_POOL_TOUCH: "shm_pool_touch",
        **OP_NAMES}  # fmt: skip


# ---- server ---------------------------------------------------------------------------
_BUSY, _IDLE, _IN_FRAME = 0, 1, 2  # what a connection waits for


@dataclass(eq=False)
class _Peer:
    writer: asyncio.StreamWriter
    since: float  # loop time the current wait began (or the last answer left)
    waiting: int = _BUSY
    reason: str = ""
    unanswered: int = 0  # ops read and not yet answered: the client waits on us
    pins: pool_reads.Pins = field(default_factory=pool_reads.Pins)

    def close(self, reason: str) -> None:
        self.reason = reason
        self.writer.transport.abort()


class ShmChannel:
    """Serves region attaches and region ops on a Unix socket for ``RegionOps``."""

    def __init__(
        self,
        ops: RegionOps,
        path: str,
        limits: BulkLimits,
        mode: int = 0o660,
        group_id: int = -1,
    ) -> None:
        self.ops = ops
        self.path = path
        self.limits = limits
        self.mode = mode
        self.group_id = group_id
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._peers: dict[asyncio.Task[None], _Peer] = {}
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind the socket; OSError when it cannot (the daemon then has no
        shared-memory path). The directory is made the daemon's alone first,
        and the socket gets its mode and group before it listens."""
        secure_directory(os.path.dirname(os.path.abspath(self.path)), self.group_id)
        claim_socket_path(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            os.chmod(self.path, self.mode)
            if self.group_id >= 0:
                os.chown(self.path, -1, self.group_id)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_forever(listener))
        self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        for task in (self._watchdog, self._accepting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def pool_pins(self) -> int:
        """Pool pins held by all connections (``kvd.paths.shm.pool_reads``)."""
        return sum(len(peer.pins.held) for peer in self._peers.values())

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

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # no descriptor or memory left: try again shortly
                log.warning("shm socket accept failed", extra={"reason": str(exc)})
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if len(self._connections) >= self.limits.max_connections:
                log.warning(
                    "shm socket connection refused", extra={"reason": "too many connections"}
                )
                conn.close()
                continue
            task = asyncio.create_task(self._connection(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _connection(self, conn: socket.socket) -> None:
        """One connection: its first frame, read with room for a descriptor, is
        a REGION_ATTACH (answered, then the connection ends) or the HELLO of
        a connection of region ops (then served through asyncio streams)."""
        writer: asyncio.StreamWriter | None = None
        peer: _Peer | None = None
        task = asyncio.current_task()
        assert task is not None
        try:
            conn.setblocking(False)
            pid, uid, _ = PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
            )
            loop = asyncio.get_running_loop()
            # A connection that has not said who it is holds its slot for
            # bulk_hello_timeout_ms (2 s), as on the bulk port, not 30 s.
            first_s = self.limits.hello_timeout_s
            try:
                async with asyncio.timeout(first_s):
                    request, rest, fds = await self._first_frame(loop, conn)
            except TimeoutError:
                raise ProtocolError(f"first frame not complete within {first_s:g} s") from None
            if request.op == OP_REGION_ATTACH:
                answer = self._attach(request, rest, fds, uid, pid)
                await loop.sock_sendall(conn, answer)
                return
            if request.op == OP_POOL_ATTACH:
                await self._attach_pool(loop, conn, request, rest)
                return
            principal, answer = self._hello(request, rest)
            await loop.sock_sendall(conn, answer)
            if principal is None and self.ops.auth is not None:
                return
            reader, writer = await asyncio.open_unix_connection(sock=conn)
            peer = self._peers[task] = _Peer(writer, loop.time())
            await self._serve(reader, peer, Caller(uid, pid, principal))
        except (ProtocolError, asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = (peer.reason if peer is not None else "") or (
                "ended inside a frame" if isinstance(exc, asyncio.IncompleteReadError) else str(exc)
            )
            log.warning("shm socket connection closed", extra={"reason": reason})
        finally:
            self._peers.pop(task, None)
            if peer is not None:
                peer.pins.close_all(self.ops)  # its ops have ended (``_serve``)
            if writer is not None:
                writer.close()
            else:
                conn.close()

    async def _first_frame(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket
    ) -> tuple[Request, bytes, list[int]]:
        """The first frame and the descriptors that came with it (the caller's to close)."""
        fds: list[int] = []
        try:
            header = await recv_with_fds(loop, conn, REQUEST.size, fds)
            max_value_bytes = self.ops.store.limits.max_value_bytes
            request = decode_request(header, max_value_bytes, CHANNEL_OPS | FIRST_OPS)
            if request.op not in FIRST_OPS:
                raise ProtocolError("HELLO (or REGION_ATTACH) must come first")
            tail = request.tail_bytes + (request.length if request.op == OP_HELLO else 0)
            rest = await recv_with_fds(loop, conn, tail, fds)
        except BaseException:
            close_all(fds)
            raise
        if request.op != OP_REGION_ATTACH:
            close_all(fds)  # descriptors belong to region attaches only
            fds = []
        return request, rest, fds

    def _attach(self, request: Request, rest: bytes, fds: list[int], uid: int, pid: int) -> bytes:
        """Attach the one memfd of a REGION_ATTACH frame; the answer's meta is
        the region id and token (``ATTACHED``)."""
        try:
            with Tally(self.ops.metrics, "attach_region"):
                try:
                    if len(fds) != 1:
                        raise InvalidArgument(
                            f"a region attach carries one descriptor (SCM_RIGHTS), not {len(fds)}"
                        )
                    principal = None
                    auth = self.ops.auth
                    if auth is not None:
                        token = rest[request.tail_bytes - request.meta_len :]
                        principal = auth.authenticate(token.decode(errors="replace"))
                    region = self.ops.attach_region(
                        fds.pop(), request.length, Caller(uid, pid, principal)
                    )
                finally:
                    close_all(fds)
        except KvdError as exc:
            return refusal(request, exc)
        return encode_response(
            OP_REGION_ATTACH,
            request.request_id,
            meta=ATTACHED.pack(region.region_id, region.token),
            length=region.size,
        )

    async def _attach_pool(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, request: Request, rest: bytes
    ) -> None:
        """Answer a POOL_ATTACH: the pool's descriptor, read-only, or a refusal."""
        fd = -1
        try:
            with Tally(self.ops.metrics, "attach_pool"):
                principal = None
                auth = self.ops.auth
                if auth is not None:
                    token = rest[request.tail_bytes - request.meta_len :]
                    principal = auth.authenticate(token.decode(errors="replace"))
                pool_reads.may_map(self.ops, principal)
                fd = self.ops.store.pool.read_only_fd()
        except KvdError as exc:
            await loop.sock_sendall(conn, refusal(request, exc))
            return
        try:
            answer = pool_reads.attach_answer(request, self.ops.store.pool)
            await send_with_fd(loop, conn, answer, fd)
        finally:
            os.close(fd)
        # With a directory the connection is held open while the client
        # keeps it (it sends nothing): its end tells a client reading the
        # directory that this daemon is gone. Not a frame connection: no idle
        # timeout, but it counts against max_connections like any other.
        if self.ops.store.pool.directory is not None and await loop.sock_recv(conn, 1):
            raise ProtocolError("a POOL_ATTACH connection carries no frame after it")

    async def _serve(self, reader: asyncio.StreamReader, peer: _Peer, caller: Caller) -> None:
        """Region ops of a connection whose HELLO was answered."""
        writer = peer.writer
        loop = asyncio.get_running_loop()
        max_value_bytes = self.ops.store.limits.max_value_bytes
        answers: asyncio.Queue[asyncio.Task[bytes] | None] = asyncio.Queue(PIPELINE_FRAMES)
        answering = asyncio.create_task(self._answer(answers, peer))
        running: set[asyncio.Task[bytes]] = set()
        answered_now = 0
        try:
            while not answering.done():
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
                if request.op == OP_HELLO:
                    raise ProtocolError("HELLO must come first, and only once")
                if request.flags & FLAG_NO_ANSWER and request.op != OP_POOL_TOUCH:
                    raise ProtocolError("only a POOL_TOUCH may go unanswered")
                rest = await reader.readexactly(self._rest_bytes(request))
                peer.waiting = _BUSY
                if not peer.unanswered:  # nothing ahead of it: it may answer at once
                    now = self._op_now(request, rest, caller, peer.pins)
                    if now is not None:
                        writer.write(now)
                        await writer.drain()
                        answered_now += 1
                        if answered_now % PIPELINE_FRAMES == 0:
                            # Frames already buffered are read without a pause:
                            # let other connections run, as a full window does.
                            await asyncio.sleep(0)
                        continue
                op = self._start(request, rest, caller, peer)
                running.add(op)
                op.add_done_callback(running.discard)
                await _queue(answers, op, answering)
            await _queue(answers, None, answering)  # the end of the answers
            await answering  # raises what stopped the writer
        finally:
            answering.cancel()
            # Ops already started run to their end: their copies pin pages.
            await asyncio.gather(answering, *running, return_exceptions=True)

    def _start(
        self, request: Request, rest: bytes, caller: Caller, peer: _Peer
    ) -> asyncio.Task[bytes]:
        """Start one op. It counts as in flight from now on, so an op that
        sees others hands its copy to a thread and a batch copies in parallel."""
        inflight = self.ops.inflight
        inflight.requests += 1
        peer.unanswered += 1
        op = asyncio.create_task(self._op(request, rest, caller, peer.pins))

        def done(_: asyncio.Task[bytes]) -> None:  # also when cancelled before it ran
            inflight.requests -= 1

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
        auth = self.ops.auth
        if auth is None:
            return None, encode_response(OP_HELLO, request.request_id)
        try:
            principal = auth.authenticate(token.decode(errors="replace"))
        except KvdError as exc:
            code = refused(self.ops.metrics, "shm_hello", exc)
            return None, encode_response(OP_HELLO, request.request_id, code, message=str(exc))
        return principal, encode_response(OP_HELLO, request.request_id)

    async def _op(
        self, request: Request, rest: bytes, caller: Caller, pins: pool_reads.Pins
    ) -> bytes:
        try:
            with Tally(self.ops.metrics, _OPS[request.op]):
                if request.op == OP_LOOKUP:  # one that asks the pool
                    return await lookup(self.ops, request, rest, caller)
                if request.op == OP_POOL_TOUCH:
                    return pool_reads.touch(self.ops, request, rest, caller)
                if request.op == OP_POOL_GET:
                    pool_batch = pool_reads.batch_of(self.ops, request, rest, caller)
                    readers = await pool_reads.get(self.ops, pool_batch, pins)
                    return pool_reads.answer_of(self.ops, request, readers, pins)
                if request.op == OP_REGION_GET_MANY:
                    many = get_many.batch_of(self.ops, request, rest, caller)
                    return get_many.answer_of(request, await self.ops.get_into_region(many, caller))
                batch = self._batch(request, rest, caller)
                if request.op == OP_REGION_GET:
                    results = await self.ops.get_into_region(batch, caller)
                else:
                    results = await self.ops.put_from_region(batch, caller)
        except KvdError as exc:
            return refusal(request, exc)
        return _answer_of(request, results[0])

    def _op_now(
        self, request: Request, rest: bytes, caller: Caller, pins: pool_reads.Pins
    ) -> bytes | None:
        """The answer of an op that needs no waiting (``get_now``, ``put_now``), else
        None: then a task (without one a lone get's round trip fell ~280 -> ~200 µs)."""
        if request.op in INDEX_OPS:
            return index_now(self.ops, request, rest, caller)
        if request.op == OP_REGION_GET_MANY:
            return None  # its copies may go to threads: a task
        tally = Tally(self.ops.metrics, _OPS[request.op])
        try:
            with tally:
                if request.op == OP_POOL_TOUCH:
                    return pool_reads.touch(self.ops, request, rest, caller)
                if request.op == OP_POOL_GET:
                    pool_batch = pool_reads.batch_of(self.ops, request, rest, caller)
                    readers = pool_reads.get_now(self.ops, pool_batch, pins)
                    if readers is None:
                        tally.drop()  # the op's task counts it
                        return None
                    return pool_reads.answer_of(self.ops, request, readers, pins)
                batch = self._batch(request, rest, caller)
                item = batch.items[0]
                if request.op == OP_REGION_GET:
                    result = self.ops.get_now(
                        batch.region_id, batch.token, batch.namespace, item, caller,
                        batch.deadline_ns,
                    )  # fmt: skip
                else:
                    result = self.ops.put_now(
                        batch.region_id, batch.token, batch.namespace, item, batch.durable,
                        caller, batch.deadline_ns,
                    )  # fmt: skip
                if result is None:
                    tally.drop()  # the op's task counts it
        except KvdError as exc:
            return refusal(request, exc)
        if result is None:
            return None
        return _answer_of(request, result)

    def _rest_bytes(self, request: Request) -> int:
        """Bytes after an op's header: its references and names (and a LOOKUP's keys)."""
        if request.op in INDEX_OPS:
            return index_rest_bytes(request, self.ops.store.limits.max_lookup_keys)
        if request.op == OP_REGION_GET_MANY:
            return get_many.rest_bytes(request, self.ops.limits.max_batch_items)
        if request.op == OP_POOL_GET:
            return pool_reads.rest_bytes(request, self.ops.limits.max_batch_items)
        if request.op == OP_POOL_TOUCH:
            return pool_reads.touch_rest_bytes(request, self.ops.store.limits.max_lookup_keys)
        return region_ref_bytes(request.flags) + request.tail_bytes

    def _batch(self, request: Request, rest: bytes, caller: Caller) -> RegionBatch:
        """The op's region, namespace and one item, once its namespace is authorized."""
        region_id, offset, token = REGION_REF.unpack_from(rest)
        pos = REGION_REF.size
        deadline_ns = 0
        if request.flags & FLAG_DEADLINE:
            (deadline_ns,) = DEADLINE.unpack_from(rest, pos)
            pos += DEADLINE.size
        fields = []
        for size in (request.ns_len, request.key_len, request.parent_len, request.meta_len):
            fields.append(rest[pos : pos + size])
            pos += size
        try:
            ns = fields[0].decode()
        except UnicodeDecodeError:
            raise InvalidArgument("namespace is not UTF-8") from None
        auth = self.ops.auth
        if auth is not None:
            assert caller.principal is not None, "HELLO authenticated the connection"
            auth.authorize(caller.principal, ns, admin=False)
        if request.op == OP_REGION_PUT:
            checksum = request.checksum if request.flags & FLAG_CHECKSUM else None
            item = RegionItem(fields[1], offset, request.length, checksum, fields[3], fields[2])
        else:
            item = RegionItem(fields[1], offset, request.length)
        durable = bool(request.flags & FLAG_DURABLE)
        return RegionBatch(region_id, token, ns, (item,), deadline_ns, durable=durable)


def _answer_of(request: Request, result: ItemResult) -> bytes:
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
