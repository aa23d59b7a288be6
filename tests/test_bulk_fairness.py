"""The bulk port in process: a client's pipelined requests that are already
buffered are served one after the other without the reader waiting, so every
``FAIR_SHARE_REQUESTS`` of them the connection lets the event loop run other
work (other connections); a probe task on the loop counts the answers sent
between its turns."""

from __future__ import annotations

import os
import socket

from kvd.bulk import (
    FAIR_SHARE_REQUESTS,
    OP_GET,
    OP_HELLO,
    RESPONSE,
    BulkLimits,
    BulkServer,
    encode_request,
)
from kvd.checksum import checksum
from kvd.metrics import Metrics
from kvd.pool import Pool
from kvd.store import Store, StoreLimits
from tests.sockets import most_between_turns, recv_exact

REQUESTS = 2000
VALUE = os.urandom(100)


async def test_a_burst_of_buffered_gets_lets_other_work_run() -> None:
    store = Store(Pool(16 << 20), StoreLimits())
    await store.put("ns", b"k", VALUE, checksum=checksum(VALUE), hasher=checksum)
    metrics = Metrics()
    server = BulkServer(store, BulkLimits(), metrics)
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
