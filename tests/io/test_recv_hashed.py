"""A value received from a socket in native code (``kvd.io._uring.recv_hashed``,
what the bulk client receives large values with): over a socket pair and
over loopback TCP, in one view or several, sent whole or in slow pieces,
the bytes land in order and the digest is xxh3-64 of what landed; a peer
that closes early, one that stalls, a bad fd or a read-only buffer is a
status or an error, never a silent short value; the socket's SO_RCVLOWAT
is put back for the next reader."""

from __future__ import annotations

import errno
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import xxhash

from kvd.client.bulk import native_recv_hashed

recv_hashed = native_recv_hashed()
pytestmark = pytest.mark.skipif(recv_hashed is None, reason="kvd.io._uring is not built")

MiB = 1 << 20


def _recv(fd: int, views: list[memoryview], timeout_ms: int) -> tuple[int, int, int]:
    assert recv_hashed is not None
    return recv_hashed(fd, views, timeout_ms)


def _sender(sock: socket.socket, pieces: list[bytes], pause_s: float = 0.0) -> threading.Thread:
    def send() -> None:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(pause_s)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def _split(buffer: bytearray, cuts: list[int]) -> list[memoryview]:
    view = memoryview(buffer)
    edges = [0, *cuts, len(buffer)]
    return [view[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("kind", ["socketpair", "tcp"])
def test_a_value_lands_in_order_across_views(
    kind: str, tcp_pair: tuple[socket.socket, socket.socket]
) -> None:
    pair = socket.socketpair() if kind == "socketpair" else tcp_pair
    a, b = pair
    data = os.urandom(9 * MiB + 123)
    sender = _sender(a, [data[i : i + 700_000] for i in range(0, len(data), 700_000)])
    buffer = bytearray(len(data))
    status, received, digest = _recv(b.fileno(), _split(buffer, [1, 4096, 3 * MiB]), 5000)
    sender.join()
    if kind == "socketpair":
        a.close()
        b.close()
    assert (status, received) == (0, len(data))
    assert bytes(buffer) == data and digest == xxhash.xxh3_64_intdigest(data)
    if kind == "tcp":  # the wake-up mark it set while waiting is put back
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


def test_the_wait_is_for_the_next_bytes_not_the_whole_value() -> None:
    """Pieces 60 ms apart with a 200 ms timeout: 0.6 s in all, never a timeout."""
    a, b = socket.socketpair()
    with a, b:
        pieces = [os.urandom(10_000) for _ in range(10)]
        sender = _sender(a, pieces, pause_s=0.06)
        buffer = bytearray(100_000)
        status, received, _ = _recv(b.fileno(), [memoryview(buffer)], 200)
        sender.join()
        assert (status, received) == (0, 100_000) and bytes(buffer) == b"".join(pieces)


def test_a_peer_that_closes_early_is_eof_with_what_arrived() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(b"x" * 1000)
        a.close()
        status, received, digest = _recv(b.fileno(), [memoryview(bytearray(MiB))], 1000)
    assert recv_hashed is not None
    assert (status, received) == (1, 1000)  # RECV_EOF
    assert digest == xxhash.xxh3_64_intdigest(b"x" * 1000)


def test_a_peer_that_stalls_times_out(tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp_pair
    a.sendall(b"y" * 5000)
    started = time.monotonic()
    status, received, _ = _recv(b.fileno(), [memoryview(bytearray(MiB))], 150)
    waited = time.monotonic() - started
    assert (status, received) == (2, 5000)  # RECV_TIMEOUT
    assert 0.1 < waited < 2.0
    assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    a.sendall(b"z")  # the socket still reads from where it stopped
    assert b.recv(1) == b"z"


def test_timeout_zero_takes_only_what_is_there() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abc")
        buffer = bytearray(10)
        status, received, _ = _recv(b.fileno(), [memoryview(buffer)], 0)
        assert (status, received, bytes(buffer[:3])) == (2, 3, b"abc")


def test_bad_arguments_are_refused_before_anything_is_read() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"keep")
        with pytest.raises((BufferError, TypeError)):
            _recv(b.fileno(), [memoryview(b"read-only")], 100)
        with pytest.raises(ValueError):
            _recv(b.fileno(), [memoryview(bytearray(4))], -1)
        with pytest.raises(TypeError):
            _recv(b.fileno(), 5, 100)  # type: ignore[arg-type]
        assert b.recv(4) == b"keep"  # nothing was read by the refused calls
        status, received, _ = _recv(b.fileno(), [], 100)
        assert (status, received) == (0, 0)
    closed = socket.socket()
    fd = closed.fileno()
    closed.close()
    status, _, _ = _recv(fd, [memoryview(bytearray(4))], 100)
    assert status == -errno.EBADF


def test_the_client_reads_the_same_statuses() -> None:
    from kvd.client import bulk
    from kvd.io import _uring

    assert (bulk.RECV_EOF, bulk.RECV_TIMEOUT) == (_uring.RECV_EOF, _uring.RECV_TIMEOUT)
