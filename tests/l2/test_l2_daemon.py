"""The L2 tier through a real daemon: larger-than-L1 round trips, restarts,
on-disk corruption (kill -9 torture is in tests/fault/test_crash.py).

Values are derived from their keys, so any value read back can be checked
without keeping it: a wrong byte anywhere fails the test.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from kvd.client import Client, ResourceExhausted, Unavailable
from kvd.io.backend import native_available, open_backend
from kvd.l2 import DeviceSet, L2Tier
from kvd.tools.bench.daemon import written_back
from tests.sockets import metric
from tests.support import WRITE_BACK_WAIT_S, DaemonProcess, wait_until

MiB = 1 << 20
BACKENDS = ["threads", "uring"]


def value_for(key: bytes, size: int) -> bytes:
    seed = int.from_bytes(key[-8:].rjust(8, b"\0"), "little")
    return random.Random(seed).randbytes(size)


def start(
    workdir: Path, *args: str, paths: int = 1, backend: str = "threads", ssd: str = "64MiB"
) -> DaemonProcess:
    extra = []
    for i in range(1, paths):
        extra += ["--ssd-path", str(workdir / f"ssd-{i}.dat")]
    return DaemonProcess(
        workdir, [*extra, "--io-backend", backend, *args], dram="16MiB", max_value="4MiB",
        ssd=ssd, segment="8MiB",
    )  # fmt: skip


def skip_without(backend: str) -> None:
    if backend == "uring" and not native_available()[0]:
        pytest.skip(native_available()[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paths", [1, 3])
def test_round_trip_four_times_l1(tmp_path: Path, backend: str, paths: int) -> None:
    skip_without(backend)
    daemon = start(tmp_path, paths=paths, backend=backend, ssd="160MiB")
    sizes = [1, 4096, 65536, 300_000, MiB + 7, 3 * MiB]
    keys = [b"rt%04d" % i for i in range(80)]  # ~80 MiB over a 16 MiB pool
    try:
        with Client(daemon.target, timeout_s=30) as client:
            for i, key in enumerate(keys):
                client.put("l2", key, value_for(key, sizes[i % len(sizes)]))
            for i, key in enumerate(reversed(keys)):
                size = sizes[(len(keys) - 1 - i) % len(sizes)]
                assert client.get("l2", key) == value_for(key, size)
            stats = client.stats()
        assert stats["l2_hits"] > 0 and stats["evictions"] > 0
        assert stats["checksum_failures"] == 0
    finally:
        assert daemon.stop() == 0


def test_durable_puts_survive_sigterm_restart(tmp_path: Path) -> None:
    daemon = start(tmp_path)
    keys = [b"d%03d" % i for i in range(40)]
    with Client(daemon.target, timeout_s=30) as client:
        for key in keys:
            client.put("dur", key, value_for(key, 200_000), meta=b"m" + key, durable=True)
        client.put("dur", b"cold", b"read before any lookup", durable=True)
        client.put("dur", b"gone", b"deleted before the restart", durable=True)
        assert client.delete("dur", [b"gone"]) == 1
    assert daemon.stop() == 0
    daemon = start(tmp_path)
    try:
        assert any("l2_recovered=41" in line for line in daemon.log), daemon.log[-3:]
        port = daemon.metrics_port
        with Client(daemon.target, timeout_s=30) as client:
            assert client.get("dur", b"cold") == b"read before any lookup"
            # The cold value was read over the bulk TCP port from L2: an L2
            # hit (counted once its answer is sent).
            l2_hits = 'kvd_hits_total{op="bulk_get",tier="l2"}'
            assert wait_until(lambda: metric(port, l2_hits) == 1, 10)
            assert client.lookup_ex("dur", keys).l2_hits == 40
            # The lookup reads its L2 hits into L1 ahead of their gets; a get
            # that came first would read its value from L2 itself (a loaded
            # CI machine counted 68 L2 hits here), so the gets wait for it.
            assert wait_until(lambda: metric(port, "kvd_l2_promotions_total") == 41, 30)
            for key in keys:
                assert client.get("dur", key) == value_for(key, 200_000)
            assert client.get("dur", b"gone") is None
            assert client.exists("dur", [b"gone"]) == [False]
    finally:
        daemon.stop()


def record_offsets(workdir: Path) -> dict[bytes, tuple[int, int, int]]:
    """key -> (physical offset of the record, header bytes, payload bytes), single path."""

    async def scan() -> dict[bytes, tuple[int, int, int]]:
        devices = DeviceSet([str(workdir / "ssd-0.dat")], 64 * MiB, 8 * MiB, 256 << 10)
        io = open_backend("threads")
        try:
            tier = L2Tier(devices, io)
            await tier.recover()
            out = {
                key: (rec.segment * 8 * MiB + rec.offset, rec.header_bytes, rec.size)
                for (_, key), rec in tier.index.items()
            }
            tier.close()
            return out
        finally:
            io.close()
            devices.close()

    return asyncio.run(scan())


def test_corrupt_payloads_and_headers_miss_others_hit(tmp_path: Path) -> None:
    daemon = start(tmp_path)
    keys = [b"c%03d" % i for i in range(150)]
    with Client(daemon.target, timeout_s=30) as client:
        for key in keys:
            client.put("cor", key, value_for(key, 40_000), durable=True)
    daemon.stop()
    offsets = record_offsets(tmp_path)
    assert len(offsets) == 150
    rng = random.Random(5)
    bad_payload = set(rng.sample(keys, 100))
    bad_header = set(rng.sample(sorted(set(keys) - bad_payload), 10))
    with open(tmp_path / "ssd-0.dat", "r+b") as f:
        for key in bad_payload:
            where, header, size = offsets[key]
            f.seek(where + header + rng.randrange(size))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x5A]))
        for key in bad_header:
            where, _, _ = offsets[key]
            f.seek(where + 80)
            f.write(b"\xff\xfe")
    daemon = start(tmp_path)
    try:
        with Client(daemon.target, timeout_s=30) as client:
            for key in keys:
                got = client.get("cor", key)
                if key in bad_payload or key in bad_header:
                    assert got is None, key
                else:
                    assert got == value_for(key, 40_000), key
            assert client.exists("cor", sorted(bad_header)) == [False] * 10
            stats = client.stats()
        assert stats["checksum_failures"] == 100
        assert daemon.alive()
    finally:
        daemon.stop()


def test_second_daemon_on_the_same_ssd_path_is_refused(tmp_path: Path) -> None:
    daemon = start(tmp_path)
    try:
        other = tmp_path / "other"
        other.mkdir()
        with pytest.raises(RuntimeError, match="in use"):
            DaemonProcess(
                other, ["--ssd-path", str(tmp_path / "ssd-0.dat")],
                ssd="64MiB", max_value="4MiB", segment="8MiB",
            )  # fmt: skip
        assert daemon.alive()
    finally:
        daemon.stop()


def test_namespace_quotas(tmp_path: Path) -> None:
    daemon = start(
        tmp_path, "--namespace-l1-quota-bytes", "2MiB", "--namespace-l2-quota-bytes", "4MiB"
    )
    value = b"q" * (512 << 10)
    try:
        with Client(daemon.target, timeout_s=30) as client:
            for i in range(40):  # 20 MiB into one namespace
                try:
                    client.put("qa", b"k%d" % i, value)
                except ResourceExhausted:
                    # The namespace's L1 share is all waiting for write-back
                    # (a busy machine): refused, not dropped. Once it is
                    # written, the same put goes in.
                    assert written_back(client, WRITE_BACK_WAIT_S)
                    client.put("qa", b"k%d" % i, value)
            client.put("qb", b"other", value)
            stats = client.stats("qa")
            qa = next(n for n in stats["namespaces_detail"] if n["name"] == "qa")
            assert qa["bytes"] <= 2 << 20  # L1 share held to its quota
            assert client.get("qb", b"other") == value  # the other tenant kept its value
            assert written_back(client, WRITE_BACK_WAIT_S)
            present = sum(client.exists("qa", [b"k%d" % i for i in range(40)]))
            assert 0 < present <= 11  # <= 7 records of 576 KiB on L2, 4 values in L1
            with pytest.raises(ResourceExhausted):
                client.put("qa", b"big-durable", b"d" * (3 << 20), durable=True)
            assert client.exists("qa", [b"big-durable"]) == [False]
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    ("faults", "error"),
    [
        ("write:eio:nth=2", Unavailable),  # write 1 is the segment marker
        ("write:enospc:nth=2", ResourceExhausted),
        ("fsync:eio:nth=1", Unavailable),
        ("write:short:nth=2", Unavailable),
    ],
)
def test_durable_put_on_a_failing_disk(tmp_path: Path, faults: str, error: type) -> None:
    daemon = start(tmp_path, "--io-faults", faults)
    try:
        with Client(daemon.target, timeout_s=30) as client:
            with pytest.raises(error):
                client.put("err", b"first", value_for(b"first", 100_000), durable=True)
            assert client.exists("err", [b"first"]) == [False]  # a failed store is not visible
            # The fault fired once: the daemon is up and the disk works again.
            client.put("err", b"second", value_for(b"second", 100_000), durable=True)
            assert client.get("err", b"second") == value_for(b"second", 100_000)
            assert client.stats()["writeback_errors"] >= 1
    finally:
        assert daemon.stop() == 0
    daemon = start(tmp_path)
    try:
        with Client(daemon.target, timeout_s=30) as client:
            assert client.get("err", b"second") == value_for(b"second", 100_000)
            assert client.get("err", b"first") is None
    finally:
        daemon.stop()


def test_write_back_errors_keep_puts_in_l1_and_the_daemon_up(tmp_path: Path) -> None:
    daemon = start(tmp_path, "--io-faults", "write:eio:every=3")
    keys = [b"wb%03d" % i for i in range(30)]
    try:
        with Client(daemon.target, timeout_s=30) as client:
            for key in keys:  # acknowledged from L1 whatever the disk does
                client.put("wb", key, value_for(key, 100_000))
            for key in keys:
                got = client.get("wb", key)
                assert got is None or got == value_for(key, 100_000)
            # Write-back runs behind the puts: on a busy machine the third
            # write may not have been tried yet when the gets end.
            assert wait_until(lambda: client.stats()["l2_write_errors"] >= 1, 30.0)
            stats = client.stats()
        assert stats["checksum_failures"] == 0
        assert daemon.alive()
    finally:
        assert daemon.stop() == 0


def test_lookup_prefetches_l2_hits_into_l1(tmp_path: Path) -> None:
    daemon = start(tmp_path)
    keys = [b"pf%02d" % i for i in range(12)]
    with Client(daemon.target, timeout_s=30) as client:
        for key in keys:
            client.put("pf", key, value_for(key, 500_000), durable=True)
    daemon.stop()
    daemon = start(tmp_path)  # L1 empty: the chain is on L2 only
    try:
        with Client(daemon.target, timeout_s=30) as client:
            result = client.lookup_ex("pf", keys)
            assert (result.prefix_len, result.l2_hits) == (12, 12)
            deadline = time.monotonic() + 10
            while client.stats()["promotions"] < 12 and time.monotonic() < deadline:
                time.sleep(0.02)
            stats = client.stats()
            assert stats["l2_prefetches"] == 12 and stats["promotions"] == 12
            assert client.lookup_ex("pf", keys).l1_hits == 12
            for key in keys:
                assert client.get("pf", key) == value_for(key, 500_000)
            assert client.stats()["promotions"] == 12  # the gets read nothing more from L2
    finally:
        daemon.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_shm_gets_of_l2_only_values_land_straight_in_the_region(
    tmp_path: Path, backend: str
) -> None:
    """Large L2-only values are read from the disk into the client's region,
    checked, and not copied into L1; a corrupt one is a miss; a size that is
    not whole 4 KiB blocks goes through L1 as before, and so does a value
    read a second time."""
    skip_without(backend)
    size = 1 << 20
    keys = [b"d%03d" % i for i in range(6)]
    odd = b"odd-size"
    daemon = start(tmp_path, backend=backend)
    with Client(daemon.target, timeout_s=30) as client:
        for key in keys:
            client.put("direct", key, value_for(key, size), durable=True)
        client.put("direct", odd, value_for(odd, size - 100), durable=True)
    daemon.stop()
    where, header, _ = record_offsets(tmp_path)[keys[0]]
    with open(tmp_path / "ssd-0.dat", "r+b") as f:
        f.seek(where + header + 12345)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
    # L1 starts empty: every value is L2-only.
    daemon = start(tmp_path, "--shm-l2-direct-min-bytes", "256KiB", backend=backend)
    try:
        with Client(daemon.socket_target, timeout_s=30) as client:
            buffer = client.buffer(size)
            for key in keys[1:]:
                assert client.get_into("direct", key, buffer) == size
                assert bytes(buffer) == value_for(key, size)
            assert client.get_into("direct", keys[0], buffer) is None
            stats = client.stats()
            assert (stats["l2_hits"], stats["promotions"], stats["entries"]) == (5, 0, 0)
            assert stats["checksum_failures"] == 1
            assert client.get_into("direct", odd, buffer) == size - 100
            assert bytes(buffer[: size - 100]) == value_for(odd, size - 100)
            assert client.stats()["promotions"] == 1
            # Read again, a value is being reused: this get promotes it into L1.
            assert client.get_into("direct", keys[1], buffer) == size
            assert bytes(buffer) == value_for(keys[1], size)
            stats = client.stats()
            assert (stats["promotions"], stats["entries"], stats["l2_hits"]) == (2, 2, 7)
        assert daemon.alive()
    finally:
        daemon.stop()
    daemon = start(tmp_path, backend=backend)  # the default: every L2 read goes through L1
    try:
        with Client(daemon.socket_target, timeout_s=30) as client:
            buffer = client.buffer(size)
            assert client.get_into("direct", keys[2], buffer) == size
            assert bytes(buffer) == value_for(keys[2], size)
            assert client.stats()["promotions"] == 1
    finally:
        daemon.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_shm_batch_get_of_an_l2_chain_misses_only_its_damaged_values(
    tmp_path: Path, backend: str
) -> None:
    """A chain restored with one shm batch get (L2 reads batched into one
    call): damaged payloads and headers are misses, every other value right."""
    skip_without(backend)
    keys = [b"ch%03d" % i for i in range(12)]
    size = 200_000
    daemon = start(tmp_path)
    with Client(daemon.target, timeout_s=30) as client:
        for key in keys:
            client.put("chain", key, value_for(key, size), durable=True)
    daemon.stop()
    offsets = record_offsets(tmp_path)
    with open(tmp_path / "ssd-0.dat", "r+b") as f:
        for key in keys[3], keys[7]:
            where, header, _ = offsets[key]
            f.seek(where + header + 4321)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x5A]))
        f.seek(offsets[keys[10]][0] + 80)
        f.write(b"\xff\xfe")
    daemon = start(tmp_path, backend=backend)  # L1 starts empty: every value is L2-only
    try:
        with Client(daemon.socket_target, timeout_s=30) as client:
            buffers = [client.buffer(size) for _ in keys]
            sizes = client.get_many_into("chain", keys, buffers)
            bad = {keys[3], keys[7], keys[10]}
            assert sizes == [None if key in bad else size for key in keys]
            for key, buffer in zip(keys, buffers, strict=True):
                if key not in bad:
                    assert bytes(buffer) == value_for(key, size), key
            stats = client.stats()
        # The damaged header is not recovered (a plain miss); the payloads fail their checksums.
        assert stats["checksum_failures"] == 2
        assert (stats["l2_hits"], stats["promotions"]) == (9, 9)
        assert daemon.alive()
    finally:
        daemon.stop()
