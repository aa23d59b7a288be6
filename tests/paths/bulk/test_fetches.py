"""GETs on the bulk port of values not in L1 (on L2, or at a pool member
that owns them: the store's miss hook) are read while the connection goes
on reading frames. A client's pipelined GETs of such values are all being
read at once, at most ``FETCHES_MAX``, and their answers still leave in
request order, behind and before values in L1. A client that stops reading
its answers pins no more than that many such values. A server stopped while
the reads run, or just after some ended, leaves no value pinned.

The miss hook here is the store's own interface, played as a pool's router
plays it: the value arrives from elsewhere (put into the store) once the
test lets it, then is opened for the GET."""

from __future__ import annotations

import asyncio
import socket

from kvd.config.settings import Config
from kvd.l1.pool import Pool
from kvd.paths.bulk.fetches import FETCHES_MAX
from kvd.paths.bulk.server import OP_GET, OP_HELLO, RESPONSE, BulkLimits, BulkServer
from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import ServiceLimits
from kvd.paths.ops.values import ValueOps
from kvd.store.index import Reader, StoreLimits
from kvd.store.store import Store
from kvd.wire.bulk import CODE_NOT_FOUND, encode_request
from kvd.wire.checksum import checksum
from tests.sockets import recv_exact


def value_of(key: bytes, size: int = 4096) -> bytes:
    return key * (size // len(key))


class Elsewhere:
    """The store's miss hook: each value asked arrives once ``release`` is
    set (``None`` for the keys in ``absent``); the keys asked, in order."""

    def __init__(
        self, store: Store, absent: frozenset[bytes] = frozenset(), size: int = 4096
    ) -> None:
        self.store = store
        self.absent = absent
        self.size = size
        self.asked: list[bytes] = []
        self.release = asyncio.Event()

    async def __call__(self, ns: str, key: bytes) -> Reader | None:
        self.asked.append(key)
        await self.release.wait()
        if key in self.absent:
            return None
        value = value_of(key, self.size)
        await self.store.put(ns, key, value, checksum=checksum(value), hasher=checksum)
        return self.store.open(ns, key)


async def serving(store: Store) -> tuple[BulkServer, int]:
    values = ValueOps(store, ServiceLimits.from_config(Config()), Metrics())
    server = BulkServer(values, BulkLimits.from_config(Config()))
    return server, await server.start("127.0.0.1", 0)


async def connected(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(encode_request(OP_HELLO, 0))
    await asyncio.to_thread(recv_exact, sock, RESPONSE.size)
    return sock


async def send_gets(sock: socket.socket, keys: list[bytes]) -> None:
    """A GET of each key, pipelined (request ids 0, 1, ...)."""
    frames = [encode_request(OP_GET, i, b"ns", key) for i, key in enumerate(keys)]
    await asyncio.to_thread(sock.sendall, b"".join(frames))


def answers(sock: socket.socket, count: int) -> list[tuple[int, int, bytes]]:
    """``count`` answers: (request id, code, value)."""
    got = []
    for _ in range(count):
        head = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        rest = recv_exact(sock, head[6] + head[7] + head[8])
        got.append((head[4], head[5], rest[head[6] + head[7] :]))
    return got


async def asked(hook: Elsewhere, count: int) -> None:
    """Once ``count`` values were asked of the hook."""
    async with asyncio.timeout(10):
        while len(hook.asked) < count:
            await asyncio.sleep(0.005)


def pins(store: Store, keys: list[bytes]) -> int:
    entries = (store._l1("ns", key) for key in keys)
    return sum(entry.readers for entry in entries if entry is not None)


async def test_pipelined_gets_of_values_elsewhere_are_read_at_once_and_answered_in_order() -> None:
    store = Store(Pool(16 << 20), StoreLimits.from_config(Config()))
    here = b"here-0"
    await store.put("ns", here, value_of(here), checksum=checksum(value_of(here)), hasher=checksum)
    elsewhere = [b"away-%d" % i for i in range(8)]
    hook = store.on_miss = Elsewhere(store, absent=frozenset({elsewhere[3]}))
    server, port = await serving(store)
    sock = await connected(port)
    try:
        keys = [elsewhere[0], here, *elsewhere[1:], here]
        await send_gets(sock, keys)
        # Every value elsewhere is asked for before any arrived.
        await asked(hook, len(elsewhere))
        assert hook.asked == elsewhere
        hook.release.set()
        got = await asyncio.to_thread(answers, sock, len(keys))
    finally:
        sock.close()
        await server.stop()
    assert [rid for rid, _, _ in got] == list(range(len(keys)))  # in request order
    for key, (_, code, value) in zip(keys, got, strict=True):
        if key == elsewhere[3]:
            assert (code, value) == (CODE_NOT_FOUND, b"")
        else:
            assert (code, value) == (0, value_of(key))
    assert pins(store, keys) == 0


async def test_at_most_fetches_max_reads_run_for_one_connection() -> None:
    store = Store(Pool(16 << 20), StoreLimits.from_config(Config()))
    keys = [b"away-%d" % i for i in range(FETCHES_MAX + 4)]
    hook = store.on_miss = Elsewhere(store)
    server, port = await serving(store)
    sock = await connected(port)
    try:
        await send_gets(sock, keys)
        await asked(hook, FETCHES_MAX)
        await asyncio.sleep(0.2)  # the reader waits for room: no more are asked
        assert len(hook.asked) == FETCHES_MAX
        hook.release.set()
        got = await asyncio.to_thread(answers, sock, len(keys))
    finally:
        sock.close()
        await server.stop()
    assert hook.asked == keys
    assert got == [(i, 0, value_of(key)) for i, key in enumerate(keys)]
    assert pins(store, keys) == 0


async def test_a_client_that_stops_reading_pins_at_most_fetches_max_values() -> None:
    size = 12 << 20  # three fill the socket's buffers (tcp_rmem and tcp_wmem at most)
    limits = StoreLimits.from_config(Config())
    store = Store(Pool(24 * size), limits)
    keys = [b"away-%02d" % i for i in range(40)]
    hook = store.on_miss = Elsewhere(store, size=size)
    hook.release.set()
    server, port = await serving(store)
    sock = await connected(port)
    try:
        await send_gets(sock, keys)  # and never reads
        await asked(hook, FETCHES_MAX)
        while True:  # until the connection stops reading values
            before = len(hook.asked)
            await asyncio.sleep(0.3)
            if len(hook.asked) == before:
                break
        assert len(hook.asked) < len(keys)
        assert pins(store, keys) <= FETCHES_MAX + 1  # read and waiting, and the one sending
    finally:
        sock.close()
        await server.stop()
    assert pins(store, keys) == 0


async def test_a_server_stopped_as_reads_end_leaves_nothing_pinned() -> None:
    for turns in range(0, 12, 2):
        store = Store(Pool(16 << 20), StoreLimits.from_config(Config()))
        keys = [b"away-%d" % i for i in range(6)]
        hook = store.on_miss = Elsewhere(store)
        server, port = await serving(store)
        sock = await connected(port)
        try:
            await send_gets(sock, keys)
            await asked(hook, len(keys))
            hook.release.set()
            for _ in range(turns):  # some reads ended, not all sent
                await asyncio.sleep(0)
        finally:
            await server.stop()
            sock.close()
        await asyncio.sleep(0.05)  # reads cancelled as they ended unpin then
        assert pins(store, keys) == 0, f"stopped {turns} turns after the values arrived"
