"""Descriptors over the shm socket's Unix connections: the memfd a
REGION_ATTACH brings (SCM_RIGHTS on its first frame, read with room for one)
and the pool's read-only memfd a POOL_ATTACH answer takes back
(``kvd.paths.shm.channel``)."""

from __future__ import annotations

import array
import asyncio
import os
import socket

from kvd.util.aio import readable, writable
from kvd.wire.bulk import ProtocolError


async def recv_with_fds(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, nbytes: int, fds: list[int]
) -> bytes:
    """Exactly ``nbytes`` from a non-blocking ``conn``, adding to ``fds`` the
    descriptors that come with them (room for one: more is a ProtocolError)."""
    data = bytearray()
    while len(data) < nbytes:
        try:
            got, ancillary, flags, _ = conn.recvmsg(nbytes - len(data), socket.CMSG_SPACE(4))
        except BlockingIOError:
            await readable(loop, conn)
            continue
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = array.array("i")
                passed.frombytes(payload[: len(payload) - len(payload) % passed.itemsize])
                fds.extend(passed)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("more than one descriptor passed")
        if not got:
            raise asyncio.IncompleteReadError(bytes(data), nbytes)
        data += got
    return bytes(data)


async def send_with_fd(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes, fd: int
) -> None:
    """Send ``data`` on a non-blocking ``conn`` with ``fd`` as SCM_RIGHTS on its first byte."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    while True:
        try:
            sent = conn.sendmsg([data], rights)
            break
        except BlockingIOError:
            await writable(loop, conn)
    if sent < len(data):
        await loop.sock_sendall(conn, data[sent:])


def close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())
