"""Races forced, not hoped for: each test parks one side of a race at a
chosen await (an L2 read or write held by a gate in the io backend, a reader
pinned, a put ticket half filled) and runs the other side to completion
before letting the first go on.

The races, and the KV-cache bugs elsewhere that they anchor:

- a get during eviction, and eviction while a get's L2 read is in flight;
- a get whose L2 read is in flight while reclaim wants that very segment;
- lookup with a lease, then eviction pressure, then get: the lease holds
  (and without a lease the value leaves: a page evicted between exists and
  get, sglang PR#31108, is a miss or right bytes, never wrong ones);
- two puts of one key at once (in-process and from two clients over bulk
  TCP): one wins, the other is a no-op or ALREADY_EXISTS, the bytes are the
  winner's;
- a get of a value still being written sees nothing (LMCache#207);
- a failed or abandoned put leaves nothing visible (LMCache#4991);
- delete during a get from L1, during its L2 read, and during the value's
  write-back (the record must not come back, even after recovery).

The store runs in-process over real O_DIRECT files (threads backend).
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvd.client import AlreadyExists, Client
from kvd.config.settings import Config
from kvd.io.backend import IoBackend, IoOp, OpKind
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.records import SegmentState
from kvd.l2.tier import L2Tier
from kvd.paths.bulk import server as bulk
from kvd.store import placement
from kvd.store.index import TIER_L1, TIER_L2, PutResult, PutTicket, StoreLimits
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from kvd.wire.errors import ResourceExhausted, Unavailable
from tests.l2 import MiB, backend, open_devices
from tests.support import DaemonProcess

pytestmark = pytest.mark.fault

NS = "races"
# One pool page, and with its L2 header exactly one 64 KiB L2 record.
VALUE_BYTES = 40_000
POOL_PAGES = 8
SEGMENTS = 3
SEGMENT_BYTES = MiB  # a marker and 15 records
WAIT_S = 10.0  # bound on every await of the other side of a race


def value_for(key: bytes, size: int = VALUE_BYTES) -> bytes:
    return random.Random(key).randbytes(size)


class Gate:
    """An io backend that parks the next op of one kind until released."""

    name = "gate"

    def __init__(self, inner: IoBackend) -> None:
        self.inner = inner
        self.hold: OpKind | None = None
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.fail_writes = False
        self.reads = 0

    def arm(self, kind: OpKind) -> None:
        self.hold = kind
        self.entered.clear()
        self.release.clear()

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        kinds = {op.kind for op in ops}
        self.reads += OpKind.READ in kinds
        if self.hold is not None and self.hold in kinds:
            self.hold = None  # one op only
            self.entered.set()
            await asyncio.wait_for(self.release.wait(), WAIT_S)
        if self.fail_writes and OpKind.WRITE in kinds:
            return [-errno.EIO] * len(ops)
        return await self.inner.submit_many(ops)

    async def read(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return (await self.submit_many([IoOp(OpKind.READ, fd, offset, bufs)]))[0]

    async def write(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return (await self.submit_many([IoOp(OpKind.WRITE, fd, offset, bufs)]))[0]

    async def fsync(self, fd: int, *, data_only: bool = False) -> None:
        await self.inner.fsync(fd, data_only=data_only)

    def close(self) -> None:
        self.inner.close()


class Clock:
    """Monotonic time plus a shift the test can add (lease expiry)."""

    def __init__(self) -> None:
        self.shift_s = 0.0

    def __call__(self) -> float:
        return asyncio.get_running_loop().time() + self.shift_s


class Rig:
    """A store with L2 over one O_DIRECT file; reopenable (a restart)."""

    def __init__(self, root: Path) -> None:
        self.path = str(root / "ssd.dat")
        self.clock = Clock()
        self.store: Store
        self.gate: Gate
        self.tier: L2Tier

    async def open(self) -> Store:
        self.devices = open_devices([self.path], segments=SEGMENTS, segment_bytes=SEGMENT_BYTES)
        self.gate = Gate(backend("threads"))
        self.tier = L2Tier(self.devices, self.gate)
        await self.tier.recover()
        self.pool = Pool(POOL_PAGES * PAGE_BYTES)
        limits = StoreLimits.from_config(Config())
        self.store = Store(self.pool, limits, clock=self.clock, l2=self.tier)
        self.store.start()
        return self.store

    async def close(self) -> None:
        self.gate.release.set()
        await self.store.close(flush_s=1.0)
        self.tier.close()
        self.gate.close()
        self.devices.close()
        self.pool.close()

    async def put(self, key: bytes, *, parent: bytes | None = None, flush: bool = True) -> None:
        value = value_for(key)
        await asyncio.wait_for(
            self.store.put(NS, key, value, parent=parent, checksum=checksum(value),
                           hasher=checksum),
            WAIT_S,
        )  # fmt: skip
        if flush:
            await self.flush()

    async def flush(self) -> None:
        assert self.store.writeback is not None
        assert await self.store.writeback.flush(WAIT_S) == 0, "write-back did not drain"

    async def read(self, key: bytes) -> tuple[bytes, int] | None:
        reader = await asyncio.wait_for(self.store.fetch(NS, key), WAIT_S)
        if reader is None:
            return None
        try:
            return b"".join(reader.views), reader.tier
        finally:
            reader.close()

    async def pressure(self, tag: str, count: int) -> None:
        """Puts of ``count`` fresh values (more than L1 holds), each written to L2."""
        for i in range(count):
            await self.put(b"%s-%04d" % (tag.encode(), i))


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path)
    await rig.open()
    try:
        yield rig
    finally:
        await rig.close()


def right_or_miss(key: bytes, got: tuple[bytes, int] | None) -> None:
    assert got is None or got[0] == value_for(key), f"wrong bytes for {key!r}"


# ---- get vs eviction ---------------------------------------------------------------
async def test_get_during_eviction_keeps_its_pages(rig: Rig) -> None:
    store = rig.store
    await rig.put(b"a")
    reader = await store.fetch(NS, b"a")
    assert reader is not None
    try:
        evictions = store.counters.evictions
        await rig.pressure("p", 3 * POOL_PAGES)  # every other value is evicted around it
        assert store.counters.evictions - evictions >= 2 * POOL_PAGES
        assert not store.evict(NS, b"a"), "a value with a reader was evictable"
        assert b"".join(reader.views) == value_for(b"a"), "pages reused under a reader"
    finally:
        reader.close()
    assert store.evict(NS, b"a")
    assert await rig.read(b"a") == (value_for(b"a"), TIER_L2)


async def test_eviction_during_promotion_read(rig: Rig) -> None:
    """Pressure while a get's L2 read is parked: the read's pages are its own;
    a second get of the key shares the one read."""
    store = rig.store
    await rig.put(b"a")
    assert store.evict(NS, b"a")
    reads = rig.gate.reads
    rig.gate.arm(OpKind.READ)
    first = asyncio.create_task(rig.read(b"a"))
    await asyncio.wait_for(rig.gate.entered.wait(), WAIT_S)
    second = asyncio.create_task(rig.read(b"a"))
    await rig.pressure("p", 2 * POOL_PAGES)
    rig.gate.release.set()
    assert await first == (value_for(b"a"), TIER_L2)
    assert (await second)[0] == value_for(b"a")  # type: ignore[index]
    assert rig.gate.reads - reads == 1, "two L2 reads for one key"


# ---- get vs L2 reclaim of the same segment -------------------------------------------
async def test_get_during_reclaim_of_its_segment(rig: Rig) -> None:
    store, tier = rig.store, rig.tier
    await rig.put(b"a")
    record = tier.lookup(NS, b"a")
    assert record is not None
    segment = tier.segments[record.segment]
    generation = segment.generation
    assert store.evict(NS, b"a")
    rig.gate.arm(OpKind.READ)
    getting = asyncio.create_task(rig.read(b"a"))
    await asyncio.wait_for(rig.gate.entered.wait(), WAIT_S)
    # Enough appends to wrap the log: every other segment is reclaimed, a's never.
    await rig.pressure("p", 2 * SEGMENTS * 15)
    assert tier.counters.reclaims >= 2
    assert segment.state is not SegmentState.FREE and segment.generation == generation, (
        "reclaimed a segment with a read in flight"
    )
    assert record.live
    rig.gate.release.set()
    assert await getting == (value_for(b"a"), TIER_L2)
    # Once the read is done its segment goes like any other: a miss, never wrong bytes.
    await rig.pressure("q", 2 * SEGMENTS * 15)
    assert segment.generation != generation
    right_or_miss(b"a", await rig.read(b"a"))


# ---- lease vs eviction and reclaim ---------------------------------------------------
async def test_lease_holds_through_eviction_pressure(rig: Rig) -> None:
    store = rig.store
    chain = [b"c%d" % i for i in range(3)]
    for i, key in enumerate(chain):
        await rig.put(key, parent=chain[i - 1] if i else None)
    unleased = b"u"
    await rig.put(unleased)
    result = store.lookup(NS, chain, lease_ms=30_000)
    assert result.prefix_len == 3 and result.l1_hits == 3 and result.lease_id
    assert store.exists(NS, [unleased]) == [True]
    await rig.pressure("p", 3 * POOL_PAGES)
    for key in chain:
        assert await rig.read(key) == (value_for(key), TIER_L1), "leased value left L1"
    # The value checked with exists but not leased was evicted in between
    # (sglang PR#31108): its get is served from L2, with its own bytes.
    assert await rig.read(unleased) == (value_for(unleased), TIER_L2)
    # Once the lease expires the chain is evictable like anything else.
    rig.clock.shift_s += 31
    await rig.pressure("q", POOL_PAGES + 2)  # 38 records in all: no L2 reclaim yet
    assert store.active_leases == 0
    assert [(await rig.read(k))[1] for k in chain] == [TIER_L2] * 3  # type: ignore[index]


async def test_lease_on_l2_record_holds_through_reclaim(rig: Rig) -> None:
    store, tier = rig.store, rig.tier
    await rig.put(b"a")
    await rig.pressure("f", 14)  # fills a's segment: b lands in the next one
    await rig.put(b"b")
    for key in (b"a", b"b"):
        store.evict(NS, key)
    assert tier.lookup(NS, b"a").segment != tier.lookup(NS, b"b").segment  # type: ignore[union-attr]
    result = store.lookup(NS, [b"a"], lease_ms=30_000)
    assert result.prefix_len == 1 and result.l2_hits == 1
    await rig.pressure("p", 2 * SEGMENTS * 15)
    assert tier.counters.reclaims >= 2
    assert tier.lookup(NS, b"b") is None, "the unleased record should have been reclaimed"
    assert await rig.read(b"b") is None
    assert await rig.read(b"a") == (value_for(b"a"), TIER_L2)
    assert store.release(result.lease_id)


# ---- two puts of one key ----------------------------------------------------------------
def fill(ticket: PutTicket, value: bytes, upto: int | None = None) -> None:
    offset = 0
    for view in ticket.views:
        take = len(view) if upto is None else max(0, min(len(view), upto - offset))
        view[:take] = value[offset : offset + take]
        offset += len(view)


@pytest.mark.parametrize("same", [True, False])
async def test_two_puts_of_one_key_interleaved(rig: Rig, same: bool) -> None:
    store = rig.store
    first_value = value_for(b"k")
    second_value = first_value if same else value_for(b"other")
    used = store.pool.used_bytes
    t1 = await store.begin_put(NS, b"k", VALUE_BYTES, checksum=checksum(first_value))
    t2 = await store.begin_put(NS, b"k", VALUE_BYTES, checksum=checksum(second_value))
    assert isinstance(t1, PutTicket) and isinstance(t2, PutTicket)
    fill(t1, first_value, VALUE_BYTES // 2)
    # Half written: not visible anywhere (LMCache#207).
    assert await rig.read(b"k") is None and store.exists(NS, [b"k"]) == [False]
    fill(t1, first_value)
    fill(t2, second_value)
    assert await store.publish(t1, checksum(first_value)) == PutResult(False, checksum(first_value))
    if same:
        assert (await store.publish(t2, checksum(second_value))).existed
    else:
        with pytest.raises(AlreadyExists):
            await store.publish(t2, checksum(second_value))
    store.abort_put(t2)  # what every transport does after publish
    assert await rig.read(b"k") == (first_value, TIER_L1)
    assert store.pool.used_bytes == used + PAGE_BYTES, "the losing ticket's pages leaked"


async def test_abandoned_and_failed_puts_leave_nothing(rig: Rig) -> None:
    """LMCache#4991: a store that failed must not be visible afterwards."""
    store = rig.store
    used = store.pool.used_bytes
    ticket = await store.begin_put(NS, b"half", VALUE_BYTES)
    assert isinstance(ticket, PutTicket)
    fill(ticket, value_for(b"half"), VALUE_BYTES // 3)
    store.abort_put(ticket)  # the writer died
    value = value_for(b"dur")
    rig.gate.fail_writes = True
    with pytest.raises(Unavailable):
        await store.put(NS, b"dur", value, checksum=checksum(value), hasher=checksum,
                        durable=True)  # fmt: skip
    rig.gate.fail_writes = False
    for key in (b"half", b"dur"):
        assert await rig.read(key) is None
        assert store.exists(NS, [key]) == [False]
        assert store.lookup(NS, [key]).prefix_len == 0
    assert store.pool.used_bytes == used


def test_two_clients_put_one_key_over_bulk(tmp_path: Path) -> None:
    """Two clients race puts of the same keys (bulk TCP, 256 KiB values): per
    key one wins, the other is told ALREADY_EXISTS; every get is the winner's."""
    keys = [b"race-%03d" % i for i in range(24)]
    size = 256 << 10
    daemon = DaemonProcess(tmp_path, [])
    outcome: dict[tuple[int, bytes], str] = {}
    barrier = threading.Barrier(2, timeout=WAIT_S)

    def racer(who: int) -> None:
        with Client(daemon.target, timeout_s=WAIT_S) as client:
            for key in keys:
                barrier.wait()
                try:
                    existed = client.put(NS, key, value_for(key + bytes([who]), size))
                    outcome[who, key] = "existed" if existed else "stored"
                except AlreadyExists:
                    outcome[who, key] = "conflict"

    try:
        threads = [threading.Thread(target=racer, args=(who,)) for who in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(outcome) == 2 * len(keys)
        with Client(daemon.target, timeout_s=WAIT_S) as client:
            for key in keys:
                pair = sorted(outcome[who, key] for who in (0, 1))
                assert pair == ["conflict", "stored"], (key, pair)
                winner = 0 if outcome[0, key] == "stored" else 1
                assert client.get(NS, key) == value_for(key + bytes([winner]), size)
            assert client.stats()["put_conflicts"] == len(keys)
    finally:
        daemon.stop()


def test_bulk_get_of_a_value_still_arriving_is_a_miss(tmp_path: Path) -> None:
    """LMCache#207 over the wire: half a PUT's payload is on the daemon, a GET
    on another connection misses; the rest arrives and the value appears."""
    daemon = DaemonProcess(tmp_path, [])
    value = value_for(b"slow", 300_000)

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", daemon.bulk_port), timeout=WAIT_S)
        sock.sendall(bulk.encode_request(bulk.OP_HELLO, 0))
        assert answer(sock)[0] == bulk.CODE_OK
        return sock

    def answer(sock: socket.socket) -> tuple[int, bytes]:
        header = recv_exact(sock, bulk.RESPONSE.size)
        fields = bulk.RESPONSE.unpack(header)
        code, meta_len, msg_len, length = fields[5], fields[6], fields[7], fields[8]
        recv_exact(sock, meta_len + msg_len)
        payload = recv_exact(sock, length) if code == bulk.CODE_OK and fields[2] == 3 else b""
        return code, payload

    try:
        writer, reader = connect(), connect()
        try:
            writer.sendall(bulk.encode_request(
                bulk.OP_PUT, 1, NS.encode(), b"slow", length=len(value),
                checksum=checksum(value),
            ))  # fmt: skip
            writer.sendall(value[: len(value) // 2])
            for rid in range(2, 5):
                reader.sendall(bulk.encode_request(bulk.OP_GET, rid, NS.encode(), b"slow"))
                assert answer(reader)[0] == bulk.CODE_NOT_FOUND
            writer.sendall(value[len(value) // 2 :])
            assert answer(writer)[0] == bulk.CODE_OK
            reader.sendall(bulk.encode_request(bulk.OP_GET, 9, NS.encode(), b"slow"))
            assert answer(reader) == (bulk.CODE_OK, value)
        finally:
            writer.close()
            reader.close()
    finally:
        daemon.stop()


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    out = bytearray()
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        assert chunk, "connection closed"
        out += chunk
    return bytes(out)


# ---- delete vs get ------------------------------------------------------------------------
async def test_delete_during_get_from_l1(rig: Rig) -> None:
    store = rig.store
    await rig.put(b"a")
    reader = await store.fetch(NS, b"a")
    assert reader is not None
    try:
        assert await store.delete(NS, [b"a"]) == 1
        assert store.exists(NS, [b"a"]) == [False]
        await rig.pressure("p", 2 * POOL_PAGES)  # the freed pool wants pages back
        assert b"".join(reader.views) == value_for(b"a"), "deleted pages reused under a reader"
    finally:
        reader.close()
    assert await rig.read(b"a") is None
    # The reader's pages went back on close: the pool holds the linked values only.
    assert store.pool.used_bytes == store.entry_count * PAGE_BYTES


async def test_delete_during_promotion_read(rig: Rig) -> None:
    store = rig.store
    await rig.put(b"a")
    assert store.evict(NS, b"a")
    used = store.pool.used_bytes
    rig.gate.arm(OpKind.READ)
    getting = asyncio.create_task(rig.read(b"a"))
    await asyncio.wait_for(rig.gate.entered.wait(), WAIT_S)
    assert await store.delete(NS, [b"a"]) == 1
    rig.gate.release.set()
    assert await getting is None, "a get finished after the delete returned the value"
    assert await rig.read(b"a") is None
    assert store.pool.used_bytes == used


async def test_delete_during_write_back_stays_deleted_after_restart(rig: Rig) -> None:
    store = rig.store
    rig.gate.arm(OpKind.WRITE)
    await rig.put(b"a", flush=False)
    await asyncio.wait_for(rig.gate.entered.wait(), WAIT_S)  # its L2 append is parked
    assert await store.delete(NS, [b"a"]) == 1
    rig.gate.release.set()
    await rig.flush()
    assert rig.tier.lookup(NS, b"a") is None
    assert await rig.read(b"a") is None
    await rig.put(b"b")
    await rig.close()
    await rig.open()  # recovery from the segments on disk
    assert rig.tier.lookup(NS, b"a") is None, "a deleted value came back after recovery"
    assert await rig.read(b"b") == (value_for(b"b"), TIER_L2)


# ---- batched gets (Store.fetch_many) -------------------------------------------------
async def fetch_all(store: Store, keys: Sequence[bytes]) -> dict[int, bytes | None]:
    readers = await asyncio.wait_for(store.fetch_many(NS, keys), WAIT_S)
    try:
        return {i: None if r is None else b"".join(r.views) for i, r in readers.items()}
    finally:
        for reader in readers.values():
            if reader is not None:
                reader.close()


async def l2_only(rig: Rig, keys: Sequence[bytes]) -> None:
    for key in keys:
        await rig.put(key)
    for key in keys:
        assert rig.store.evict(NS, key)


async def test_batched_get_of_a_chain_is_one_l2_read(rig: Rig) -> None:
    """L2-only values of one batch go out in one backend call; values in L1,
    not stored, or repeated are left to ``fetch``."""
    keys = [b"c%02d" % i for i in range(5)]
    await l2_only(rig, keys)
    await rig.put(b"in-l1")
    reads, used = rig.gate.reads, rig.store.pool.used_bytes
    got = await fetch_all(rig.store, [*keys, b"in-l1", b"nowhere", keys[0]])
    assert rig.gate.reads - reads == 1
    assert got == {i: value_for(key) for i, key in enumerate(keys)}
    assert rig.store.counters.l2_hits >= len(keys)
    assert rig.store.pool.used_bytes == used + len(keys) * PAGE_BYTES  # now in L1
    assert rig.store.placement is not None and not rig.store.placement.promotions


async def test_batched_get_bounds_its_read_bytes(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [b"b%02d" % i for i in range(6)]
    await l2_only(rig, keys)
    record = rig.tier.lookup(NS, keys[0])
    assert record is not None
    monkeypatch.setattr(placement, "FETCH_BATCH_BYTES_MAX", 2 * record.read_bytes)
    reads = rig.gate.reads
    got = await fetch_all(rig.store, keys)
    assert rig.gate.reads - reads == 3
    assert got == {i: value_for(key) for i, key in enumerate(keys)}


async def test_batched_get_misses_torn_damaged_and_short_records(rig: Rig) -> None:
    """A damaged payload, a wrong header and a short read are misses in a
    batch (records dropped, counted), never hits; the others hit."""
    keys = [b"t%02d" % i for i in range(5)]
    await l2_only(rig, keys)
    records = [rig.tier.lookup(NS, key) for key in keys]
    assert all(records)
    where = {
        k: r.segment * SEGMENT_BYTES + r.offset for k, r in zip(keys, records, strict=True) if r
    }
    last = max(keys, key=lambda k: where[k])
    header_bytes = records[0].header_bytes if records[0] else 0
    with open(rig.path, "r+b") as f:
        f.seek(where[keys[0]] + header_bytes + 1234)  # payload
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
        f.seek(where[keys[1]] + 80)  # header
        f.write(b"\xff\xfe")
        f.truncate(where[last] + header_bytes + 100)  # the last record is cut short
    checksums, errors = rig.tier.counters.checksum_failures, rig.tier.counters.read_errors
    got = await fetch_all(rig.store, keys)
    bad = {keys[0], keys[1], last}
    assert got == {i: None if k in bad else value_for(k) for i, k in enumerate(keys)}
    assert rig.tier.counters.checksum_failures - checksums == 2
    assert rig.tier.counters.read_errors - errors == 1
    assert all(rig.tier.lookup(NS, k) is None for k in bad), "a bad record stayed indexed"
    assert await rig.read(keys[0]) is None


async def parked_batch(
    rig: Rig, keys: Sequence[bytes]
) -> tuple[int, asyncio.Task[dict[int, bytes | None]]]:
    """``keys`` on L2 only and a batched get of them parked in its read; the
    pool's used bytes before the get."""
    await l2_only(rig, keys)
    used = rig.store.pool.used_bytes
    rig.gate.arm(OpKind.READ)
    getting = asyncio.create_task(fetch_all(rig.store, keys))
    await asyncio.wait_for(rig.gate.entered.wait(), WAIT_S)
    return used, getting


async def test_delete_during_batched_get_read(rig: Rig) -> None:
    keys = [b"d%02d" % i for i in range(3)]
    used, getting = await parked_batch(rig, keys)
    # A get of a key the batch is reading shares the batch's read.
    single = asyncio.create_task(rig.read(keys[2]))
    assert await rig.store.delete(NS, [keys[1]]) == 1
    rig.gate.release.set()
    assert await getting == {0: value_for(keys[0]), 1: None, 2: value_for(keys[2])}
    assert await single == (value_for(keys[2]), TIER_L1)
    assert rig.store.pool.used_bytes == used + 2 * PAGE_BYTES


async def test_batched_get_serves_a_copy_linked_during_its_read(rig: Rig) -> None:
    """A key the batch is reading that reaches L1 meanwhile by another way
    (linked here by hand, its bytes copied in): the batch serves that copy,
    through views of its own pages, and gives its read's pages back."""
    keys = [b"p%02d" % i for i in range(3)]
    used, getting = await parked_batch(rig, keys)
    record = rig.tier.lookup(NS, keys[1])
    runs = rig.store.entries.alloc_now(VALUE_BYTES)
    assert record is not None and runs is not None and rig.store.placement is not None
    value, at = value_for(keys[1]), 0
    for view in rig.store.pool.views(runs, VALUE_BYTES):
        view[:] = value[at : at + len(view)]
        at += len(view)
    assert rig.store.placement._adopt(record, runs) is not None
    copy = rig.store.entries.get(NS, keys[1])
    rig.gate.release.set()
    assert await getting == {i: value_for(k) for i, k in enumerate(keys)}
    assert rig.store.entries.get(NS, keys[1]) is copy, "the read replaced L1's copy"
    assert rig.store.pool.used_bytes == used + 3 * PAGE_BYTES  # the read's pages of p01 freed
    assert rig.store.placement is not None and not rig.store.placement.promotions


async def test_cancelled_batched_get_gives_its_pages_back(rig: Rig) -> None:
    keys = [b"x%02d" % i for i in range(4)]
    used, getting = await parked_batch(rig, keys)
    getting.cancel()
    await asyncio.sleep(0)
    rig.gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await getting
    assert rig.store.pool.used_bytes == used
    assert rig.store.placement is not None and not rig.store.placement.promotions
    assert await fetch_all(rig.store, keys) == {i: value_for(k) for i, k in enumerate(keys)}


async def test_batched_get_in_a_pool_pinned_full_leaves_the_rest_to_fetch(rig: Rig) -> None:
    keys = [b"f%02d" % i for i in range(4)]
    await l2_only(rig, keys)
    pinned = []
    for i in range(POOL_PAGES - 2):
        await rig.put(b"pin%02d" % i)
        reader = await rig.store.fetch(NS, b"pin%02d" % i)
        assert reader is not None
        pinned.append(reader)
    held = await rig.store.fetch_many(NS, keys)
    try:
        assert sorted(held) == [0, 1]
        assert [b"".join(r.views) for r in held.values() if r] == [value_for(k) for k in keys[:2]]
        with pytest.raises(ResourceExhausted):
            await rig.store.fetch(NS, keys[2])
    finally:
        for reader in [*pinned, *held.values()]:
            if reader is not None:
                reader.close()
    assert rig.store.placement is not None and not rig.store.placement.promotions
