"""Pool reads (``shm_pool_reads``) against a real daemon: a client that may
read every namespace maps L1 read-only and copies gets out of it into any
buffer; the mapping cannot write the pool; a pin keeps a value's pages
(deleted, evicted) until the client's next pool get or its connection ends;
pins are bounded; a token that is not an admin's, or a daemon with the
setting off, is refused and the client keeps to region gets; bad frames get
a code; an L2-only value is read up first; a copy that does not match its
checksum is DATA_LOSS, never a value."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client, DataLoss, PermissionDenied
from kvd.client.bulk import Connection
from kvd.client.pool_reads import PoolItem, PoolMap, exchange, pool_get_frame
from kvd.client.shm import ShmPath
from kvd.client.shm_socket import RegionOps
from kvd.paths.shm.pool_reads import PINS_PER_CONNECTION
from kvd.wire.bulk import encode_request
from kvd.wire.checksum import checksum
from kvd.wire.errors import CODE_NUMBERS, FailedPrecondition, InvalidArgument
from kvd.wire.shm import OP_POOL_GET, POOL_REF
from tests.paths.support import TOKEN_A, TOKEN_ADMIN, token_file
from tests.sockets import metric
from tests.support import DaemonFactory, DaemonProcess, first_answer, wait_until

NS = "pool-reads"
POOL_READS = ("--shm-pool-reads", "true")


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _shm(client: Client) -> ShmPath:
    shm, _ = client._fast_paths()
    assert shm is not None
    return shm


def _ops(client: Client) -> RegionOps:
    ops = _shm(client)._ops
    assert ops is not None
    return ops


@pytest.fixture
def pooled(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(*POOL_READS)


def test_gets_copy_straight_out_of_the_pool(pooled: DaemonProcess) -> None:
    sizes = [1, 65_536, 100_001, 1 << 20, 3 << 20]
    values = {b"k%d" % i: _value(size, i) for i, size in enumerate(sizes)}
    with Client(pooled.socket_target, direct_pool_reads=False) as client:
        assert "shm-pool" in client.paths
        for key, value in values.items():
            client.put(NS, key, value)
        for key, value in values.items():
            plain = memoryview(bytearray(len(value) + 7))  # not a region: no staging
            assert client.get_into(NS, key, plain) == len(value)
            assert bytes(plain[: len(value)]) == value
            region = client.buffer(len(value))
            assert client.get_into(NS, key, region) == len(value)
            assert bytes(region) == value
        keys = [*values, b"k9"]  # one width: a single POOL_GET
        rooms = [memoryview(bytearray(4 << 20)) for _ in keys]
        got = client.get_many_into(NS, keys, rooms)
        assert got == [len(v) for v in values.values()] + [None]
        for room, value in zip(rooms, values.values(), strict=False):
            assert bytes(room[: len(value)]) == value
        with pytest.raises(InvalidArgument, match="too small"):
            client.get_into(NS, b"k4", memoryview(bytearray(10)))
        assert client.get(NS, b"k2") == values[b"k2"]
    port = pooled.metrics_port
    assert metric(port, 'kvd_requests_total{code="OK",op="shm_pool_get"}') >= 11
    assert metric(port, 'kvd_hits_total{op="shm_pool_get",tier="l1"}') >= 15
    assert metric(port, 'kvd_misses_total{op="shm_pool_get"}') >= 1
    # The client's connections are closed: nothing stays pinned or in flight.
    assert wait_until(lambda: metric(port, "kvd_shm_pool_pins") == 0)
    assert metric(port, "kvd_inflight_bytes") == 0


def test_the_mapping_cannot_write_the_pool(pooled: DaemonProcess) -> None:
    value = _value(65_536, 7)
    with Client(pooled.socket_target, direct_pool_reads=False) as client:
        client.put(NS, b"v", value)
        fd, size, directory, watch = _ops(client).attach_pool()
        assert watch is not None  # held open by the daemon while it lives
        watch.close()
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.ftruncate(fd, size // 2)
            # The directory lies after the pool, in the same read-only memfd.
            total = os.fstat(fd).st_size
            assert directory is not None and directory[0] == size < total
            private = mmap.mmap(fd, total, flags=mmap.MAP_PRIVATE)  # copy-on-write: the client's
            private[:] = b"\xff" * total
            private.close()
        finally:
            os.close(fd)
        assert client.get(NS, b"v") == value
        with Client(pooled.socket_target) as direct:
            out = memoryview(bytearray(len(value)))
            assert direct.get_into(NS, b"v", out) == len(value) and bytes(out) == value
            assert _shm(direct).pools.map is not None and _shm(direct).pools.map.direct_hits == 1
        with Client(pooled.socket_target, pool_reads=False) as regions_only:
            assert "shm-pool" not in regions_only.paths
            assert regions_only.get(NS, b"v") == value


def _raw_get(conn: Connection, keys: list[bytes], release: int) -> tuple[int, list[PoolItem]]:
    frame = pool_get_frame(NS, keys, release)
    assert frame is not None
    return exchange(conn, frame, len(keys))


def test_a_pin_keeps_its_pages_until_released(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(*POOL_READS, "--dram-bytes", "8MiB", "--max-value-bytes", "2MiB")
    value = _value(1 << 20, 1)
    with Client(daemon.socket_target, direct_pool_reads=False) as client:
        client.put(NS, b"pinned", value)
        pool = _shm(client).pools.map
        assert pool is not None
        conn = _ops(client).client._connect()
        try:
            pin, (item,) = _raw_get(conn, [b"pinned"], 0)
            assert pin and item.code == 0 and item.checksum == checksum(value)
            client.delete(NS, [b"pinned"])
            for i in range(24):  # 3x L1: every free page is taken again
                client.put(NS, b"other-%d" % i, _value(1 << 20, 100 + i))
            out = memoryview(bytearray(len(value)))
            assert pool.copy(item, out) and bytes(out) == value
            assert metric(daemon.metrics_port, "kvd_shm_pool_pins") == 1
            again, (gone,) = _raw_get(conn, [b"pinned"], pin)  # releases the pin
            assert again == 0 and gone.code == CODE_NUMBERS["NOT_FOUND"]
            assert metric(daemon.metrics_port, "kvd_shm_pool_pins") == 0
            assert metric(daemon.metrics_port, "kvd_inflight_bytes") == 0
        finally:
            conn.close()


def test_pins_are_bounded_and_a_closed_connection_drops_them(pooled: DaemonProcess) -> None:
    with Client(pooled.socket_target, direct_pool_reads=False) as client:
        client.put(NS, b"p", b"x" * 4096)
        conn = _ops(client).client._connect()
        try:
            pins = []
            for _ in range(PINS_PER_CONNECTION):
                pin, (item,) = _raw_get(conn, [b"p"], 0)  # never released
                assert item.code == 0
                pins.append(pin)
            pin, (item,) = _raw_get(conn, [b"p"], 0)
            assert pin == 0 and item.code == CODE_NUMBERS["RESOURCE_EXHAUSTED"]
            assert "release one" in item.message
            with pytest.raises(InvalidArgument, match="not held"):
                _raw_get(conn, [b"p"], 123_456_789)
        finally:
            conn.close()
        assert wait_until(lambda: metric(pooled.metrics_port, "kvd_shm_pool_pins") == 0)
        assert metric(pooled.metrics_port, "kvd_inflight_bytes") == 0
        assert client.get(NS, b"p") == b"x" * 4096


def test_past_the_pins_share_of_l1_gets_go_through_regions(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(*POOL_READS, "--dram-bytes", "8MiB", "--max-value-bytes", "2MiB")
    values = {b"v%d" % i: _value(1 << 20, 200 + i) for i in range(5)}
    with Client(daemon.socket_target, direct_pool_reads=False) as client:
        for key, value in values.items():
            client.put(NS, key, value)
        holders = [_ops(client).client._connect() for _ in range(3)]
        try:
            for conn, key in zip(holders, values, strict=False):
                pin, (item,) = _raw_get(conn, [key], 0)  # 3 of the 4 MiB pins may hold
                assert pin and item.code == 0
            pin, items = _raw_get(holders[0], [b"v3", b"v4"], 0)
            assert [item.code for item in items] == [0, CODE_NUMBERS["RESOURCE_EXHAUSTED"]]
            assert "of L1" in items[1].message
            rooms = [memoryview(bytearray(1 << 20)) for _ in range(2)]
            assert client.get_many_into(NS, [b"v3", b"v4"], rooms) == [1 << 20, 1 << 20]
            assert [bytes(room) for room in rooms] == [values[b"v3"], values[b"v4"]]
            assert metric(daemon.metrics_port, 'kvd_hits_total{op="shm_get",tier="l1"}') >= 1
        finally:
            for conn in holders:
                conn.close()


def test_bad_pool_frames_get_a_code(pooled: DaemonProcess) -> None:
    with Client(pooled.socket_target, direct_pool_reads=False) as client:
        conn = _ops(client).client._connect()
        try:
            head = encode_request(OP_POOL_GET, 0, NS.encode(), length=10)
            frame = head[:40] + POOL_REF.pack(0, 3, 4) + head[40:] + b"k" * 10
            conn.send([memoryview(frame)])
            answer = conn.answer()
            assert answer.code == CODE_NUMBERS["INVALID_ARGUMENT"]
            assert "not 3 keys of 4 bytes" in answer.message
            many = [b"%05d" % i for i in range(2000)]
            with pytest.raises(InvalidArgument, match="max_batch_items"):
                _raw_get(conn, many, 0)
        finally:
            conn.close()
        assert client.get(NS, b"nothing") is None


def test_only_an_admin_token_maps_the_pool(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    tokens = token_file(tmp_path / "tokens.toml")
    daemon = daemon_factory(*POOL_READS, "--auth-tokens-file", str(tokens))
    value = _value(70_000, 3)
    with Client(daemon.socket_target, token=TOKEN_A, direct_pool_reads=False) as tenant:
        assert "shm" in tenant.paths and "shm-pool" not in tenant.paths
        tenant.put("team-a/x", b"k", value)
        assert tenant.get("team-a/x", b"k") == value  # region gets, as without the setting
        with pytest.raises(PermissionDenied, match="admin"):
            _ops(tenant).attach_pool()
        conn = _ops(tenant).client._connect()
        try:
            with pytest.raises(PermissionDenied, match="admin"):
                _raw_get(conn, [b"k"], 0)
        finally:
            conn.close()
    with Client(daemon.socket_target, token=TOKEN_ADMIN, direct_pool_reads=False) as admin:
        assert "shm-pool" in admin.paths
        out = memoryview(bytearray(len(value)))
        assert admin.get_into("team-a/x", b"k", out) == len(value) and bytes(out) == value


def test_off_by_default(daemon: DaemonProcess) -> None:
    with Client(daemon.socket_target, direct_pool_reads=False) as client:
        client.put(NS, b"k", b"v" * 100)
        assert "shm-pool" not in client.paths
        assert "pool_get" not in _ops(client).offered
        with pytest.raises(FailedPrecondition, match="shm_pool_reads"):
            _ops(client).attach_pool()
        conn = _ops(client).client._connect()
        try:
            with pytest.raises(FailedPrecondition, match="shm_pool_reads"):
                _raw_get(conn, [b"k"], 0)
        finally:
            conn.close()
        assert client.get(NS, b"k") == b"v" * 100


def test_a_value_only_on_l2_is_read_up_first(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(*POOL_READS, "--dram-bytes", "4MiB", "--max-value-bytes", "1MiB")
    values = [_value(256 << 10, 50 + i) for i in range(40)]  # 2.5x L1
    with Client(daemon.socket_target, direct_pool_reads=False) as client:
        for i, value in enumerate(values):
            client.put(NS, b"cold-%d" % i, value, durable=True)
        assert "shm-pool" in client.paths
        rooms = [memoryview(bytearray(len(v))) for v in values[:4]]
        keys = [b"cold-%d" % i for i in range(4)]
        assert client.get_many_into(NS, keys, rooms) == [len(v) for v in values[:4]]
        assert [bytes(room) for room in rooms] == values[:4]
    assert (
        metric(daemon.metrics_port, 'kvd_fetch_duration_seconds_count{op="shm_pool_get",tier="l2"}')
        >= 1
    )


def test_a_copy_that_does_not_match_its_checksum_is_data_loss(tmp_path: Path) -> None:
    fd = os.memfd_create("pool")
    os.ftruncate(fd, 1 << 20)
    with open(f"/proc/self/fd/{fd}", "r+b") as pool_file:
        pool_file.write(b"a" * 4096)
    pool = PoolMap(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY), 1 << 20)
    os.close(fd)
    try:
        good = checksum(b"a" * 4096)
        item = PoolItem(0, "", 4096, good, b"", 1, ((0, 4096),))
        out = memoryview(bytearray(4096))
        assert pool.copy(item, out)
        assert not pool.copy(PoolItem(0, "", 4096, good ^ 1, b"", 1, ((0, 4096),)), out)
        pool.verify = False  # spans that do not make the value fail unverified too
        outside = PoolItem(0, "", 4096, good, b"", 1, (((1 << 20) - 100, 4096),))
        assert not pool.copy(outside, out)
        short = PoolItem(0, "", 8192, good, b"", 1, ((0, 4096),))
        assert not pool.copy(short, memoryview(bytearray(8192)))
    finally:
        pool.close()
    assert issubclass(DataLoss, Exception)


def test_gets_go_on_after_the_daemon_restarts(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    where = tmp_path / "restarted"
    first = daemon_factory(*POOL_READS, workdir=where)
    value = _value(65_536, 9)
    key = hashlib.sha256(b"restart").digest()
    with Client(first.socket_target, direct_pool_reads=False) as client:
        client.put(NS, key, value)
        out = memoryview(bytearray(len(value)))
        assert client.get_into(NS, key, out) == len(value)
        first.stop()
        second = daemon_factory(*POOL_READS, workdir=where)
        assert second.socket == first.socket
        got = first_answer(lambda: client.get_into(NS, key, out))
        assert got == len(value) and bytes(out) == value  # L2 kept it
        assert _shm(client).pool_reads
