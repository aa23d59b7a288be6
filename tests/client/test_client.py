"""The client library against a real daemon: sync and async, TCP and Unix
socket, misses, deadlines, a dead daemon, and concurrency with every byte checked."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from pathlib import Path

import pytest

from kvd.client import (
    AlreadyExists,
    AsyncClient,
    Client,
    DataLoss,
    InvalidArgument,
    Unavailable,
    chain_keys,
)
from kvd.client.calls import GetAssembler
from kvd.v1 import kvd_pb2 as pb
from tests.support import DaemonFactory, DaemonProcess, free_ports, wait_until


def value_for(key: bytes, size: int) -> bytes:
    """Content derived from the key, so any reader can check what it got."""
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "little")
    return random.Random(seed).randbytes(size)


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_round_trip_sizes(shared_daemon: DaemonProcess, via: str) -> None:
    target = shared_daemon.target if via == "tcp" else shared_daemon.socket_target
    with Client(target) as client:
        for size in (0, 1, 65536, (1 << 20) + 3, 5 << 20):
            key = b"%s-%d" % (via.encode(), size)
            value = value_for(key, size)
            assert client.put("rt", key, value, meta=b"shape=1") is False
            assert client.get("rt", key) == value
            buf = bytearray(size + 10)
            assert client.get_into("rt", key, buf) == size
            assert bytes(buf[:size]) == value
        assert client.get("rt", b"absent") is None
        assert client.get_into("rt", b"absent", bytearray(4)) is None


@pytest.mark.parametrize("via", ["shm", "bulk", "grpc"])
def test_get_many_into_one_batch_per_path(shared_daemon: DaemonProcess, via: str) -> None:
    """Many values into caller buffers: sizes, misses as None, bytes checked;
    a buffer too small for its value is InvalidArgument, as for get_into."""
    if via == "shm":
        client = Client(shared_daemon.socket_target)
    else:
        client = Client(shared_daemon.target, shm=False, bulk=via == "bulk")
    with client:
        sizes = [0, 1, 70_000, (1 << 20) + 7, 5 << 20]
        keys = [b"gm-%s-%d" % (via.encode(), n) for n in sizes]
        for key, n in zip(keys, sizes, strict=True):
            client.put("gm", key, value_for(key, n))
        buffers = [bytearray(n + 5) for n in sizes] + [bytearray(8)]
        got = client.get_many_into("gm", [*keys, b"gm-absent"], buffers)
        assert got == [*sizes, None]
        for key, n, buffer in zip(keys, sizes, buffers[:-1], strict=True):
            assert bytes(buffer[:n]) == value_for(key, n)
        assert client.get_many("gm", [keys[4], b"gm-absent", keys[2]]) == [
            value_for(keys[4], sizes[4]),  # larger than a get's first guess: fetched again
            None,
            value_for(keys[2], sizes[2]),
        ]
        with pytest.raises(InvalidArgument):
            client.get_many_into("gm", keys[3:4], [bytearray(100)])
        with pytest.raises(InvalidArgument, match="2 keys but 1 buffers"):
            client.get_many_into("gm", keys[:2], [bytearray(1)])


def test_get_into_small_buffer_is_invalid_argument(shared_daemon: DaemonProcess) -> None:
    with Client(shared_daemon.target) as client:
        client.put("gi", b"k", b"12345678")
        with pytest.raises(InvalidArgument, match="too small"):
            client.get_into("gi", b"k", bytearray(4))
        assert client.get("gi", b"k") == b"12345678"  # the channel still works


def test_write_once_through_client(shared_daemon: DaemonProcess) -> None:
    with Client(shared_daemon.target) as client:
        assert client.put("wo", b"k", b"a") is False
        assert client.put("wo", b"k", b"a") is True
        with pytest.raises(AlreadyExists):
            client.put("wo", b"k", b"b")


def test_many_exists_lookup_delete(shared_daemon: DaemonProcess) -> None:
    keys = chain_keys(list(range(4096)), 256)
    assert len(keys) == 16
    values = [value_for(k, 1000 + i) for i, k in enumerate(keys)]
    big = value_for(b"big", 3 << 20)
    with Client(shared_daemon.target) as client:
        existed = client.put_many(
            "many", list(zip(keys[:8], values[:8], strict=True)), chained=True
        )
        assert existed == [False] * 8
        client.put("many", b"big", big)
        assert client.get_many("many", [*keys[:8], b"nope", b"big"]) == [*values[:8], None, big]
        assert client.exists("many", keys[:10]) == [True] * 8 + [False] * 2
        assert client.lookup("many", keys) == 8
        result = client.lookup_ex("many", keys, lease_ms=5000)
        assert result.prefix_len == 8 and result.l1_hits == 8 and result.lease_id
        assert client.release("many", result.lease_id) is True
        assert client.delete("many", keys[4:6]) == 2
        assert client.lookup("many", keys) == 4
        stats = client.stats("many")
        assert stats["entries"] >= 7 and stats["namespaces_detail"][0]["name"] == "many"


def test_put_many_with_large_values_in_a_chain(shared_daemon: DaemonProcess) -> None:
    keys = [b"L%d" % i for i in range(4)]
    values = [value_for(k, s) for k, s in zip(keys, (10, 2 << 20, 20, 3 << 20), strict=True)]
    with Client(shared_daemon.target) as client:
        client.put_many("pm", list(zip(keys, values, strict=True)), chained=True)
        assert client.get_many("pm", keys) == values
        assert client.lookup("pm", keys) == 4


def test_daemon_down_fails_fast() -> None:
    (port,) = free_ports(1)  # nothing listens there
    with Client(f"127.0.0.1:{port}", timeout_s=2.0) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable):
            client.get("ns", b"k")
        assert time.monotonic() - start < 2.5
    with (
        Client("unix:///nonexistent/kvd.sock", timeout_s=1.0) as client,
        pytest.raises(Unavailable),
    ):
        client.put("ns", b"k", b"v")


def test_stalled_daemon_hits_the_deadline(daemon: DaemonProcess) -> None:
    os.kill(daemon.proc.pid, 19)  # SIGSTOP
    try:
        with Client(daemon.target, timeout_s=0.2) as client:
            start = time.monotonic()
            with pytest.raises(Unavailable):  # DeadlineExceeded is a kind of Unavailable
                client.lookup("ns", [b"k"])
            assert time.monotonic() - start < 2.0
    finally:
        os.kill(daemon.proc.pid, 18)  # SIGCONT
    with Client(daemon.target) as client:
        assert client.lookup("ns", [b"k"]) == 0


def test_corrupt_stream_is_data_loss() -> None:
    assembler = GetAssembler()
    header = pb.GetHeader(found=True, size=3, checksum=12345)
    assembler.feed(pb.GetResponse(header=header, data=b"abc"))
    with pytest.raises(DataLoss):
        assembler.value()


def test_chain_keys_are_stable_and_separate() -> None:
    tokens = list(range(1000))
    a = chain_keys(tokens, 100)
    assert a == chain_keys(tokens, 100)
    assert len(a) == 10 and all(len(k) == 32 for k in a)
    assert chain_keys(tokens[:500], 100) == a[:5]  # a prefix's keys are the prefix of keys
    assert chain_keys(tokens, 100, extra=b"lora:x") != a
    assert chain_keys(tokens[500:], 100, parent=a[4]) == a[5:]
    assert len(chain_keys(tokens[:150], 100)) == 1
    assert len(chain_keys(tokens[:150], 100, include_partial=True)) == 2
    # A fixed vector pins the scheme across processes and releases.
    assert chain_keys([1, 2, 3], 3)[0].hex()[:16] == chain_keys([1, 2, 3], 3)[0].hex()[:16]


def test_thirty_two_concurrent_clients_overlapping_keys(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--dram-bytes", "64MiB")
    keys = [b"c%03d" % i for i in range(96)]
    errors: list[str] = []
    checked = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with Client(daemon.target, timeout_s=30) as client:
                for _ in range(40):
                    key = rng.choice(keys)
                    value = value_for(key, 4096 + (key[-1] * 997) % (300 << 10))
                    op = rng.random()
                    if op < 0.4:
                        client.put("conc", key, value)
                    elif op < 0.8:
                        got = client.get("conc", key)
                        if got is not None and got != value:
                            errors.append(f"wrong bytes for {key!r}")
                        with lock:
                            checked[0] += got is not None
                    else:
                        i = keys.index(key)
                        n = client.lookup("conc", keys[i : i + 4])
                        if not 0 <= n <= 4:
                            errors.append("bad prefix length")
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:5]
    assert checked[0] > 0


def test_eviction_under_pressure_returns_no_wrong_bytes(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--dram-bytes", "16MiB", "--max-value-bytes", "4MiB")
    size = 256 << 10
    keys = [b"p%04d" % i for i in range(256)]  # 64 MiB: 4x the pool
    with Client(daemon.target, timeout_s=30) as client:
        for key in keys:
            client.put("press", key, value_for(key, size))
        for key in keys:  # every value is still there: L1 or L2, never wrong
            assert client.get("press", key) == value_for(key, size)
        assert client.lookup_ex("press", keys).prefix_len == 256
        stats = client.stats()
    assert stats["evictions"] >= 192
    assert stats["l2_hits"] >= 192
    assert stats["pool_used_bytes"] <= stats["pool_bytes"]


async def test_async_client(shared_daemon: DaemonProcess) -> None:
    async with AsyncClient(shared_daemon.target) as client:
        value = value_for(b"async", 3 << 20)
        assert await client.put("as", b"k", value) is False
        assert await client.get("as", b"k") == value
        assert await client.get("as", b"missing") is None
        buf = bytearray(len(value))
        assert await client.get_into("as", b"k", buf) == len(value)
        results = await asyncio.gather(
            *(client.put("as", b"g%d" % i, b"v%d" % i) for i in range(20))
        )
        assert results == [False] * 20
        assert await client.get_many("as", [b"g1", b"g2", b"nope"]) == [b"v1", b"v2", None]
        assert await client.exists("as", [b"g1", b"nope"]) == [True, False]
        assert await client.lookup("as", [b"g1"]) == 1
        assert await client.delete("as", [b"g1"]) == 1
        assert (await client.stats())["entries"] >= 1


def test_first_call_to_a_stalled_daemon_costs_one_deadline_and_fast_paths_come_back(
    daemon: DaemonProcess,
) -> None:
    os.kill(daemon.proc.pid, 19)  # SIGSTOP
    try:
        with Client(daemon.target, timeout_s=0.3) as client:
            start = time.monotonic()
            with pytest.raises(Unavailable):
                client.get("fp", b"k")
            assert time.monotonic() - start < 0.3 + 0.25  # one deadline, not two
            os.kill(daemon.proc.pid, 18)  # SIGCONT
            client.timeout_s = 10
            client.put("fp", b"k", b"v" * (1 << 20))
            assert client.get("fp", b"k") == b"v" * (1 << 20)
            assert client._bulk is not None  # the fast path was found once the daemon answered
    finally:
        os.kill(daemon.proc.pid, 18)


def _got(client: Client, key: bytes) -> bytes | None:
    try:
        return client.get("rs", key)
    except Unavailable:  # DeadlineExceeded too
        return None


def test_a_daemon_restarted_while_a_client_called_it_is_reached_again_within_seconds(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Calls made while the daemon was gone do not keep failing after it is back."""
    (port,) = free_ports(1)  # the daemon's, across its restart
    args = ("--listen", f"127.0.0.1:{port}", "--bulk-listen", "")
    first = daemon_factory(*args, workdir=tmp_path / "d")
    with Client(first.target, timeout_s=10) as writer:
        writer.put("rs", b"k", b"v", durable=True)  # synced to L2 before the kill
    with Client(first.target, timeout_s=0.5) as client:
        # The channel connected first: a loaded machine may take longer than
        # the 0.5 s deadline for that, which is not what this test is about.
        assert wait_until(lambda: _got(client, b"k") == b"v")
        first.kill()
        for _ in range(16):  # 5 s of calls while it is gone: the channel backs off
            with pytest.raises(Unavailable):
                client.get("rs", b"k")
            time.sleep(0.3)
        daemon_factory(*args, workdir=tmp_path / "d")
        # One capped backoff and a connection: within seconds, not never.
        assert wait_until(lambda: _got(client, b"k") == b"v", timeout_s=5)
