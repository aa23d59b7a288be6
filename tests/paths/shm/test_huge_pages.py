"""Shared memory on huge pages, end to end (kvd.util.hugepages).

With the kernel's shmem huge pages on ``advise``, a real daemon with pool
reads reports its L1 pool on huge pages at start, a client's region is on
huge pages, the client's mapping of the pool maps them whole once read,
and gets through the pool's directory and region gets come back whole."""

from __future__ import annotations

import hashlib
import re

import numpy as np

from kvd.client import Client
from kvd.util.hugepages import huge_page_bytes
from tests.support import DaemonFactory

MiB = 1 << 20
NS = "huge-pages"


def _started(log: list[str], field: str) -> str:
    """A field of the daemon's start-up line (``key=value`` pairs)."""
    line = next(line for line in log if "kvd started" in line)
    found = re.search(rf"\b{field}=(\S*)", line)
    assert found is not None, line
    return found.group(1)


def test_pool_regions_and_client_mappings_on_huge_pages(
    daemon_factory: DaemonFactory, shmem_huge_pages: str
) -> None:
    daemon = daemon_factory("--shm-pool-reads", "true", "--dram-bytes", str(64 * MiB))
    assert int(_started(daemon.log, "dram_huge_page_bytes")) == 64 * MiB
    assert _started(daemon.log, "shmem_huge_pages") == "advise"
    values = {
        hashlib.sha256(b"huge-%d" % i).digest(): np.random.default_rng(i)
        .integers(0, 256, 4 * MiB, dtype=np.uint8)
        .tobytes()
        for i in range(4)
    }
    with Client(daemon.socket_target) as client:
        assert "shm-pool-direct" in client.paths
        room = client.buffer(4 * MiB)
        shm, _ = client._fast_paths()
        assert shm is not None
        located = shm.locate(room)
        assert located is not None
        assert huge_page_bytes(located[0].mapping) == 4 * MiB
        for key, value in values.items():
            room[:] = value
            client.put(NS, key, room)
        pool = shm.pools.map
        assert pool is not None
        for key, value in values.items():
            room[:] = b"\0" * len(room)
            assert client.get_into(NS, key, room) == len(value)
            assert bytes(room) == value
        assert pool.direct_hits == len(values)
        # The client's mapping of the pool: the values read, 2 MiB at a time.
        assert huge_page_bytes(pool._mmap) >= len(values) * 4 * MiB
