"""Write-back's durable puts fail with typed errors that keep the errno; the
error registry, not the store, gives them their codes. Exists finds values
written back and gone from L1."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.io import faults
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.tier import L2Tier
from kvd.store.store import Store
from kvd.store.writeback import DurableNoRoom, DurableWriteFailed
from kvd.wire.checksum import checksum
from kvd.wire.errors import KvdError, error_number
from tests.l2 import MiB, backend, open_devices
from tests.store.support import store_limits


@pytest.mark.parametrize(
    ("spec", "error", "errno_code", "code"),
    [
        ("fsync:eio:nth=1", DurableWriteFailed, 5, 14),  # EIO -> UNAVAILABLE
        ("write:enospc:nth=1", DurableNoRoom, 28, 8),  # ENOSPC -> RESOURCE_EXHAUSTED
    ],
)
async def test_a_failed_durable_put_keeps_its_errno(
    tmp_path: Path, spec: str, error: type[Exception], errno_code: int, code: int
) -> None:
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    tier = L2Tier(devices, faults.wrap(backend("threads"), spec))
    await tier.recover()
    store = Store(Pool(16 * PAGE_BYTES), store_limits(), l2=tier)
    store.start()
    try:
        value = b"v" * 1000
        with pytest.raises(error) as raised:
            await store.put("ns", b"k", value, hasher=checksum, durable=True)
        assert getattr(raised.value, "errno", None) == errno_code
        assert isinstance(raised.value, KvdError) and error_number(raised.value) == code
        assert store.l1_size("ns", b"k") is None  # a failed durable put leaves nothing
    finally:
        await store.close()
        tier.close()


async def test_exists_finds_values_in_l1_and_on_l2(tmp_path: Path) -> None:
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    tier = L2Tier(devices, backend("threads"))
    await tier.recover()
    store = Store(Pool(16 * PAGE_BYTES), store_limits(), l2=tier)
    store.start()
    try:
        for key in (b"l1", b"l2", b"both"):
            await store.put("ns", key, key * 100, hasher=checksum, durable=True)
        assert store.evict("ns", b"l2")  # on L2 alone now
        keys = [b"l2", b"none", b"l1", b"both", b"l2", b"gone"]
        assert store.exists("ns", keys) == [True, False, True, True, True, False]
        assert store.exists("other", keys) == [False] * len(keys)
        assert tier.holds("ns", [b"l2", b"none"]) == [True, False]
    finally:
        await store.close()
        tier.close()
