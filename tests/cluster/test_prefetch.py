"""Values a leased lookup found at their owners are fetched at once
(``pool_prefetch_keys``, kvd.cluster.prefetch): two real daemons on
loopback, the chains owned by the other member. Without any get, the
values land in the asking member's L1, and the get that follows reads no
peer again and gets the right bytes; a lookup without a lease fetches
nothing; a chain longer than the setting has only its first keys fetched,
and the get reads the rest itself. In process: at most ``RUNNING_MAX``
lookups' fetches run at once (the others are dropped and counted), and a
fetch runs outside the lookup's deadline."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator

import pytest

from kvd.client import Client
from kvd.cluster import scope
from kvd.cluster.prefetch import RUNNING_MAX, Prefetches
from kvd.cluster.rendezvous import Placement
from tests.cluster.cluster import start_static_pool
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

PREFETCH_KEYS = 4
LEASE_MS = 10_000


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 1024  # 32 KiB, different per key


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    root = tmp_path_factory.mktemp("prefetch")
    daemons = start_static_pool(
        root, 2, "--pool-prefetch-keys", str(PREFETCH_KEYS), peer_timeout_ms=2000
    )
    yield daemons
    for daemon in daemons:
        daemon.discard()


def owned_by_b(pool: list[DaemonProcess], namespace: str, count: int) -> list[bytes]:
    """A chain of ``count`` keys member 1 owns, put through it (nowhere else)."""
    placement = Placement([d.target for d in pool])
    names = (f"{namespace}-{i:05d}".encode() for i in range(100_000))
    keys = [key for key in names if placement.owner(namespace, key) == pool[1].target][:count]
    with Client(pool[1].target) as b:
        for key in keys:
            b.put(namespace, key, value_of(key))
    return keys


def counted(daemon: DaemonProcess, name: str) -> float:
    return metric(daemon.metrics_port, f"kvd_cluster_{name}_total")


def test_a_leased_lookup_fetches_what_it_found_before_the_get(pool: list[DaemonProcess]) -> None:
    a = pool[0]
    keys = owned_by_b(pool, "leased", PREFETCH_KEYS)
    hits, gets = counted(a, "remote_hits"), counted(a, "remote_gets")
    with Client(a.target) as engine:
        found = engine.lookup_ex("leased", keys, LEASE_MS)
        assert found.prefix_len == len(keys)
        # No get yet: the values land in a's L1 all the same.
        assert wait_until(lambda: counted(a, "remote_hits") == hits + len(keys))
        assert counted(a, "prefetched") >= len(keys)
        assert engine.get_many("leased", keys) == [value_of(key) for key in keys]
    assert counted(a, "remote_gets") == gets + len(keys)  # the get read no peer again


def test_a_lookup_without_a_lease_fetches_nothing(pool: list[DaemonProcess]) -> None:
    a = pool[0]
    unleased = owned_by_b(pool, "unleased", PREFETCH_KEYS)
    marker = owned_by_b(pool, "marker", 2)
    gets = counted(a, "remote_gets")
    with Client(a.target) as engine:
        assert engine.lookup("unleased", unleased) == len(unleased)
        # A leased lookup after it: once its values landed, any fetch the
        # first lookup had started would have been counted too.
        assert engine.lookup_ex("marker", marker, LEASE_MS).prefix_len == len(marker)
        assert wait_until(lambda: counted(a, "remote_gets") >= gets + len(marker))
        time.sleep(0.2)
        assert counted(a, "remote_gets") == gets + len(marker)
        assert engine.get_many("unleased", unleased) == [value_of(key) for key in unleased]
    assert counted(a, "remote_gets") == gets + len(marker) + len(unleased)


def test_only_the_first_keys_of_a_long_chain_are_fetched(pool: list[DaemonProcess]) -> None:
    a = pool[0]
    keys = owned_by_b(pool, "long", 3 * PREFETCH_KEYS)
    gets, prefetched = counted(a, "remote_gets"), counted(a, "prefetched")
    with Client(a.target) as engine:
        assert engine.lookup_ex("long", keys, LEASE_MS).prefix_len == len(keys)
        assert wait_until(lambda: counted(a, "remote_gets") >= gets + PREFETCH_KEYS)
        assert counted(a, "prefetched") == prefetched + PREFETCH_KEYS
        assert engine.get_many("long", keys) == [value_of(key) for key in keys]
    assert counted(a, "remote_gets") == gets + len(keys)  # the rest read by the get


async def test_at_most_running_max_lookups_fetch_at_once_outside_their_deadline() -> None:
    release = asyncio.Event()
    asked: list[tuple[str, list[bytes], bool, float | None]] = []

    async def fetch(namespace: str, keys: list[bytes]) -> None:
        now = scope.current()
        asked.append((namespace, keys, now.hop, now.deadline))
        await release.wait()

    prefetches = Prefetches(fetch, keys_max=2)
    with scope.as_hop():  # a lookup's own scope, which its fetches must not take
        for i in range(RUNNING_MAX + 3):
            prefetches.start(f"ns-{i}", [b"a", b"b", b"c"])
    prefetches.start("empty", [])
    await asyncio.sleep(0.01)
    assert [namespace for namespace, *_ in asked] == [f"ns-{i}" for i in range(RUNNING_MAX)]
    assert all(keys == [b"a", b"b"] and not hop and deadline is None
               for _, keys, hop, deadline in asked)  # fmt: skip
    assert (prefetches.values, prefetches.dropped) == (2 * RUNNING_MAX, 3)
    release.set()
    await asyncio.gather(*prefetches.tasks())
    prefetches.start("after", [b"x"])  # room again
    await asyncio.gather(*prefetches.tasks())
    assert asked[-1][:2] == ("after", [b"x"])
