"""The pool's directory (``kvd.l1.directory``): a client that maps the
pool finds a value in L1 there and copies it without a frame.

Against a real daemon: gets go without a POOL_GET and come back whole, the
daemon is told of them afterwards (hits, and the eviction policy keeps a
value read only that way); a deleted value is a miss at once; values
deleted, evicted and put again in the same pages while another process
reads them never come back wrong. On the pool itself: a withdrawn slot, a
reused page, a slot being rewritten and a copy that does not match its
checksum are each no value (the client then asks the daemon)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvd.client import Client
from kvd.client.pool_path import TOUCH_BATCH_KEYS
from kvd.client.pool_reads import (
    STORE_ORDERED_MACHINES,
    PoolMap,
    native_pool_reads,
    touch_frame,
)
from kvd.client.shm import ShmPath
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.wire.bulk import encode_request
from kvd.wire.checksum import checksum
from kvd.wire.shm import (
    DIRECTORY_SLOT,
    FLAG_NO_ANSWER,
    OP_POOL_TOUCH,
    POOL_DIRECTORY,
    TAG,
    TOUCH_REF,
)
from tests.sockets import metric, sample, samples
from tests.support import DaemonFactory, DaemonProcess, first_answer, wait_until

NS = "pool-directory"
POOL_READS = ("--shm-pool-reads", "true")


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _key(i: int) -> bytes:
    return hashlib.sha256(b"directory-%d" % i).digest()


def _shm(client: Client) -> ShmPath:
    shm, _ = client._fast_paths()
    assert shm is not None
    return shm


def _pool(client: Client) -> PoolMap:
    pool = _shm(client).pools.map
    assert pool is not None and pool.directory is not None
    return pool


@pytest.fixture
def pooled(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(*POOL_READS)


def test_gets_read_through_the_directory_without_a_frame(pooled: DaemonProcess) -> None:
    values = {_key(i): _value(size, i) for i, size in enumerate([65_536, 1 << 20, 100, 0, 3 << 20])}
    port = pooled.metrics_port
    with Client(pooled.socket_target) as client:
        assert "shm-pool-direct" in client.paths
        for key, value in values.items():
            client.put(NS, key, value)
        pool = _pool(client)
        for key, value in values.items():
            out = memoryview(bytearray(len(value) + 7))
            assert client.get_into(NS, key, out) == len(value)
            assert bytes(out[: len(value)]) == value
        rooms = [memoryview(bytearray(len(v))) for v in values.values()]
        missing = _key(99)
        got = client.get_many_into(NS, [*values, missing], [*rooms, memoryview(bytearray(8))])
        assert got == [len(v) for v in values.values()] + [None]
        assert [bytes(r) for r in rooms] == list(values.values())
        assert pool.direct_hits == 2 * len(values)
        # No POOL_GET carried a value; the miss asked the daemon once.
        assert sample(port, 'kvd_hits_total{op="shm_pool_get",tier="l1"}') == 0
        assert metric(port, 'kvd_misses_total{op="shm_pool_get"}') == 1
    # Closing told the daemon what was read.
    assert metric(port, 'kvd_hits_total{op="shm_pool_direct",tier="l1"}') == 2 * len(values)


def test_touches_go_in_batches_and_keep_a_value_in_l1(daemon_factory: DaemonFactory) -> None:
    """LRU over 32 pages: a value read only through the directory stays
    while values put after it and never read are evicted."""
    daemon = daemon_factory(
        *POOL_READS, "--dram-bytes", str(2 << 20), "--max-value-bytes", str(1 << 20),
        "--eviction-policy", "lru",
    )  # fmt: skip
    hot = _key(1000)
    with Client(daemon.socket_target) as client:
        client.put(NS, hot, _value(PAGE_BYTES, 1000))
        pool = _pool(client)
        out = memoryview(bytearray(PAGE_BYTES))
        for i in range(80):
            client.put(NS, _key(i), _value(PAGE_BYTES, i))
            for _ in range(TOUCH_BATCH_KEYS // 8):  # a batch told every 8 puts
                assert client.get_into(NS, hot, out) == PAGE_BYTES
        assert pool.direct_hits == 80 * (TOUCH_BATCH_KEYS // 8)
        assert metric(daemon.metrics_port, 'kvd_hits_total{op="shm_pool_direct",tier="l1"}') >= (
            80 * (TOUCH_BATCH_KEYS // 8) - TOUCH_BATCH_KEYS
        )
        assert metric(daemon.metrics_port, "kvd_evictions_total") >= 80 + 1 - 32
        before = pool.direct_hits
        assert client.get_into(NS, hot, out) == PAGE_BYTES  # still in L1: no frame
        assert pool.direct_hits == before + 1
        assert bytes(out) == _value(PAGE_BYTES, 1000)


def test_a_touch_gets_no_answer_and_a_bad_one_no_refusal(pooled: DaemonProcess) -> None:
    """A POOL_TOUCH asks for no answer: the next frame on its connection
    gets its own. A bad one (keys that are not its count) is counted as
    refused, and answers nothing either; the flag on any other op ends the
    connection."""
    key, value = _key(8), _value(1000, 8)
    hits = 'kvd_hits_total{op="shm_pool_direct",tier="l1"}'
    refused = 'kvd_requests_total{code="INVALID_ARGUMENT",op="shm_pool_touch"}'
    with Client(pooled.socket_target) as client:
        client.put(NS, key, value)
        conn = _shm(client)._ops.client._connect()  # type: ignore[union-attr]
        try:
            frame = touch_frame(NS, [key, key])
            assert frame is not None
            head = encode_request(OP_POOL_TOUCH, 7, NS.encode(), length=10, flags=FLAG_NO_ANSWER)
            bad = head[:40] + TOUCH_REF.pack(3, 4) + head[40:] + b"k" * 10
            asked = encode_request(OP_POOL_TOUCH, 9, NS.encode(), length=len(key))
            conn.send([memoryview(frame + bad + asked[:40] + TOUCH_REF.pack(1, len(key)) +
                                  asked[40:] + key)])  # fmt: skip
            answer = conn.answer()
            assert (answer.op, answer.request_id, answer.code) == (OP_POOL_TOUCH, 9, 0)
            wait_until(lambda: sample(pooled.metrics_port, hits) == 3)
            counted = sample(pooled.metrics_port, hits), sample(pooled.metrics_port, refused)
            assert counted == (3, 1), f"(hits, refused) {counted}, requests:\n" + "\n".join(
                samples(pooled.metrics_port, "kvd_requests_total", "kvd_hits_total")
            )
            other = encode_request(OP_POOL_TOUCH - 1, 3, NS.encode(), flags=FLAG_NO_ANSWER)
            conn.send([memoryview(other)])
            assert conn.sock.recv(4096) == b""  # closed: nothing more is read from it
        finally:
            conn.close()
        assert client.get_into(NS, key, memoryview(bytearray(1000))) == 1000


def test_a_deleted_value_is_a_miss_at_once(pooled: DaemonProcess) -> None:
    key, value = _key(7), _value(65_536, 7)
    with Client(pooled.socket_target) as client:
        client.put(NS, key, value)
        out = memoryview(bytearray(len(value)))
        assert client.get_into(NS, key, out) == len(value)
        assert client.delete(NS, [key]) == 1
        hits = _pool(client).direct_hits
        assert client.get_into(NS, key, out) is None
        assert _pool(client).direct_hits == hits


def test_a_restarted_daemon_is_never_read_through_the_old_directory(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """The old pool's mapping outlives its daemon, and still names the value:
    the client sees the attach's connection end and maps the new pool."""
    where = tmp_path / "restarted"
    first = daemon_factory(*POOL_READS, workdir=where)
    key, value = _key(8), _value(65_536, 8)
    with Client(first.socket_target) as client:
        client.put(NS, key, value)
        out = memoryview(bytearray(len(value)))
        assert client.get_into(NS, key, out) == len(value)
        old = _pool(client)
        assert old.direct_hits == 1
        first.stop()
        second = daemon_factory(*POOL_READS, workdir=where)
        with Client(second.socket_target, direct_pool_reads=False) as other:
            assert other.delete(NS, [key]) == 1  # L2 had kept it
        got = first_answer(lambda: client.get_into(NS, key, out))
        assert got is None  # deleted on the daemon there now
        assert old.direct_hits == 1
        client.put(NS, key, value)
        assert client.get_into(NS, key, out) == len(value) and bytes(out) == value
        assert _pool(client) is not old and _pool(client).direct_hits == 1


def _churn(target: str, rounds: int, ready: Any) -> None:
    """Delete and put the same keys again and again: each put may take the
    pages another key's value had a moment before."""
    with Client(target, direct_pool_reads=False) as client:
        ready.set()
        for _ in range(rounds):
            for i in range(16):
                client.delete(NS, [_key(i)])
                client.put(NS, _key(i), _value(65_536, i))
                client.delete(NS, [_key(100 + i)])
                client.put(NS, _key(100 + i), _value(65_536, 100 + i))


def test_values_reused_while_read_never_come_back_wrong(pooled: DaemonProcess) -> None:
    expected = {_key(i): _value(65_536, i) for i in range(16)}
    expected |= {_key(100 + i): _value(65_536, 100 + i) for i in range(16)}
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    churn = ctx.Process(target=_churn, args=(pooled.socket_target, 60, ready))
    with Client(pooled.socket_target) as client:
        for key, value in expected.items():
            client.put(NS, key, value)
        churn.start()
        try:
            assert ready.wait(30)
            pool = _pool(client)
            out = memoryview(bytearray(65_536))
            gets = wrong = misses = 0
            deadline = time.monotonic() + 30
            while churn.is_alive() and time.monotonic() < deadline:
                for key, value in expected.items():
                    got = client.get_into(NS, key, out)
                    gets += 1
                    if got is None:
                        misses += 1
                    elif got != len(value) or bytes(out) != value:
                        wrong += 1
        finally:
            churn.join(60)
        assert churn.exitcode == 0
        assert wrong == 0
        assert pool.direct_hits > 0 and gets > pool.direct_hits  # both ways were taken
        assert misses < gets


# ---- the pool and its directory, in this process -------------------------------------


@pytest.fixture(params=["native", "python"])
def shared_pool(request: pytest.FixtureRequest) -> Any:
    """A shared pool and its mapping, read through the directory in native
    code (where built) or in Python."""
    if request.param == "native" and native_pool_reads() is None:
        pytest.skip("kvd.io._uring is not built")
    pool = Pool(64 * PAGE_BYTES, shared=True)
    assert pool.directory is not None
    directory = pool.directory
    fields = (
        directory.base,
        directory.base + directory.slots_offset,
        directory.bucket_count,
        directory.ways,
    )
    assert len(POOL_DIRECTORY.pack(*fields)) == POOL_DIRECTORY.size
    daemon_end, watch = socket.socketpair()
    unwatched = PoolMap(pool.read_only_fd(), pool.capacity_bytes, fields)
    assert unwatched.directory is None  # no directory without a watch on its daemon
    unwatched.close()
    mapped = PoolMap(
        pool.read_only_fd(), pool.capacity_bytes, fields, watch, native=request.param == "native"
    )
    assert mapped.directory is not None and not mapped.daemon_gone()
    yield pool, mapped
    daemon_end.close()
    assert mapped.daemon_gone()
    mapped.close()
    pool.close()


def _store(pool: Pool, ns: str, key: bytes, value: bytes, uid: int) -> tuple[list[Any], int]:
    runs = pool.alloc(len(value))
    assert len(runs) == 1
    first = runs[0][0]
    pool.views(runs, len(value))[0][:] = value
    assert pool.directory is not None
    slot = pool.directory.publish(
        ns, key, uid, first, len(value), checksum(value), first * PAGE_BYTES
    )
    assert slot >= 0
    return runs, slot


def test_the_directory_names_a_value_only_while_it_is_that_value(shared_pool: Any) -> None:
    pool, mapped = shared_pool
    directory = pool.directory
    value = _value(3 * PAGE_BYTES, 1)
    runs, slot = _store(pool, NS, b"a", value, uid=1)
    out = memoryview(bytearray(len(value)))
    assert mapped.read_direct(NS, b"a", out) == len(value) and bytes(out) == value
    assert mapped.read_direct(NS, b"b", out) is None  # another key
    assert mapped.read_direct("other", b"a", out) is None  # another namespace
    assert mapped.read_direct(NS, b"a", memoryview(bytearray(10))) is None  # no room: ask
    # Freed pages: the tag goes first, so the slot alone names nothing.
    pool.free(runs)
    assert mapped.read_direct(NS, b"a", out) is None
    # Pages reused by another value, the old slot still there: not a value.
    other = _value(PAGE_BYTES, 2)
    _store(pool, NS, b"c", other, uid=2)
    assert mapped.read_direct(NS, b"a", out) is None
    directory.withdraw(slot, 1)
    assert mapped.read_direct(NS, b"a", out) is None
    got = memoryview(bytearray(PAGE_BYTES))
    assert mapped.read_direct(NS, b"c", got) == PAGE_BYTES and bytes(got) == other
    assert mapped.take_touched() == {NS: [b"a", b"c"]}
    assert mapped.take_touched() == {}


def test_a_slot_being_rewritten_or_a_bad_copy_is_no_value(shared_pool: Any) -> None:
    pool, mapped = shared_pool
    directory = pool.directory
    value = _value(PAGE_BYTES, 3)
    runs, slot = _store(pool, NS, b"k", value, uid=5)
    out = memoryview(bytearray(PAGE_BYTES))
    view = memoryview(pool._directory_map)
    (seq,) = TAG.unpack_from(view, slot)
    TAG.pack_into(view, slot, seq + 1)  # the daemon is rewriting it
    assert mapped.read_direct(NS, b"k", out) is None
    TAG.pack_into(view, slot, seq)
    assert mapped.read_direct(NS, b"k", out) == PAGE_BYTES
    # Bytes that are not the value's (the slot's checksum disagrees).
    pool.views(runs, PAGE_BYTES)[0][0] ^= 0xFF
    assert mapped.read_direct(NS, b"k", out) is None
    # A slot that points outside the pool or off a page start is never followed.
    at = slot + 8 + 8 + 16 + 8 + 8  # the offset field
    TAG.pack_into(view, at, pool.capacity_bytes)
    assert mapped.read_direct(NS, b"k", out) is None
    TAG.pack_into(view, at, 4096)
    assert mapped.read_direct(NS, b"k", out) is None
    view.release()
    assert DIRECTORY_SLOT.size == 64
    assert directory.overflows == 0


def test_a_full_bucket_leaves_values_out(shared_pool: Any) -> None:
    pool, _ = shared_pool
    directory = pool.directory
    placed = 0
    for i in range(directory.bucket_count * directory.ways + 8):
        placed += directory.publish(NS, b"%d" % i, 100 + i, 0, 1, 0, 0) >= 0
    assert placed <= directory.bucket_count * directory.ways
    assert directory.overflows == directory.bucket_count * directory.ways + 8 - placed > 0


def test_a_directory_that_does_not_fit_is_not_used() -> None:
    fd = os.memfd_create("pool")
    os.ftruncate(fd, 1 << 20)
    try:
        for fields in [
            (1 << 20, (1 << 20) + 128, 4, 4),  # past the memfd's end
            (0, 128, 4, 4),  # tags not after the pool
            ((1 << 20) - 4096, 1 << 20, 3, 4),  # not a power of two
        ]:
            size = (1 << 20) - 4096 if fields[0] != 0 else 1 << 16
            daemon_end, watch = socket.socketpair()
            mapped = PoolMap(os.dup(fd), size, fields, watch)
            assert mapped.directory is None
            assert mapped.read_direct(NS, b"k", memoryview(bytearray(8))) is None
            mapped.close()
            daemon_end.close()
    finally:
        os.close(fd)


def test_unchecked_directory_copies_only_where_stores_keep_their_order(
    pooled: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify_pool_reads=False`` skips the checksum of a directory copy on
    x86 alone (its stores keep their order); elsewhere it stays on, and the
    framed pool reads (pins) go unchecked as asked."""
    import platform

    with Client(pooled.socket_target, verify_pool_reads=False) as client:
        client.put(NS, _key(1), _value(PAGE_BYTES, 1))
        pool = _pool(client)
        assert not pool.verify
        assert pool.direct_verify is (platform.machine() not in STORE_ORDERED_MACHINES)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with Client(pooled.socket_target, verify_pool_reads=False) as client:
        pool = _pool(client)
        assert not pool.verify and pool.direct_verify
        out = memoryview(bytearray(PAGE_BYTES))
        assert client.get_into(NS, _key(1), out) == PAGE_BYTES
        assert bytes(out) == _value(PAGE_BYTES, 1)
