"""Connections to the members' bulk TCP ports (docs/bulk-protocol.md), for
value reads between daemons of the pool: the peer side of
``kvd.paths.bulk.server``, speaking the same frames (``kvd.wire.bulk``).

A member's Exists (its share of a chain being looked up) is one
PEER_EXISTS frame each way on the same connections, and so is the ask for
a member's eviction plan (PEER_PLAN), and a put handed on to its owner
(PUT with ``FLAG_HOP``, its bytes sent from this daemon's L1 pages).

A read is one GET frame with ``FLAG_HOP`` (the owner answers from what it
holds, never asking a third member), several of them back to back on one
connection for a batch (``ask``); each answer's header says the size, meta
and checksum, then the value's bytes are received straight into the views
the caller gives (``kvd.cluster.peer_reads``: the reserved pool pages of a
put), hashed as they land, or read and dropped (``skip``).

Connections are opened on first use (HELLO with the pool token), kept per
member for the next read, and bounded: at most ``CONNECTIONS_MAX`` per
member in use at once (a caller past it waits, within its own timeout), at
most ``IDLE_MAX`` kept idle. A connection is put back only after a whole
answer was read; one that failed, timed out or was cancelled mid-answer is
closed, so a late byte can never be read as the next answer's.

Between members with TLS (``pool_tls_ca_file``) whose bulk ports take it
(``bulk_tls``), each connection is a TLS session (``BulkTls``): the member's
certificate checked against the pool's CA and name, this daemon's own
presented (``kvd.wire.tls_socket``).

Every failure is a ``PeerError`` with its kind: a peer answering another
protocol version is ``version`` (and logged by the caller), a connection
that ends inside the value is ``short``, a TLS handshake that fails (a
certificate either side does not accept) is ``auth``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvd.cluster.peers import PeerError
from kvd.store.index import Reader
from kvd.wire.bulk import (
    CODE_NOT_FOUND,
    CODE_OK,
    FLAG_HOP,
    FLAG_KEEP,
    MESSAGE_BYTES_MAX,
    NIXL_META_BYTES_MAX,
    NIXL_PIN,
    NIXL_SEGMENT,
    NIXL_SEGMENTS_MAX,
    OP_GET,
    OP_HELLO,
    OP_NIXL_META,
    OP_NIXL_PIN,
    OP_NIXL_RELEASE,
    OP_PEER_EXISTS,
    OP_PEER_HISTORY,
    OP_PEER_PLAN,
    OP_PEER_TELL,
    OP_PUT,
    PLAN_BYTES_MAX,
    RESPONSE,
    RESPONSE_MAGIC,
    VERSION,
    encode_exists,
    encode_request,
    encode_tell,
    exists_meta,
)
from kvd.wire.checksum import Hasher
from kvd.wire.errors import CODE_NAMES, CODE_NUMBERS
from kvd.wire.limits import META_BYTES_MAX
from kvd.wire.lookup import ChainShare
from kvd.wire.tls_socket import TlsSocket, Wire, handshake, recv_some, send_whole

# Reads in flight to one member at once, each on its own connection: the
# router keeps up to 32 peer reads in flight per batch (FETCH_PARALLEL_MAX);
# 8 connections of 4 MiB reads fill a 25 Gb/s link at ~1 ms per read, and
# each costs the member one of its bulk_max_connections_per_peer (64).
CONNECTIONS_MAX = 8
# Idle connections kept per member for the next reads.
IDLE_MAX = 8
# A value not kept is read and dropped this much at a time.
SKIP_BYTES = 1 << 20


class BulkUnreachable(PeerError):
    """The member's bulk port refused or did not answer the connect."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "unreachable")


@dataclass(frozen=True)
class BulkAnswer:
    """A GET answer's header: the value's size, meta and checksum."""

    size: int
    meta: bytes
    checksum: int


def _refused(op: str, code: int, message: str) -> PeerError:
    """A member's refusal of ``op``: ``auth`` for PERMISSION_DENIED (this
    daemon's token may not), else ``refused``."""
    kind = "auth" if CODE_NAMES.get(code) == "PERMISSION_DENIED" else "refused"
    return PeerError(f"bulk {op} refused: {CODE_NAMES.get(code, code)} {message}", kind)


@dataclass(frozen=True)
class BulkTls:
    """The TLS of connections to the members' bulk ports: the client
    context (the pool's CA, this daemon's certificate) and the name the
    members' certificates carry ("": each member's host)."""

    context: ssl.SSLContext
    server_name: str = ""


class BulkConnection:
    """One connection to a member's bulk port, past its HELLO."""

    def __init__(self, sock: Wire) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self.reusable = False  # set once an answer was read in full

    @classmethod
    async def connect(
        cls, host: str, port: int, token: str, tls: BulkTls | None = None
    ) -> BulkConnection:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        raw = socket.socket(family, socket.SOCK_STREAM)
        sock: Wire = raw
        try:
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop = asyncio.get_running_loop()
            try:
                await loop.sock_connect(raw, (host, port))
            except OSError as exc:
                raise BulkUnreachable(f"bulk {host}:{port}: {exc.strerror or exc}") from None
            if tls is not None:
                sock = TlsSocket.wrap(raw, tls.context, tls.server_name or host)
                try:
                    await handshake(loop, sock)
                except OSError as exc:  # ssl.SSLError: a certificate refused, either side
                    raise PeerError(f"bulk {host}:{port}: TLS handshake: {exc}", "auth") from None
            connection = cls(sock)
            payload = token.encode()
            await connection._send(encode_request(OP_HELLO, 0, length=len(payload)) + payload)
            code, _, message, _ = await connection._answer(OP_HELLO, 0)
            if code != CODE_OK:
                kind = "auth" if CODE_NAMES.get(code) == "UNAUTHENTICATED" else "refused"
                raise PeerError(f"bulk {host}:{port}: HELLO refused: {message}", kind)
        except BaseException:
            sock.close()
            raise
        return connection

    def close(self) -> None:
        self.sock.close()

    async def ask(self, namespace: str, keys: list[bytes]) -> list[int]:
        """A GET frame with ``FLAG_HOP`` for each key, back to back; their
        request ids, whose answers come in this order (``answer_get``): the
        value's bytes follow each answer, ``receive`` or ``skip`` them."""
        return await self._ask(OP_GET, namespace, keys)

    async def _ask(self, op: int, namespace: str, keys: list[bytes]) -> list[int]:
        """A frame of ``op`` with ``FLAG_HOP`` for each key, back to back (one
        flush); their request ids, in order."""
        self.reusable = False
        rids = [next(self._ids) for _ in keys]
        for i, (rid, key) in enumerate(zip(rids, keys, strict=True)):
            request = encode_request(op, rid, namespace.encode(), key, flags=FLAG_HOP)
            await self._send(request, flush=i == len(keys) - 1)
        return rids

    async def answer_get(self, rid: int, max_value_bytes: int) -> BulkAnswer | None:
        """The header of GET ``rid``'s answer (None: not held; a refusal
        raises ``refused`` or ``auth``); its value's bytes follow."""
        code, meta, message, answer = await self._answer(OP_GET, rid)
        if code == CODE_NOT_FOUND:
            self.reusable = True
            return None
        if code != CODE_OK:
            self.reusable = True
            raise _refused("GET", code, message)
        size = answer[0]
        if size > max_value_bytes:
            raise PeerError(f"bulk GET answered {size} bytes, over max_value_bytes", "protocol")
        self.reusable = False  # until its bytes were read (receive, skip)
        return BulkAnswer(size, meta, answer[1])

    async def put_many(
        self, puts: list[tuple[str, bytes, Reader, bytes | None]], keep: bool = False
    ) -> list[bool]:
        """Store values on the member they belong to (puts handed on): one
        PUT frame with ``FLAG_HOP`` each (the member keeps it, never hands
        it on), sent back to back from the values' pages, then their
        answers in order; whether it took each (an equal value there is
        fine). A put with a history (``EvictionPolicy.history``) goes after
        a PEER_HISTORY frame of it; with ``keep`` (``FLAG_KEEP``) the member
        keeps each as its own, whoever its placement names."""
        flags = FLAG_HOP | (FLAG_KEEP if keep else 0)
        self.reusable = False
        rids = [next(self._ids) for _ in puts]
        for rid, (namespace, key, reader, history) in zip(rids, puts, strict=True):
            if history is not None:
                await self._send(encode_request(
                    OP_PEER_HISTORY, next(self._ids), namespace.encode(), key, meta=history,
                    flags=FLAG_HOP,
                ), flush=False)  # fmt: skip
            request = encode_request(
                OP_PUT, rid, namespace.encode(), key, parent=reader.entry.parent or b"",
                meta=reader.meta, length=reader.size, checksum=reader.checksum, flags=flags,
            )  # fmt: skip
            await self._send(request, flush=not reader.views)  # over TLS: one flush a value
            for i, view in enumerate(reader.views):
                await self._send(view, flush=i == len(reader.views) - 1)
        taken = []
        for rid in rids:
            code, _, _, _ = await self._answer(OP_PUT, rid)
            taken.append(code in (CODE_OK, CODE_NUMBERS["ALREADY_EXISTS"]))
        self.reusable = True
        return taken

    async def exists(
        self, namespace: str, width: int, keys: bytes, chain: ChainShare | None
    ) -> bytes:
        """Which of ``keys`` (of ``width`` bytes, concatenated) the member
        holds, a byte each (``EXISTS_NOT_HELD``, ``EXISTS_HELD`` or
        ``EXISTS_KEPT``); with ``chain``, they are its share of a chain being
        looked up."""
        self.reusable = False
        rid = next(self._ids)
        payload = encode_exists(width, keys, chain)
        request = encode_request(
            OP_PEER_EXISTS, rid, namespace.encode(), meta=exists_meta(chain), flags=FLAG_HOP,
            length=len(payload),
        )  # fmt: skip
        await self._send(request + payload)
        code, _, message, (length, _) = await self._answer(OP_PEER_EXISTS, rid)
        if code != CODE_OK:
            self.reusable = True
            raise _refused("EXISTS", code, message)
        count = len(keys) // width
        if length != count:
            raise PeerError(f"bulk EXISTS answered {length} of {count} keys", "protocol")
        answer = bytearray(length)
        await self._recv_into(memoryview(answer), None, 0, length)
        self.reusable = True
        return bytes(answer)

    async def tell(self, namespace: str, shares: list[tuple[int, bytes, ChainShare]]) -> None:
        """Lookups' chain shares (key width, keys concatenated, where they lie)
        for the member's policy, in one PEER_TELL; nothing is answered."""
        self.reusable = False
        payload = encode_tell(shares)
        request = encode_request(
            OP_PEER_TELL, next(self._ids), namespace.encode(), flags=FLAG_HOP, length=len(payload)
        )
        await self._send(request + payload)
        self.reusable = True

    async def plan(self) -> tuple[str, bytes] | None:
        """The member's eviction policy's name and plan; None while it has none."""
        self.reusable = False
        rid = next(self._ids)
        await self._send(encode_request(OP_PEER_PLAN, rid, flags=FLAG_HOP))
        code, meta, message, (length, _) = await self._answer(OP_PEER_PLAN, rid)
        if code != CODE_OK:
            self.reusable = True
            if code == CODE_NOT_FOUND:
                return None
            raise _refused("PLAN", code, message)
        if length > PLAN_BYTES_MAX:
            raise PeerError(f"a plan of {length} bytes, over {PLAN_BYTES_MAX}", "protocol")
        plan = bytearray(length)
        await self._recv_into(memoryview(plan), None, 0, length)
        self.reusable = True
        return meta.decode("utf-8", "replace"), bytes(plan)

    async def nixl_meta(self) -> bytes | None:
        """The member's NIXL agent metadata; None where it has no agent, or
        gives it to no one with this daemon's token."""
        self.reusable = False
        rid = next(self._ids)
        await self._send(encode_request(OP_NIXL_META, rid))
        code, _, message, (length, _) = await self._answer(OP_NIXL_META, rid)
        if code != CODE_OK:
            self.reusable = True
            if code in (CODE_NUMBERS["UNIMPLEMENTED"], CODE_NUMBERS["PERMISSION_DENIED"]):
                return None
            raise PeerError(f"bulk NIXL_META refused: {CODE_NAMES.get(code, code)} {message}")
        if length > NIXL_META_BYTES_MAX:
            raise PeerError(f"NIXL metadata of {length} bytes", "protocol")
        metadata = bytearray(length)
        await self._recv_into(memoryview(metadata), None, 0, length)
        self.reusable = True
        return bytes(metadata)

    async def nixl_pin_many(
        self, namespace: str, keys: list[bytes], max_value_bytes: int
    ) -> list[tuple[BulkAnswer, int, list[tuple[int, int]]] | None]:
        """Pin each value on the member for a NIXL read: its header, the lease
        id and its pages' (address, length); None where the member does not
        hold it. The NIXL_PIN frames go back to back and their answers are
        read in order (at most the member's pins a connection holds,
        ``PINS_MAX`` in kvd.paths.bulk.peer_ops); ``nixl_release_many`` the
        leases once read. A refused pin (RESOURCE_EXHAUSTED, ...) raises, and
        the connection is closed, which ends the pins it took."""
        rids = await self._ask(OP_NIXL_PIN, namespace, keys)
        pinned = [await self._pinned(rid, max_value_bytes) for rid in rids]
        self.reusable = True
        return pinned

    async def _pinned(
        self, rid: int, max_value_bytes: int
    ) -> tuple[BulkAnswer, int, list[tuple[int, int]]] | None:
        code, meta, message, (length, sum_sent) = await self._answer(OP_NIXL_PIN, rid)
        if code == CODE_NOT_FOUND:
            return None
        if code != CODE_OK:
            raise _refused("NIXL_PIN", code, message)
        if length > NIXL_PIN.size + NIXL_SEGMENTS_MAX * NIXL_SEGMENT.size:
            raise PeerError(f"NIXL_PIN answer of {length} bytes", "protocol")
        payload = bytearray(length)
        await self._recv_into(memoryview(payload), None, 0, length)
        size, lease, count = NIXL_PIN.unpack_from(payload)
        if length != NIXL_PIN.size + count * NIXL_SEGMENT.size or size > max_value_bytes:
            raise PeerError("NIXL_PIN answer's segments do not match its length", "protocol")
        pages = [
            NIXL_SEGMENT.unpack_from(payload, NIXL_PIN.size + i * NIXL_SEGMENT.size)
            for i in range(count)
        ]
        if sum(n for _, n in pages) != size:
            raise PeerError(f"NIXL_PIN segments do not cover its {size} bytes", "protocol")
        return BulkAnswer(size, meta, sum_sent), lease, pages

    async def nixl_release_many(self, leases: list[int]) -> None:
        """End pins taken with ``nixl_pin_many``: the NIXL_RELEASE frames back
        to back, then their answers."""
        self.reusable = False
        rids = [next(self._ids) for _ in leases]
        for i, (rid, lease) in enumerate(zip(rids, leases, strict=True)):
            request = encode_request(OP_NIXL_RELEASE, rid, checksum=lease)
            await self._send(request, flush=i == len(leases) - 1)
        for rid in rids:
            await self._answer(OP_NIXL_RELEASE, rid)
        self.reusable = True

    async def receive(self, views: list[memoryview], hasher: Hasher) -> None:
        """The value's bytes, straight into ``views`` (their total is its size)."""
        total = sum(len(v) for v in views)
        got = 0
        for view in views:
            got += await self._recv_into(view, hasher, got, total)
        self.reusable = True

    async def skip(self, size: int) -> None:
        """A value's bytes read and dropped (one not kept here, with more
        answers behind it on this connection)."""
        scratch = memoryview(bytearray(min(size, SKIP_BYTES)))
        got = 0
        while got < size:
            got += await self._recv_into(scratch[: min(size - got, len(scratch))], None, got, size)
        self.reusable = True

    async def _send(self, data: bytes | memoryview, flush: bool = True) -> None:
        """``data`` sent; over TLS without ``flush`` its last ciphertext may
        wait for the next send's."""
        try:
            await send_whole(self.loop, self.sock, data, flush)
        except OSError as exc:  # reset or broken: the member's process went away
            raise PeerError(
                f"bulk connection failed sending: {exc.strerror or exc}", "short"
            ) from None

    async def _answer(self, op: int, rid: int) -> tuple[int, bytes, str, tuple[int, int]]:
        """(code, meta, message, (length, checksum)) of the next answer."""
        header = bytearray(RESPONSE.size)
        await self._recv_into(memoryview(header), None, 0, RESPONSE.size)
        magic, version, got_op, _, got_rid, code, meta_len, msg_len, length, checksum = (
            RESPONSE.unpack(header)
        )
        if magic != RESPONSE_MAGIC:
            raise PeerError(f"bulk answer with bad magic {bytes(magic)!r}", "protocol")
        if version != VERSION:
            raise PeerError(
                f"bulk protocol version {version}, this daemon speaks {VERSION}", "version"
            )
        if got_op != op or got_rid != rid:
            raise PeerError(f"bulk answer to op {got_op} #{got_rid}, asked {op} #{rid}", "protocol")
        if meta_len > META_BYTES_MAX or msg_len > MESSAGE_BYTES_MAX:
            raise PeerError("bulk answer's meta or message over its limit", "protocol")
        tail = bytearray(meta_len + msg_len)
        if tail:
            await self._recv_into(memoryview(tail), None, 0, len(tail))
        message = tail[meta_len:].decode("utf-8", "replace")
        return code, bytes(tail[:meta_len]), message, (length, checksum)

    async def _recv_into(
        self, view: memoryview, hasher: Hasher | None, before: int, total: int
    ) -> int:
        pos, size = 0, len(view)
        while pos < size:
            try:
                try:  # bytes already here: no coroutine made
                    n = self.sock.recv_into(view[pos:])
                except BlockingIOError:  # a TLS session's waits (WantRead, WantWrite) too
                    n = await recv_some(self.loop, self.sock, view[pos:])
            except ssl.SSLError as exc:  # e.g. the member refused this daemon's certificate
                raise PeerError(f"bulk connection: TLS: {exc}", "auth") from None
            except OSError as exc:  # a reset: the member's process went away mid-call
                raise PeerError(
                    f"bulk connection failed after {before + pos} of {total} bytes: "
                    f"{exc.strerror or exc}",
                    "short",
                ) from None
            if n == 0:
                raise PeerError(
                    f"bulk connection ended after {before + pos} of {total} bytes", "short"
                )
            if hasher is not None:
                hasher.update(view[pos : pos + n])
            pos += n
        return size


class BulkPeers:
    """The bulk connections of this daemon to each member, bounded per member."""

    def __init__(self, token: str, tls: BulkTls | None = None) -> None:
        """``tls``: the connections' TLS (``pool_tls_ca_file``); None: in clear."""
        self.token = token  # the pool token (HELLO)
        self.tls = tls
        self._idle: dict[str, list[BulkConnection]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}

    @contextlib.asynccontextmanager
    async def connection(self, member: str, host: str, port: int) -> AsyncIterator[BulkConnection]:
        """A connection to ``member``'s bulk port at ``host:port`` for one read;
        kept for the next if the read ended cleanly, else closed."""
        slots = self._slots.setdefault(member, asyncio.Semaphore(CONNECTIONS_MAX))
        async with slots:
            connection = self._take_idle(member)
            if connection is None:
                connection = await BulkConnection.connect(host, port, self.token, self.tls)
            try:
                yield connection
            except BaseException:
                connection.close()
                raise
            kept = self._idle.setdefault(member, [])
            if connection.reusable and len(kept) < IDLE_MAX and member in self._slots:
                kept.append(connection)
            else:
                connection.close()

    def _take_idle(self, member: str) -> BulkConnection | None:
        """An idle connection the member has not closed meanwhile (its
        bulk_idle_timeout_ms, a restart): one with EOF or an error waiting is
        dropped here, not found broken by the next read."""
        idle = self._idle.get(member)
        while idle:
            connection = idle.pop()
            try:  # EOF, or a byte no read asked for (out of step): dropped
                connection.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return connection  # nothing waiting: alive
            except OSError:
                pass
            connection.close()
        return None

    def use_tls(self, tls: BulkTls) -> None:
        """New TLS files (SIGHUP): connections from now on use them; the idle
        ones, opened with the old, are closed."""
        self.tls = tls
        for member in list(self._idle):
            self.forget(member)

    def forget(self, member: str) -> None:
        """Close the idle connections to ``member`` (it left, or its port changed)."""
        for connection in self._idle.pop(member, []):
            connection.close()

    def retain(self, members: tuple[str, ...]) -> None:
        for member in [m for m in self._idle if m not in members]:
            self.forget(member)
        for member in [m for m in self._slots if m not in members]:
            del self._slots[member]

    def close(self) -> None:
        for member in list(self._idle):
            self.forget(member)
