"""The bulk port's server in process. A client's pipelined requests that are
already buffered are served one after the other without the reader waiting,
so every ``FAIR_SHARE_REQUESTS`` of them the connection lets the event loop
run other work (a probe task counts the answers sent between its turns). A
connection closed while its reader waits for room in a full answer queue
leaves no value pinned. stop() at any turn of the loop, while a connection
that hung up ends or while one is being accepted, closes every socket. An
accept that fails (no descriptor left) does not close the port, and the
connections a stall leaves in the backlog do not crowd out new ones."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import socket
import warnings
from dataclasses import replace

from kvd.config.settings import Config
from kvd.l1.pool import Pool
from kvd.paths.bulk.server import (
    FAIR_SHARE_REQUESTS,
    OP_GET,
    OP_HELLO,
    QUEUE_FRAMES_MAX,
    RESPONSE,
    BulkLimits,
    BulkServer,
    encode_request,
)
from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import ServiceLimits
from kvd.paths.ops.values import ValueOps
from kvd.store.index import StoreLimits
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from tests.sockets import most_between_turns, recv_exact

REQUESTS = 2000
VALUE = os.urandom(100)


def values(store: Store, metrics: Metrics | None = None) -> ValueOps:
    """The op layer a bulk server calls, over ``store``."""
    return ValueOps(store, ServiceLimits.from_config(Config()), metrics or Metrics())


async def test_a_burst_of_buffered_gets_lets_other_work_run() -> None:
    store = Store(Pool(16 << 20), StoreLimits.from_config(Config()))
    await store.put("ns", b"k", VALUE, checksum=checksum(VALUE), hasher=checksum)
    metrics = Metrics()
    server = BulkServer(values(store, metrics), BulkLimits.from_config(Config()))
    port = await server.start("127.0.0.1", 0)
    sent = metrics.bytes.labels("bulk_get", "out")

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(encode_request(OP_HELLO, 0))
            recv_exact(sock, RESPONSE.size)
            frames = [encode_request(OP_GET, i, b"ns", b"k") for i in range(REQUESTS)]
            sock.sendall(b"".join(frames))
            for i in range(REQUESTS):
                head = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
                assert (head[4], head[5]) == (i, 0)  # in order, OK
                assert recv_exact(sock, head[6] + head[7] + head[8])[-len(VALUE) :] == VALUE

    try:
        most = await most_between_turns(lambda: sent._value.get() / len(VALUE), client)
    finally:
        await server.stop()
    assert sent._value.get() == REQUESTS * len(VALUE)
    assert most <= FAIR_SHARE_REQUESTS


async def test_closing_with_a_full_answer_queue_leaves_nothing_pinned() -> None:
    store = Store(Pool(16 << 20), StoreLimits.from_config(Config()))
    big = os.urandom(6 << 20)
    await store.put("ns", b"big", big, checksum=checksum(big), hasher=checksum)
    await store.put("ns", b"k", VALUE, checksum=checksum(VALUE), hasher=checksum)
    server = BulkServer(values(store), BulkLimits.from_config(Config()))
    port = await server.start("127.0.0.1", 0)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(encode_request(OP_HELLO, 0))
        await asyncio.to_thread(recv_exact, sock, RESPONSE.size)  # the loop must answer
        # The big answer fills the socket and the writer waits (nothing is read);
        # the small ones then fill the answer queue and the reader waits too.
        frames = [encode_request(OP_GET, 0, b"ns", b"big")]
        frames += [encode_request(OP_GET, i, b"ns", b"k") for i in range(1, QUEUE_FRAMES_MAX + 50)]
        await asyncio.to_thread(sock.sendall, b"".join(frames))
        entry = store._l1("ns", b"k")
        assert entry is not None
        for _ in range(200):
            if entry.readers > QUEUE_FRAMES_MAX:
                break
            await asyncio.sleep(0.01)
        assert entry.readers == QUEUE_FRAMES_MAX + 1  # queued ones and the one waiting
    finally:
        await server.stop()
        sock.close()
    assert entry.readers == 0
    big_entry = store._l1("ns", b"big")
    assert big_entry is not None and big_entry.readers == 0


async def _stop_at_each_turn(hello: bool) -> list[str]:
    """For 0..39 turns of the loop after a client connected (and, with
    ``hello``, was answered and hung up): stop the server; the unclosed-socket
    warnings meanwhile."""
    store = Store(Pool(1 << 20), StoreLimits.from_config(Config()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for turns in range(40):
            server = BulkServer(values(store), BulkLimits.from_config(Config()))
            port = await server.start("127.0.0.1", 0)
            await asyncio.sleep(0)  # the server waits for a connection
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                if hello:
                    sock.sendall(encode_request(OP_HELLO, 0))
                    await asyncio.to_thread(recv_exact, sock, RESPONSE.size)
                    sock.close()
                for _ in range(turns):
                    await asyncio.sleep(0)
                await server.stop()
            gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_stop_as_a_hung_up_connection_ends_closes_its_socket() -> None:
    assert await _stop_at_each_turn(hello=True) == []


async def test_stop_as_a_client_connects_closes_its_socket() -> None:
    assert await _stop_at_each_turn(hello=False) == []


class _OutOfDescriptors(socket.socket):
    """The server's own listening socket, whose first accepts fail as they do
    when the process has no descriptor left."""

    failures = 3

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


async def test_the_port_outlives_accepts_that_fail() -> None:
    store = Store(Pool(1 << 20), StoreLimits.from_config(Config()))
    server = BulkServer(values(store), BulkLimits.from_config(Config()))
    port = await server.start("127.0.0.1", 0)
    assert server._accept_task is not None and server._listener is not None
    server._accept_task.cancel()
    await asyncio.gather(server._accept_task, return_exceptions=True)
    listener = _OutOfDescriptors(fileno=server._listener.detach())
    server._listener = listener
    server._accept_task = asyncio.create_task(server._accept_loop(listener))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(encode_request(OP_HELLO, 0))
            answer = await asyncio.to_thread(recv_exact, sock, RESPONSE.size)
        assert RESPONSE.unpack(answer)[5] == 0  # served once descriptors are back
        assert listener.failures == 0 and not server._accept_task.done()
    finally:
        await server.stop()


async def test_connections_left_behind_by_a_stall_do_not_crowd_out_new_ones() -> None:
    limits = replace(BulkLimits.from_config(Config()), max_connections=8)
    server = BulkServer(values(Store(Pool(1 << 20), StoreLimits.from_config(Config()))), limits)
    port = await server.start("127.0.0.1", 0)
    try:
        # The loop is stuck (a stalled daemon): clients connect, give up, close.
        for _ in range(40):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(encode_request(OP_HELLO, 0))
            answer = await asyncio.to_thread(recv_exact, sock, RESPONSE.size)
        assert RESPONSE.unpack(answer)[5] == 0  # served, not refused as over the limit
    finally:
        await server.stop()
