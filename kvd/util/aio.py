"""Waiting for work that must end before its waiter returns, even cancelled,
and for a non-blocking socket to become readable.

A kernel read into pool pages, a copy thread, a send thread, a task still
using a socket: returning while one of them runs hands its memory or socket
back too early. ``settle`` waits through any number of cancels, then
re-raises the last one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Fileno(Protocol):
    """A socket, or what wraps one (``kvd.wire.tls_socket.TlsSocket``)."""

    def fileno(self) -> int: ...


async def settle(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every future is done; a cancel meanwhile is re-raised after.

    The futures' results and errors are the caller's to read; none is raised
    here, and asyncio does not warn about the ones nobody reads.
    """
    cancelled: asyncio.CancelledError | None = None
    # Each pass either finishes or absorbs one cancel request; the work ends
    # by itself (the device answers, the thread returns), which bounds them.
    while True:
        pending = [future for future in futures if not future.done()]
        if not pending:
            break
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError as exc:
            cancelled = exc
    for future in futures:
        if not future.cancelled():
            future.exception()  # marks it read
    if cancelled is not None:
        raise cancelled


async def readable(loop: asyncio.AbstractEventLoop, sock: Fileno) -> None:
    """Return once ``sock`` has something to read (or to accept)."""
    await _ready(sock, loop.add_reader, loop.remove_reader, loop)


async def writable(loop: asyncio.AbstractEventLoop, sock: Fileno) -> None:
    """Return once ``sock`` has room to send."""
    await _ready(sock, loop.add_writer, loop.remove_writer, loop)


async def _ready(
    sock: Fileno,
    watch: Callable[..., object],
    unwatch: Callable[[int], object],
    loop: asyncio.AbstractEventLoop,
) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    watch(sock.fileno(), wake)
    try:
        await ready
    finally:
        unwatch(sock.fileno())
