"""Client side of the bulk TCP data port (docs/bulk-protocol.md).

``BulkClient`` keeps up to ``connections`` sockets to one daemon, each
opened with a HELLO frame carrying the bearer token. A put sends
header and value with one ``sendmsg`` from the caller's buffer (no copy);
a get receives straight into the caller's buffer with ``recv_into``,
hashing each piece as it lands, and checks the checksum the daemon sent.
Batches are split over the connections, one thread each, and pipelined on
each connection: up to ``PIPELINE_FRAMES`` requests are sent before the first
answer is read, so a batch of small values costs one round trip per window
rather than one per value.

To a daemon whose bulk port takes TLS (``bulk_tls``), every connection is
a TLS session (``tls``): sent part by part (OpenSSL takes no ``sendmsg``)
and received in Python, never by the native receive, which reads the raw
socket.

Blocking sockets with a per-operation timeout: every call fails within
``timeout_s`` of the daemon going quiet, with ``Unavailable`` or
``DeadlineExceeded``; a connection that failed is closed, never reused.
A connection the daemon refused (too many, ``RESOURCE_EXHAUSTED`` at HELLO)
or closed, or a port that cannot be reached, fails the call with
``BulkUnavailable``: ``kvd.client.clients`` then makes that call over gRPC.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvd.wire.bulk import (
    CODE_NOT_FOUND,
    CODE_OK,
    CODE_RESOURCE_EXHAUSTED,
    FLAG_EXISTED,
    OP_GET,
    OP_HELLO,
    OP_PUT,
    RESPONSE,
    RESPONSE_MAGIC,
    VERSION,
    encode_request,
)
from kvd.wire.checksum import Hasher, checksum
from kvd.wire.errors import (
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    KvdError,
    Unavailable,
    error_for,
)
from kvd.wire.send import send_all

# Requests in flight per connection before the first answer is read: 64 GET
# headers are ~6 KiB, far below a socket buffer, so sending them never blocks
# on a daemon that is busy writing answers back.
PIPELINE_FRAMES = 64
DEFAULT_CONNECTIONS = 4
# Connections kept per client; each costs the daemon one pair of tasks.
CONNECTIONS_MAX = 64
# Values from this size arrive in one native call (``kvd.io._uring.recv_hashed``:
# received and hashed piece by piece with the GIL released); smaller ones in a
# few ``recv_into`` calls, which cost less than the call's set-up.
NATIVE_RECV_BYTES = 256 << 10
RECV_WAIT_MS_MAX = 2**31 - 1
# recv_hashed's statuses besides 0 (native/kvd_net.c); negative ones are -errno.
RECV_EOF, RECV_TIMEOUT = 1, 2
RecvHashed = Callable[[int, Sequence[memoryview], int], tuple[int, int, int]]

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Answer:
    op: int
    flags: int
    request_id: int
    code: int
    meta: bytes
    message: str
    length: int
    checksum: int


@dataclass(frozen=True, slots=True)
class BulkPut:
    key: bytes
    value: memoryview
    meta: bytes = b""
    parent: bytes = b""


class BulkUnavailable(Unavailable):
    """The bulk port refused, closed or could not open a connection (not a
    deadline): the same call may go over gRPC. Keys are write-once, so a put
    sent again there is stored once."""


def _error(code: int, message: str) -> KvdError:
    return error_for(code, message)


class Connection:
    """One socket; used by one thread at a time (taken from the client's pool)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        timeout_s: float,
        check_peer: Callable[[socket.socket], None] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``check_peer`` vets the connected socket before the token goes out
        (the shm socket's peer credentials, ``kvd.paths.shm.channel``);
        ``tls``: a TLS session on the TCP connection, the daemon's certificate
        checked for ``host``."""
        self.tls = tls is not None
        if port:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                try:
                    self.sock = tls.wrap_socket(self.sock, server_hostname=host)
                except BaseException:
                    self.sock.close()
                    raise
        else:  # ``host`` is a Unix socket path (the shm socket)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.settimeout(timeout_s)
                self.sock.connect(host)
                if check_peer is not None:
                    check_peer(self.sock)
            except BaseException:
                self.sock.close()
                raise
        self._header = bytearray(RESPONSE.size)
        self._ids = itertools.count(1)
        # The pool pin this connection holds (kvd.client.pool_reads): its
        # next POOL_GET releases it; 0: none.
        self.pin = 0
        hello = (token or "").encode()
        try:
            self.send(
                [memoryview(encode_request(OP_HELLO, 0, length=len(hello))), memoryview(hello)]
            )
            answer = self.answer()
            if answer.code == CODE_RESOURCE_EXHAUSTED:
                raise BulkUnavailable(f"bulk connection refused: {answer.message}")
            if answer.op != OP_HELLO or answer.code != CODE_OK:
                raise _error(answer.code, answer.message or "HELLO refused")
        except BaseException:
            self.sock.close()  # refused (a bad token) or broken: never pooled
            raise

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, parts: list[memoryview]) -> None:
        if self.tls:
            for part in parts:
                self.sock.sendall(part)
            return
        if len(parts) == 1:
            # One buffer: sendall. A 40-byte echo over a Unix socket took
            # 49 µs a round trip with sendmsg here, 22 µs with sendall.
            self.sock.sendall(parts[0])
            return
        send_all(self.sock, parts, _blocking_socket_full)

    def recv_into(self, view: memoryview, hasher: Hasher | None = None) -> None:
        pos = 0
        while pos < len(view):
            n = self.sock.recv_into(view[pos:])
            if n == 0:
                raise ConnectionError("daemon closed the bulk connection")
            if hasher is not None:
                hasher.update(view[pos : pos + n])
            pos += n

    def recv_value(self, view: memoryview) -> int:
        """A value's bytes into ``view``; their xxh3-64. The socket's timeout
        bounds each wait for more bytes, as on ``recv_into``."""
        recv_hashed = native_recv_hashed()
        if recv_hashed is None or len(view) < NATIVE_RECV_BYTES or self.tls:
            hasher = Hasher()
            self.recv_into(view, hasher)
            return hasher.value()
        timeout_s = self.sock.gettimeout()
        wait_ms = (
            RECV_WAIT_MS_MAX if timeout_s is None else min(int(timeout_s * 1000), RECV_WAIT_MS_MAX)
        )
        status, received, digest = recv_hashed(self.sock.fileno(), [view], wait_ms)
        if status == 0:
            return digest
        if status == RECV_TIMEOUT:
            raise TimeoutError(f"bulk answer stalled after {received} of {len(view)} bytes")
        if status == RECV_EOF:
            raise ConnectionError("daemon closed the bulk connection")
        raise OSError(-status, os.strerror(-status))

    def answer(self) -> Answer:
        self.recv_into(memoryview(self._header))
        magic, version, op, flags, rid, code, meta_len, msg_len, length, csum = RESPONSE.unpack(
            self._header
        )
        if magic != RESPONSE_MAGIC or version != VERSION:
            raise ConnectionError(f"not a kvd bulk answer (magic {bytes(magic)!r} v{version})")
        tail = bytearray(meta_len + msg_len)
        self.recv_into(memoryview(tail))
        message = tail[meta_len:].decode(errors="replace")
        return Answer(op, flags, rid, code, bytes(tail[:meta_len]), message, length, csum)

    def close(self) -> None:
        self.sock.close()


@functools.cache
def native_recv_hashed() -> RecvHashed | None:
    """``kvd.io._uring.recv_hashed`` (a value received and hashed in one call
    with the GIL released), or None where the native module is not built.
    Imported at the first large get: importing the client loads no native
    code, and the extension holds no daemon code."""
    try:
        import kvd.io._uring as _uring
    except ImportError:
        return None
    return _uring.recv_hashed


class BulkClient:
    """Puts and gets over the bulk TCP port of one daemon. Thread-safe.

    ``port`` 0 makes ``host`` a Unix socket path: ``kvd.paths.shm.channel`` speaks
    the same framing over the daemon's shm socket."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        connections: int = DEFAULT_CONNECTIONS,
        timeout_s: float = 5.0,
        check_peer: Callable[[socket.socket], None] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: the daemon's bulk port takes TLS (``bulk_tls``)."""
        if not 1 <= connections <= CONNECTIONS_MAX:
            raise ValueError(f"connections must be 1..{CONNECTIONS_MAX}")
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.connections = connections
        self._token = token
        self._check_peer = check_peer
        self._tls = tls
        self._idle: queue.LifoQueue[Connection] = queue.LifoQueue()
        self._opened = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(connections)
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False

    def __enter__(self) -> BulkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break
        if self._threads is not None:
            self._threads.shutdown(wait=True)

    # ---- connections ---------------------------------------------------------------
    def with_connection(self, work: Callable[[Connection], T]) -> T:
        if self._closed:
            raise Unavailable("bulk client is closed")
        if not self._slots.acquire(timeout=self.timeout_s):
            raise DeadlineExceeded(f"no bulk connection free within {self.timeout_s} s")
        try:
            try:
                conn = self._idle.get_nowait()
                conn.sock.settimeout(self.timeout_s)  # the caller's deadline may have changed
            except queue.Empty:
                conn = self._connect()
            try:
                result = work(conn)
            except (OSError, ValueError) as exc:
                conn.close()
                if isinstance(exc, TimeoutError):
                    raise DeadlineExceeded(f"bulk {self.host}:{self.port}: {exc}") from None
                raise BulkUnavailable(f"bulk {self.host}:{self.port}: {exc}") from None
            except BaseException:
                conn.close()  # state unknown (an error mid-frame): never reuse
                raise
            self._idle.put(conn)
            return result
        finally:
            self._slots.release()

    def _connect(self) -> Connection:
        try:
            return Connection(
                self.host, self.port, self._token, self.timeout_s, self._check_peer, self._tls
            )
        except TimeoutError as exc:
            raise DeadlineExceeded(f"bulk {self.host}:{self.port}: {exc}") from None
        except OSError as exc:
            raise BulkUnavailable(f"bulk {self.host}:{self.port}: {exc}") from None

    def spread(self, count: int, work: Callable[[int, int], None]) -> None:
        """Run ``work(start, end)`` over slices of ``range(count)``, one per connection."""
        slices = min(self.connections, max(1, count))
        bounds = [(count * i // slices, count * (i + 1) // slices) for i in range(slices)]
        bounds = [(a, b) for a, b in bounds if b > a]
        if len(bounds) <= 1:
            for a, b in bounds:
                work(a, b)
            return
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(CONNECTIONS_MAX, thread_name_prefix="kvd-bulk")
        futures = [self._threads.submit(work, a, b) for a, b in bounds]
        for future in futures:
            future.result()

    # ---- puts ----------------------------------------------------------------------
    def put(
        self,
        ns: str,
        key: bytes,
        value: Buffer,
        meta: bytes = b"",
        parent: bytes | None = None,
        *,
        durable: bool = False,
    ) -> bool:
        """Store a value; True when the key already held these bytes."""
        item = BulkPut(key, memoryview(value).cast("B"), meta, parent or b"")
        return self.put_many(ns, [item], durable=durable)[0]

    def put_many(self, ns: str, items: Sequence[BulkPut], *, durable: bool = False) -> list[bool]:
        out: list[bool | KvdError] = [False] * len(items)
        ns_bytes = ns.encode()

        def run(start: int, end: int) -> None:
            self.with_connection(
                lambda conn: _put_window(conn, ns_bytes, items, start, end, out, durable)
            )

        self.spread(len(items), run)
        for result in out:
            if isinstance(result, KvdError):
                raise result
        return [bool(result) for result in out]

    # ---- gets ----------------------------------------------------------------------
    def get_into(self, ns: str, key: bytes, buffer: Buffer) -> int | None:
        """Read a value into ``buffer``; its size, or None on a miss."""
        view = memoryview(buffer).cast("B")
        frame = memoryview(encode_request(OP_GET, 0, ns.encode(), key, length=len(view)))

        def one(conn: Connection) -> int | bytes | KvdError | None:
            conn.send([frame])
            return _received(conn, 0, view)

        got = _raise_or(self.with_connection(one))
        assert not isinstance(got, bytes), "read into the buffer"
        return got

    def get(self, ns: str, key: bytes) -> bytes | None:
        return self.get_many(ns, [key])[0]

    def get_many_into(
        self, ns: str, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        out: list[int | KvdError | None] = [None] * len(keys)
        ns_bytes = ns.encode()

        def run(start: int, end: int) -> None:
            self.with_connection(
                lambda conn: _get_window(conn, ns_bytes, keys, buffers, start, end, out)
            )

        self.spread(len(keys), run)
        return [_raise_or(value) for value in out]

    def get_many(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | KvdError | None] = [None] * len(keys)
        ns_bytes = ns.encode()

        def run(start: int, end: int) -> None:
            self.with_connection(
                lambda conn: _get_window(conn, ns_bytes, keys, None, start, end, out)
            )

        self.spread(len(keys), run)
        return [_raise_or(value) for value in out]


def _blocking_socket_full() -> None:
    raise ConnectionError("a blocking socket refused to send")  # pragma: no cover


def _raise_or(value: T | KvdError) -> T:
    if isinstance(value, KvdError):
        raise value
    return value


def _put_window(
    conn: Connection,
    ns: bytes,
    items: Sequence[BulkPut],
    start: int,
    end: int,
    out: list[bool | KvdError],
    durable: bool,
) -> None:
    """Send puts ``start..end`` with at most PIPELINE_FRAMES unanswered; fill ``out``."""
    sent = start
    for done in range(start, end):
        while sent < end and sent - done < PIPELINE_FRAMES:
            item = items[sent]
            header = encode_request(
                OP_PUT,
                sent,
                ns,
                item.key,
                parent=item.parent,
                meta=item.meta,
                length=len(item.value),
                checksum=checksum(item.value),
                durable=durable,
            )
            conn.send([memoryview(header), item.value])
            sent += 1
        answer = conn.answer()
        if answer.op != OP_PUT or answer.request_id != done:
            raise ConnectionError(f"answer {answer.request_id} to request {done}: out of order")
        if answer.code != CODE_OK:
            out[done] = _error(answer.code, answer.message)
        else:
            out[done] = bool(answer.flags & FLAG_EXISTED)


def _get_window(
    conn: Connection,
    ns: bytes,
    keys: Sequence[bytes],
    buffers: Sequence[memoryview] | None,
    start: int,
    end: int,
    results: list[Any],
) -> None:
    """Send gets ``start..end`` pipelined; fill ``results`` with sizes (into buffers) or bytes."""
    sent = start
    for done in range(start, end):
        while sent < end and sent - done < PIPELINE_FRAMES:
            room = len(buffers[sent]) if buffers is not None else 0
            conn.send([memoryview(encode_request(OP_GET, sent, ns, keys[sent], length=room))])
            sent += 1
        results[done] = _received(conn, done, buffers[done] if buffers is not None else None)


def _received(
    conn: Connection, request_id: int, buffer: memoryview | None
) -> int | bytes | KvdError | None:
    """The answer to get ``request_id``: its value's size (read into ``buffer``),
    its bytes (without a buffer), None for a miss, or the error."""
    answer = conn.answer()
    if answer.op != OP_GET or answer.request_id != request_id:
        raise ConnectionError(f"answer {answer.request_id} to request {request_id}: out of order")
    if answer.code == CODE_NOT_FOUND:
        return None
    if answer.code != CODE_OK:
        room = len(buffer) if buffer is not None else 0
        if answer.code == CODE_RESOURCE_EXHAUSTED and room and answer.length > room:
            # The caller's buffer, not the daemon, is short: as on the other paths.
            return InvalidArgument(f"buffer of {room} bytes is too small for {answer.length}")
        return _error(answer.code, answer.message)
    target = buffer[: answer.length] if buffer is not None else memoryview(bytearray(answer.length))
    if conn.recv_value(target) != answer.checksum:
        return DataLoss("value does not match its checksum")
    return answer.length if buffer is not None else bytes(target)
