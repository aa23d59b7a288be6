"""Sending GET answers on the bulk port: on the event loop, or from send threads.

The kernel copies a payload into the socket in the thread that calls send:
~1 ms per 4 MiB on a small VM. Done on the event loop, that caps all bulk
connections together at one core's copy rate. So a large payload is sent
from one of ``SEND_THREADS`` threads while another connection is already
sending, on a machine with cores to spare (``kvd.util.cpus``); a lone send stays
on the loop, where it costs no hand-off.

Either way an answer has ``timeout_s`` (``bulk_frame_timeout_ms``) to leave;
a client that stops reading loses its connection after that. A cancelled
send (the connection or the daemon closing) shuts the socket down, which
ends the thread's send at once, and returns only once the thread let go of
the payload: the payload is pool pages that are unpinned after the send.

Over TLS (``bulk_tls``, ``kvd.wire.tls_socket``) every answer is sent from
the loop: OpenSSL encrypts as it sends, and a TLS session may not be used
by two threads at once (the loop reads the next request meanwhile).
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvd.util.aio import settle
from kvd.util.cpus import OFFLOAD, WORKER_THREADS
from kvd.wire.tls_socket import TlsSocket, Wire, send_whole

# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
IOV_MAX = 1024
# Payloads from this size go to a send thread when another send is under way.
THREAD_SEND_BYTES = 1 << 20
SEND_THREADS = WORKER_THREADS
_POLL_S = 1.0
_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL


async def send_parts(
    loop: asyncio.AbstractEventLoop, sock: Wire, parts: list[memoryview], timeout_s: float
) -> None:
    """Send ``parts`` in order from the loop: sendmsg, and sock_sendall for what
    the socket did not take at once (only then is the deadline armed); over
    TLS, each part in turn within the deadline."""
    deadline = time.monotonic() + timeout_s
    if isinstance(sock, TlsSocket):
        try:
            async with asyncio.timeout(timeout_s):
                for i, part in enumerate(parts):  # one flush: the header goes with the value
                    await send_whole(loop, sock, part, flush=i == len(parts) - 1)
        except TimeoutError:
            raise _late(timeout_s) from None
        return
    index = 0
    while index < len(parts):
        try:
            sent = sock.sendmsg(parts[index : index + IOV_MAX])
        except BlockingIOError:
            sent = 0
        index, sent = _skip_sent(parts, index, sent)
        if index < len(parts):
            rest = loop.sock_sendall(sock, parts[index][sent:])
            try:
                await asyncio.wait_for(rest, deadline - time.monotonic())
            except TimeoutError:
                raise _late(timeout_s) from None
            index += 1


def send_blocking(sock: socket.socket, parts: list[memoryview], timeout_s: float) -> None:
    """Send ``parts`` in order from a worker thread on a non-blocking socket.
    TimeoutError when they have not all left within ``timeout_s``."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    deadline = time.monotonic() + timeout_s
    send_all(sock, parts, lambda: _wait_writable(poller, deadline - time.monotonic(), timeout_s))


def send_all(sock: socket.socket, parts: list[memoryview], when_full: Callable[[], None]) -> None:
    """Send ``parts`` in order with sendmsg; ``when_full()`` runs each time the
    socket takes nothing (a non-blocking one with a full buffer): it waits for
    room or raises."""
    pending = [part for part in parts if len(part)]
    index = 0
    while index < len(pending):
        try:
            sent = sock.sendmsg(pending[index : index + IOV_MAX])
        except BlockingIOError:
            when_full()
            continue
        index, sent = _skip_sent(pending, index, sent)
        if sent:
            pending[index] = pending[index][sent:]


def _skip_sent(parts: list[memoryview], index: int, sent: int) -> tuple[int, int]:
    """After ``sent`` bytes from ``parts[index:]`` left: the first part not
    wholly sent, and how many of its bytes did."""
    while index < len(parts) and sent >= len(parts[index]):
        sent -= len(parts[index])
        index += 1
    return index, sent


def _wait_writable(poller: select.poll, left_s: float, timeout_s: float) -> None:
    if left_s <= 0:
        raise _late(timeout_s)
    for _, events in poller.poll(min(_POLL_S, left_s) * 1000):
        if events & _BROKEN and not events & select.POLLOUT:
            raise ConnectionResetError("connection closed while sending")


def _late(timeout_s: float) -> TimeoutError:
    return TimeoutError(f"client did not read its answer within {timeout_s:g} s")


class Sender:
    """Sends payloads for every connection of one bulk server."""

    def __init__(
        self, timeout_s: float, threads: int = SEND_THREADS, offload: bool = OFFLOAD
    ) -> None:
        self.timeout_s = timeout_s
        self.offload = offload  # kvd.util.cpus: only where cores are left over
        self.sending = 0  # sends under way, on the loop or on threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvd-send")

    async def send(self, sock: Wire, parts: list[memoryview], nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        busy = self.sending > 0
        self.sending += 1
        try:
            small = nbytes < THREAD_SEND_BYTES
            if small or not busy or not self.offload or isinstance(sock, TlsSocket):
                await send_parts(loop, sock, parts, self.timeout_s)
                return
            sending = loop.run_in_executor(self._pool, send_blocking, sock, parts, self.timeout_s)
            try:
                await asyncio.shield(sending)
            except asyncio.CancelledError:
                # The payload is pool pages: wait until the thread let go of
                # them (the shutdown ends its send at once; its error is dropped).
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the client
                await settle([sending])
                raise
        finally:
            self.sending -= 1

    def close(self) -> None:
        """Stop taking sends; a thread still sending ends with its socket (shut down
        by its cancelled writer) or its timeout."""
        self._pool.shutdown(wait=False)
