"""TLS on the bulk port (``bulk_tls``): a non-blocking TLS connection that
answers the few socket calls the bulk port's server and its pool clients
make, and the waits around them on the event loop.

asyncio's ``sock_*`` calls speak no TLS, and the bulk port moves values
between sockets and pool pages without a transport's buffers.
So a ``TlsSocket`` answers ``recv_into`` and ``send`` as a non-blocking
socket does, raising ``BlockingIOError`` where it must wait: ``WantRead``
or ``WantWrite`` says for what (TLS may have to write before it reads);
``recv_some`` and ``send_whole`` wait with the loop's readers and writers for
either kind of socket, a plain one through the loop's own ``sock_*`` calls.

- OpenSSL works between two memory buffers (``ssl.MemoryBIO``); ciphertext
  moves to and from the socket ``RECV_BYTES`` / ``TLS_SEND_BYTES`` at a
  time. Given the socket itself (``ssl.SSLSocket``) it made two system
  calls per 16 KiB record read and one per record written: a member
  reading 4 MiB values from another spent 3.5-3.6 ms of CPU per value
  (the owner 3.3-3.4), against 2.2-2.3 (2.4-2.5) this way, on the
  development VM (docs/pool.md, "Authentication and what travels in clear").
- ``recv_into`` decrypts every record already here into the caller's view
  in one call (OpenSSL decrypts one record per read).
- What the kernel says is queued (FIONREAD) counts records, headers and
  tags included: ``buffered`` adds it to the plaintext OpenSSL holds, which
  overstates the plaintext by at most a record's overhead (~22 bytes) per
  16 KiB.
- A TLS session may not be used from two threads at once: a TLS answer is
  sent from the loop (``kvd.wire.send``), never from a send thread.
- No session tickets (``num_tickets`` 0): nothing resumes a session, and a
  ticket the client has not read yet would look, to an idle connection's
  check (a peek of the socket, ``recv``), like a byte out of step.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import ssl
import struct
import termios
from typing import cast

from kvd.util.aio import readable, writable
from kvd.util.memfile import load_chain

# Ciphertext read from the socket at a time: one system call for 16 records.
RECV_BYTES = 256 << 10
# Plaintext encrypted at a time, and the ciphertext a connection holds
# unsent before it waits for room.
TLS_SEND_BYTES = 1 << 20


class WantRead(BlockingIOError):
    """TLS needs the socket readable first."""


class WantWrite(BlockingIOError):
    """TLS needs the socket writable first."""


class TlsSocket:
    """A TCP socket's TLS session, non-blocking: OpenSSL works between two
    memory buffers, and this class moves their ciphertext to and from the
    socket in large pieces."""

    def __init__(self, raw: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:  # fmt: skip
        self.raw = raw
        self.tls = tls
        self._in = incoming
        self._out = outgoing
        self._scratch = memoryview(bytearray(RECV_BYTES))
        self._unsent = memoryview(b"")  # ciphertext taken from OpenSSL, not yet sent

    @classmethod
    def wrap(
        cls, raw: socket.socket, context: ssl.SSLContext, server_name: str | None = None
    ) -> TlsSocket:
        """``raw`` (non-blocking; this object closes it) as the server's side,
        or the client's checking that the server's certificate names
        ``server_name``. Nothing is sent before ``handshake``."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(
            incoming, outgoing, server_side=server_name is None, server_hostname=server_name
        )
        return cls(raw, tls, incoming, outgoing)

    def fileno(self) -> int:
        return self.raw.fileno()

    def recv_into(self, view: memoryview) -> int:
        """Plaintext into ``view``, as much as has arrived (OpenSSL decrypts a
        record a call; the records already here go in one): its length; 0 at
        the end of the session."""
        got, size = 0, len(view)
        while got < size:
            try:
                # With a buffer, the count read (typeshed says bytes).
                got += cast(int, self.tls.read(size - got, view[got:]))
            except ssl.SSLWantReadError:
                try:
                    self._fill()
                except WantRead:
                    if got:
                        break
                    raise
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
        if self._out.pending:  # what a read made OpenSSL answer (a key update)
            with contextlib.suppress(WantWrite):
                self.flush()
        return got

    def send(self, view: memoryview) -> int:
        """Encrypt ``view`` (all of it), after sending what was encrypted
        before where that is ``TLS_SEND_BYTES`` or more; its ciphertext may
        wait for ``flush``."""
        if len(self._unsent) + self._out.pending >= TLS_SEND_BYTES:
            self.flush()
        return self.tls.write(view)

    def flush(self) -> None:
        """Send the ciphertext waiting; ``WantWrite`` while the socket is full."""
        while True:
            if not self._unsent:
                if not self._out.pending:
                    return
                self._unsent = memoryview(self._out.read())
            try:
                sent = self.raw.send(self._unsent)
            except BlockingIOError:
                raise WantWrite from None
            self._unsent = self._unsent[sent:]

    def _fill(self) -> None:
        """Ciphertext from the socket into OpenSSL; ``WantRead`` when none waits."""
        try:
            n = self.raw.recv_into(self._scratch)
        except BlockingIOError:
            raise WantRead from None
        if n == 0:
            self._in.write_eof()
        else:
            self._in.write(self._scratch[:n])

    def recv(self, size: int, flags: int = 0) -> bytes:
        """The raw socket's bytes (``MSG_PEEK``: is anything, or EOF, waiting?);
        a byte where ciphertext or plaintext waits here already."""
        if self._in.pending or self.tls.pending():
            return b"\0"
        return self.raw.recv(size, flags)

    def buffered(self) -> int:
        """Plaintext waiting, at most one record's overhead per 16 KiB over."""
        return self.tls.pending() + self._in.pending + fionread(self.raw)

    def close(self) -> None:
        self.raw.close()


Wire = socket.socket | TlsSocket


def fionread(sock: socket.socket) -> int:
    """Bytes waiting in the socket's receive queue (FIONREAD, ~1 µs)."""
    queued: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    return queued


async def handshake(loop: asyncio.AbstractEventLoop, sock: TlsSocket) -> None:
    """The TLS handshake; ``ssl.SSLError`` (an ``OSError``) when it fails,
    after the alert that says why is sent (best effort)."""
    while True:
        try:
            sock.tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            await flushed(loop, sock)
            try:
                sock._fill()
            except WantRead:
                await readable(loop, sock)
        except ssl.SSLError:
            with contextlib.suppress(OSError):
                sock.flush()
            raise
    await flushed(loop, sock)


async def flushed(loop: asyncio.AbstractEventLoop, sock: TlsSocket) -> None:
    """Once every byte encrypted so far has left."""
    while True:
        try:
            sock.flush()
            return
        except WantWrite:
            await writable(loop, sock)


async def recv_some(loop: asyncio.AbstractEventLoop, sock: Wire, view: memoryview) -> int:
    """Bytes into ``view`` once some are there: how many; 0 at EOF."""
    if isinstance(sock, TlsSocket):
        while True:
            try:
                return sock.recv_into(view)
            except WantWrite:
                await writable(loop, sock)
            except BlockingIOError:
                await readable(loop, sock)
    try:
        return sock.recv_into(view)
    except BlockingIOError:
        return await loop.sock_recv_into(sock, view)


async def send_whole(
    loop: asyncio.AbstractEventLoop, sock: Wire, data: bytes | memoryview, flush: bool = True
) -> None:
    """All of ``data``, waiting for room as needed; over TLS without
    ``flush`` the last of its ciphertext may wait for the next send."""
    if not isinstance(sock, TlsSocket):
        await loop.sock_sendall(sock, data)
        return
    view = memoryview(data).cast("B")
    for start in range(0, len(view), TLS_SEND_BYTES):
        while True:
            try:
                sock.send(view[start : start + TLS_SEND_BYTES])
                break
            except WantWrite:
                await writable(loop, sock)
    if flush:
        await flushed(loop, sock)


def server_context(cert: bytes, key: bytes, client_ca: bytes) -> ssl.SSLContext:
    """The bulk listener's TLS: its certificate chain and key and, with
    ``client_ca``, a client certificate it signed required (mTLS); the
    bytes as read and checked (``kvd.config.pem``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(context, cert, key)
    if client_ca:
        context.load_verify_locations(cadata=client_ca.decode("latin-1"))
        context.verify_mode = ssl.CERT_REQUIRED
    context.num_tickets = 0
    # A client's renegotiation (TLS 1.2) is refused with an alert, not left
    # to stall the connection, and never costs this daemon a second handshake.
    context.options |= ssl.OP_NO_RENEGOTIATION
    return context


def client_context(ca: bytes, cert: bytes = b"", key: bytes = b"") -> ssl.SSLContext:
    """A client's TLS: the server's certificate checked against the CA bundle
    ``ca`` (and the name asked for), and a client certificate where given;
    the bytes as read and checked (``kvd.config.pem``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=ca.decode("latin-1"))
    if cert:
        load_chain(context, cert, key)
    return context
