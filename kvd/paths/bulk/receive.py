"""Receiving a bulk frame's bytes on the event loop (``kvd.paths.bulk.server``):
exact reads of non-blocking sockets (plain, or TLS: ``kvd.wire.tls_socket``),
a put's payload taken into pages only as its bytes arrive, and a refused
payload read and dropped."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from kvd.store.index import PutTicket
from kvd.util.aio import readable
from kvd.wire.bulk import ProtocolError
from kvd.wire.checksum import Hasher
from kvd.wire.tls_socket import TlsSocket, Wire, fionread, recv_some

# Payload of a request answered with an error is read into this and dropped.
DISCARD_BYTES = 1 << 20


async def recv_into_exact(
    loop: asyncio.AbstractEventLoop, sock: Wire, view: memoryview, hasher: Hasher | None
) -> None:
    """Fill ``view``; EOF first is a ProtocolError (a truncated frame)."""
    pos, size = 0, len(view)
    while pos < size:
        try:  # bytes already here: no coroutine made
            n = sock.recv_into(view[pos:])
        except BlockingIOError:  # a TLS session's waits (WantRead, WantWrite) too
            n = await recv_some(loop, sock, view[pos:])
        if n == 0:
            raise ProtocolError(f"connection ended inside a frame ({pos} of {size} bytes)")
        if hasher is not None:
            hasher.update(view[pos : pos + n])
        pos += n


def buffered(sock: Wire) -> int:
    """Bytes waiting in the socket's receive queue (FIONREAD, ~1 µs); over
    TLS, the plaintext waiting (``TlsSocket.buffered``)."""
    if isinstance(sock, TlsSocket):
        return sock.buffered()
    return fionread(sock)


async def receive_upload(
    loop: asyncio.AbstractEventLoop, sock: Wire, ticket: PutTicket, hasher: Hasher,
    grow: Callable[[PutTicket, int], Awaitable[list[memoryview]]],
) -> None:  # fmt: skip
    """Receive a payload that was not all there, taking pages (``grow``)
    only for the bytes in the socket's receive queue (recv_into straight
    into them)."""
    while ticket.covered_bytes < ticket.size:
        arrived = buffered(sock)
        if arrived == 0:
            await readable(loop, sock)
            arrived = buffered(sock)
            if arrived == 0 and not sock.recv(1, socket.MSG_PEEK):
                raise ProtocolError(
                    f"connection ended inside a frame "
                    f"({ticket.covered_bytes} of {ticket.size} payload bytes)"
                )
            continue
        left = ticket.size - ticket.covered_bytes
        for view in await grow(ticket, min(arrived, left)):
            await recv_into_exact(loop, sock, view, hasher)


async def discard(
    loop: asyncio.AbstractEventLoop, sock: Wire, nbytes: int, scratch: bytearray
) -> bytearray:
    """Read ``nbytes`` and drop them, through ``scratch`` (made, up to
    ``DISCARD_BYTES``, on first use); the scratch buffer, to keep."""
    if not scratch:
        scratch = bytearray(min(nbytes, DISCARD_BYTES))
    view = memoryview(scratch)
    while nbytes:
        take = min(nbytes, len(view))
        await recv_into_exact(loop, sock, view[:take], None)
        nbytes -= take
    return scratch
