"""The shm socket's answer-at-once ops (``RegionOps.get_now`` and
``put_now``) against the batch calls they stand in for, in process: the same
result and bytes for every item they answer; None (the batch call's turn)
for a miss, a value without room, a copy that belongs on a thread, a durable
put and a put that must wait for pinned pages; a value whose pool bytes
changed is DATA_LOSS, a put whose bytes do not match its checksum leaves
nothing; nothing stays pinned or counted in flight."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.config.settings import Config
from kvd.l1.pool import PAGE_BYTES
from kvd.paths.bulk.server import (
    OP_HELLO,
    OP_REGION_GET,
    REQUEST,
    RESPONSE,
    BulkLimits,
    encode_request,
)
from kvd.paths.ops.items import ItemResult, RegionBatch, RegionItem
from kvd.paths.ops.region_ops import IDLE_INLINE_COPY_BYTES
from kvd.paths.shm.channel import ShmChannel
from kvd.store.index import TIER_L1
from kvd.wire.checksum import checksum
from kvd.wire.errors import CODE_NUMBERS as CODES
from kvd.wire.errors import KvdError
from kvd.wire.shm import PIPELINE_FRAMES, REGION_REF
from tests.paths.shm.support import CALLER, REGION_BYTES, Rig, region_rig
from tests.sockets import most_between_turns, recv_exact

NS = "now"


@pytest.fixture
def rig() -> Iterator[Rig]:
    with region_rig() as made:
        yield made


async def _put(rig: Rig, key: bytes, value: bytes) -> None:
    await rig.ops.store.put(NS, key, value, checksum=checksum(value), hasher=checksum)


def _now(rig: Rig, item: RegionItem) -> ItemResult | int | None:
    """get_now's result, or the code of the error it raised."""
    try:
        return rig.ops.get_now(rig.region.region_id, rig.region.token, NS, item, CALLER)
    except KvdError as exc:
        return CODES[exc.code_name]


async def _batch(rig: Rig, item: RegionItem) -> ItemResult | int:
    batch = RegionBatch(rig.region.region_id, rig.region.token, NS, [item])
    try:
        return (await rig.ops.get_into_region(batch, CALLER))[0]
    except KvdError as exc:
        return CODES[exc.code_name]


def _settled(rig: Rig) -> None:
    store = rig.ops.store
    assert rig.ops.inflight.bytes == 0
    assert all(entry.readers == 0 for ns in store.namespaces() for entry in ns.entries.values())


async def test_what_it_answers_is_what_the_batch_get_answers(rig: Rig) -> None:
    values = {b"small": b"s" * 100, b"page": os.urandom(64 << 10), b"big": os.urandom(3 << 20)}
    for key, value in values.items():
        await _put(rig, key, value)
    answered = 0
    for key, offset, length in [
        (b"small", 0, 100),
        (b"page", 4096, 1 << 20),  # more room than needed
        (b"big", 1 << 20, 3 << 20),
    ]:
        item = RegionItem(key=key, offset=offset, length=length)
        now = _now(rig, item)
        assert now is not None, key
        got_now = rig.map[offset : offset + len(values[key])] if not isinstance(now, int) else b""
        rig.map[offset : offset + length] = b"\0" * min(length, REGION_BYTES - offset)
        batch = await _batch(rig, item)
        assert now == batch
        if not isinstance(now, int):
            assert now.code == 0 and now.tier == TIER_L1
            assert got_now == values[key] == rig.map[offset : offset + len(values[key])]
            answered += 1
        _settled(rig)
    assert answered == 3
    hits = rig.ops.metrics.hits.labels("shm_get", "l1")._value.get()
    assert hits == 6  # three items, each got twice


async def test_gets_that_would_wait_are_left_to_the_batch_get(rig: Rig) -> None:
    await _put(rig, b"small", b"s" * 100)
    huge = os.urandom(IDLE_INLINE_COPY_BYTES + PAGE_BYTES)  # copied on threads
    await _put(rig, b"huge", huge)
    for item in [
        RegionItem(key=b"absent", offset=0, length=100),  # a miss may be on L2
        RegionItem(key=b"small", offset=0, length=99),  # no room: the batch get says so
        RegionItem(key=b"huge", offset=0, length=len(huge)),
        RegionItem(key=b"small", offset=REGION_BYTES - 50, length=100),  # outside the region
    ]:
        assert _now(rig, item) is None
        _settled(rig)
    batch = await _batch(rig, RegionItem(key=b"huge", offset=0, length=len(huge)))
    assert not isinstance(batch, int) and batch.code == 0
    assert rig.map[: len(huge)] == huge
    no_room = await _batch(rig, RegionItem(key=b"small", offset=0, length=99))
    assert not isinstance(no_room, int) and no_room.code == CODES["RESOURCE_EXHAUSTED"]
    outside = await _batch(rig, RegionItem(key=b"small", offset=REGION_BYTES - 50, length=100))
    assert not isinstance(outside, int) and outside.code == CODES["INVALID_ARGUMENT"]


async def test_changed_pool_bytes_are_data_loss_and_a_wrong_token_not_found(rig: Rig) -> None:
    value = os.urandom(100_000)
    await _put(rig, b"k", value)
    entry = rig.ops.store._l1(NS, b"k")
    assert entry is not None
    view = rig.ops.store.pool.views(entry.runs, entry.size)[0]
    view[7] ^= 0xFF
    result = _now(rig, RegionItem(key=b"k", offset=0, length=len(value)))
    assert not isinstance(result, int) and result is not None
    assert result.code == CODES["DATA_LOSS"]
    _settled(rig)
    item = RegionItem(key=b"k", offset=0, length=len(value))
    with pytest.raises(KvdError) as raised:
        rig.ops.get_now(rig.region.region_id, b"x" * 16, NS, item, CALLER)
    assert raised.value.code_name == "NOT_FOUND"


def _put_now(rig: Rig, item: RegionItem, durable: bool = False) -> ItemResult | None:
    return rig.ops.put_now(rig.region.region_id, rig.region.token, NS, item, durable, CALLER)


async def _batch_put(rig: Rig, item: RegionItem) -> ItemResult:
    batch = RegionBatch(rig.region.region_id, rig.region.token, NS, [item])
    return (await rig.ops.put_from_region(batch, CALLER))[0]


async def test_put_now_stores_and_answers_as_the_batch_put_does(rig: Rig) -> None:
    value = os.urandom(300_000)
    rig.map[: len(value)] = value
    now = _put_now(rig, RegionItem(key=b"a", offset=0, length=len(value), parent=b"p"))
    batch = await _batch_put(rig, RegionItem(key=b"b", offset=0, length=len(value)))
    assert now == batch and now is not None
    assert (now.code, now.size, now.checksum, now.existed) == (
        0,
        len(value),
        checksum(value),
        False,
    )
    _settled(rig)
    got = await rig.ops.store.fetch(NS, b"a")
    assert got is not None and b"".join(got.views) == value
    got.close()
    again = _put_now(rig, RegionItem(key=b"a", offset=0, length=len(value)))
    assert again is not None and again.existed and again.code == 0
    rig.map[:1] = b"\0" if value[:1] != b"\0" else b"\1"
    sent = RegionItem(key=b"a", offset=0, length=len(value), checksum=checksum(value))
    assert _put_now(rig, sent) == await _batch_put(rig, sent)  # bytes not what the put said
    conflict = _put_now(rig, RegionItem(key=b"a", offset=0, length=len(value)))
    assert conflict is not None and conflict.code == CODES["ALREADY_EXISTS"]
    wrong = RegionItem(key=b"c", offset=0, length=len(value), checksum=checksum(value))
    bad = _put_now(rig, wrong)
    assert bad is not None and bad.code == CODES["DATA_LOSS"]
    assert rig.ops.store.l1_size(NS, b"c") is None  # nothing visible
    moved = rig.ops.metrics.bytes.labels("shm_put", "in")._value.get()
    assert moved == 3 * len(value)  # a, b, and a again (received, then found stored)
    _settled(rig)


async def test_puts_that_would_wait_are_left_to_the_batch_put(rig: Rig) -> None:
    store = rig.ops.store
    free = store.pool.free_bytes
    for item, durable in [
        (RegionItem(key=b"d", offset=0, length=100), True),  # waits for L2
        (RegionItem(key=b"h", offset=0, length=IDLE_INLINE_COPY_BYTES + 1), False),
        (RegionItem(key=b"o", offset=REGION_BYTES - 50, length=100), False),
    ]:
        assert _put_now(rig, item, durable) is None
    assert store.pool.free_bytes == free
    big = 9 << 20
    readers = []
    for i in range(4):  # 36 of the pool's 40 MiB, all pinned by readers
        await _put(rig, b"pin%d" % i, os.urandom(big))
        reader = store.open(NS, b"pin%d" % i)
        assert reader is not None
        readers.append(reader)
    item = RegionItem(key=b"late", offset=0, length=5 << 20)
    assert _put_now(rig, item) is None
    full = await _batch_put(rig, item)
    assert full.code == CODES["RESOURCE_EXHAUSTED"]
    for reader in readers:
        reader.close()
    stored = _put_now(rig, item)  # now the pinned values can go
    assert stored is not None and stored.code == 0
    _settled(rig)


async def test_a_burst_of_buffered_gets_lets_other_work_run(rig: Rig, tmp_path: Path) -> None:
    """2,000 gets sent in one write are answered at once, one after the other
    from the socket buffer; every PIPELINE_FRAMES of them the connection lets
    the event loop run other work (here a probe that counts answers)."""
    await _put(rig, b"k", b"v" * 100)
    channel = ShmChannel(rig.ops, str(tmp_path / "s.sock"), BulkLimits.from_config(Config()))
    await channel.start()
    answered = rig.ops.metrics.requests.labels("shm_get", "OK")

    def client() -> None:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(channel.path)
            sock.sendall(encode_request(OP_HELLO, 0))
            recv_exact(sock, RESPONSE.size)
            ref = REGION_REF.pack(rig.region.region_id, 0, rig.region.token)
            frames = []
            for i in range(2000):
                header = encode_request(OP_REGION_GET, i + 1, NS.encode(), b"k", length=100)
                frames.append(header[: REQUEST.size] + ref + header[REQUEST.size :])
            sock.sendall(b"".join(frames))
            for _ in range(2000):
                head = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
                assert head[5] == 0  # code
                recv_exact(sock, head[6] + head[7])

    try:
        most = await most_between_turns(answered._value.get, client)
    finally:
        await channel.stop()
    assert answered._value.get() == 2000
    assert most <= PIPELINE_FRAMES
