"""Three real daemons on loopback in one static pool: a chain stored through
one is found and read through the others, and an owner that stops (SIGSTOP)
or dies (SIGKILL) costs misses, never errors or wrong bytes."""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import threading
from collections.abc import Iterator
from itertools import compress
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.wire.errors import InvalidArgument
from tests.cluster.cluster import start_static_pool
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

# Each client call may take this long; a peer call gives up after 200 ms, so
# a call that returns at all returned well inside it.
CLIENT_TIMEOUT_S = 5.0
# Two batch gets at once of this many 60,000-byte values each, so many times.
BATCH_KEYS = 16
OWN_KEYS = 40
BATCH_ROUNDS = 40


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 300  # ~9.6 KiB, different per key


def chain(namespace: str, count: int) -> list[bytes]:
    return [f"{namespace}-block-{i:04d}".encode() for i in range(count)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    # Pool reads on: a shared-memory client may read L1 pages in place.
    daemons = start_static_pool(tmp_path_factory.mktemp("pool"), 3, "--shm-pool-reads", "true")
    yield daemons
    for daemon in daemons:
        if daemon.alive():
            os.kill(daemon.proc.pid, signal.SIGCONT)
        daemon.discard()


_open: list[Client] = []


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


def client_of(daemon: DaemonProcess, **options: bool) -> Client:
    client = Client(daemon.target, timeout_s=CLIENT_TIMEOUT_S, **options)
    _open.append(client)
    return client


def shm_client_of(daemon: DaemonProcess, pool_reads: bool = False) -> Client:
    """A client of the daemon's Unix socket: shared memory, L1 read in place with ``pool_reads``."""
    client = Client(f"unix://{daemon.socket}", timeout_s=CLIENT_TIMEOUT_S, pool_reads=pool_reads)
    _open.append(client)
    return client


def rooms(client: Client, size: int, count: int) -> list[memoryview]:
    """``count`` rooms of ``size`` bytes, one after the other in one region (one batch)."""
    region = client.buffer(size * count)
    return [region[i * size : (i + 1) * size] for i in range(count)]


def clients(pool: list[DaemonProcess]) -> list[Client]:
    return [client_of(daemon) for daemon in pool]


def placement(pool: list[DaemonProcess]) -> Placement:
    return Placement([d.target for d in pool])


def store_chain(client: Client, namespace: str, keys: list[bytes]) -> None:
    for key in keys:
        client.put(namespace, key, value_of(key))


def test_chain_stored_on_one_is_found_and_read_through_another(pool: list[DaemonProcess]) -> None:
    a, b, c = clients(pool)
    keys = chain("found", 60)
    store_chain(a, "found", keys)
    owners = placement(pool).owners("found", keys)
    assert len(set(owners)) == 3  # the chain really is spread over the pool
    # A put is answered by the daemon it reached, then handed to its owner.
    assert wait_until(lambda: b.lookup("found", keys) == len(keys))
    assert c.lookup("found", keys) == len(keys)
    assert a.lookup("found", keys) == len(keys)
    assert c.exists("found", keys) == [True] * len(keys)  # the connectors' other question
    # Gets through another daemon: bulk TCP (the client's default) and gRPC.
    assert [b.get("found", key) for key in keys] == [value_of(key) for key in keys]
    c_grpc = client_of(pool[2], bulk=False)
    assert [c_grpc.get("found", key) for key in keys] == [value_of(key) for key in keys]
    assert metric(pool[1].metrics_port, "kvd_cluster_members") == 3
    assert metric(pool[0].metrics_port, "kvd_cluster_forwards_total") > 0
    assert metric(pool[1].metrics_port, "kvd_cluster_remote_hits_total") > 0


def test_a_value_read_from_its_owner_is_kept_in_l1(pool: list[DaemonProcess]) -> None:
    a, b, _ = clients(pool)
    keys = chain("kept", 30)
    store_chain(a, "kept", keys)
    remote = [k for k, o in zip(keys, placement(pool).owners("kept", keys), strict=True)
              if o == pool[2].target]  # fmt: skip
    assert remote
    assert wait_until(lambda: b.lookup("kept", keys) == len(keys))
    before = metric(pool[1].metrics_port, "kvd_cluster_remote_gets_total")
    assert [b.get("kept", key) for key in remote] == [value_of(key) for key in remote]
    assert [b.get("kept", key) for key in remote] == [value_of(key) for key in remote]
    # The second round came from b's own L1: one peer read per key in all.
    assert metric(pool[1].metrics_port, "kvd_cluster_remote_gets_total") - before == len(remote)


def test_copies_of_other_members_values_are_guests(pool: list[DaemonProcess]) -> None:
    a, b, _ = clients(pool)
    guests = [metric(d.metrics_port, "kvd_guest_entries") for d in pool]
    keys = chain("guests", 40)
    store_chain(a, "guests", keys)
    assert wait_until(lambda: b.lookup("guests", keys) == len(keys))
    not_a = len(keys) - len(_owned_by(pool, "guests", keys, 0))
    # a keeps its copies of what b and c own as guests (first to go); the
    # owners hold theirs as their own.
    assert metric(pool[0].metrics_port, "kvd_guest_entries") - guests[0] == not_a
    assert metric(pool[2].metrics_port, "kvd_guest_entries") == guests[2]
    of_c = _owned_by(pool, "guests", keys, 2)
    assert [b.get("guests", key) for key in of_c] == [value_of(key) for key in of_c]
    assert metric(pool[1].metrics_port, "kvd_guest_entries") - guests[1] == len(of_c)


def test_every_owner_hears_of_a_lookup(pool: list[DaemonProcess]) -> None:
    """A lookup through a member that holds the whole chain (its own keys
    and guests) still tells the other owners, for their policies."""
    a, _, _ = clients(pool)
    keys = chain("told", 30)
    store_chain(a, "told", keys)
    assert wait_until(lambda: a.lookup("told", keys) == len(keys))
    owners = {1, 2} & {i for i in range(3) if _owned_by(pool, "told", keys, i)}
    assert owners
    before = {i: metric(pool[i].metrics_port, "kvd_cluster_shares_learned_total") for i in owners}
    assert a.lookup("told", keys) == len(keys)
    for i in owners:
        assert wait_until(
            lambda i=i: metric(pool[i].metrics_port, "kvd_cluster_shares_learned_total") > before[i]
        )


def test_a_batch_get_reads_what_it_lacks_from_the_owners(pool: list[DaemonProcess]) -> None:
    a, b, _ = clients(pool)
    keys = chain("batch", 50)
    store_chain(a, "batch", keys)
    assert wait_until(lambda: b.lookup("batch", keys) == len(keys))
    lacking = len(keys) - len(_owned_by(pool, "batch", keys, 1))  # b holds its own share
    before = metric(pool[1].metrics_port, "kvd_cluster_remote_hits_total")
    b_grpc = client_of(pool[1], bulk=False)
    assert b_grpc.get_many_with_meta("batch", keys) == [(value_of(k), b"") for k in keys]
    assert metric(pool[1].metrics_port, "kvd_cluster_remote_hits_total") - before == lacking


@pytest.mark.parametrize("pool_reads", [False, True], ids=["region", "pool-reads"])
def test_a_shared_memory_batch_reads_the_owners_share_together(
    pool: list[DaemonProcess], pool_reads: bool
) -> None:
    """A batch over the Unix socket (shared memory) asks the owners for
    every value it lacks at once, before it reads them in order."""
    ns = f"shm-batch-{int(pool_reads)}"
    a = client_of(pool[0])
    keys = chain(ns, 40)
    store_chain(a, ns, keys)
    b = shm_client_of(pool[1], pool_reads)
    assert wait_until(lambda: b.lookup(ns, keys) == len(keys))
    assert ("shm-pool" in b.paths) == pool_reads and "shm" in b.paths
    lacking = len(keys) - len(_owned_by(pool, ns, keys, 1))
    port = pool[1].metrics_port
    hits = metric(port, "kvd_cluster_remote_hits_total")
    batches = metric(port, "kvd_cluster_remote_get_batches_total")
    size = len(value_of(keys[0]))
    views = rooms(b, size, len(keys))
    assert b.get_many_into(ns, keys, views) == [size] * len(keys)
    assert [bytes(view) for view in views] == [value_of(key) for key in keys]
    assert metric(port, "kvd_cluster_remote_hits_total") - hits == lacking
    assert metric(port, "kvd_cluster_remote_get_batches_total") - batches == 1
    # Read again: all in b's L1 now, no peer asked.
    assert b.get_many_into(ns, keys, views) == [size] * len(keys)
    assert metric(port, "kvd_cluster_remote_get_batches_total") - batches == 1


def test_values_from_their_owners_are_copied_into_each_room_as_they_land(
    pool: list[DaemonProcess],
) -> None:
    """A shared-memory batch copies each value it fetched into its room as
    soon as it lands: a key asked twice fills both rooms, each counted as a
    hit once; a room too small for its value is refused alone, by item, and
    the batch's other value still landed."""
    ns = "landed"
    keys = chain(ns, 24)
    store_chain(client_of(pool[0]), ns, keys)
    b = shm_client_of(pool[1])
    assert wait_until(lambda: b.lookup(ns, keys) == len(keys))
    remote = [key for key in keys if key not in _owned_by(pool, ns, keys, 1)]
    assert len(remote) >= 4
    size = len(value_of(keys[0]))
    port = pool[1].metrics_port
    served = 'kvd_hits_total{op="shm_get",tier="l1"}'  # values handed out
    found = f'kvd_namespace_hits_total{{namespace="{ns}"}}'  # the store's, as the policy saw
    hits = metric(port, served), metric(port, found)
    asked = [remote[0], remote[1], remote[0]]
    views = rooms(b, size, len(asked))
    assert b.get_many_into(ns, asked, views) == [size] * len(asked)
    assert [bytes(view) for view in views] == [value_of(key) for key in asked]
    assert metric(port, served) - hits[0] == len(asked)
    assert metric(port, found) - hits[1] == len(asked)
    room = b.buffer(2 * size - 1)
    tight = [room[:size], room[size:]]  # the second a byte short
    with pytest.raises(InvalidArgument, match=r"item 1: buffer of .* too small"):
        b.get_many_into(ns, [remote[2], remote[3]], tight)
    assert bytes(tight[0]) == value_of(remote[2])
    # Both were found (a hit each, as one daemon counts a get it has no room
    # for); one was handed out.
    assert metric(port, served) - hits[0] == len(asked) + 1
    assert metric(port, found) - hits[1] == len(asked) + 2
    assert b.get(ns, remote[3]) == value_of(remote[3])


def test_a_key_nobody_holds_is_a_miss(pool: list[DaemonProcess]) -> None:
    a, b, _ = clients(pool)
    keys = chain("absent", 20)
    assert b.lookup("absent", keys) == 0
    assert [b.get("absent", key) for key in keys] == [None] * len(keys)
    assert a.exists("absent", keys) == [False] * len(keys)


def _owned_by(pool: list[DaemonProcess], namespace: str, keys: list[bytes], i: int) -> list[bytes]:
    owners = placement(pool).owners(namespace, keys)
    return [k for k, o in zip(keys, owners, strict=True) if o == pool[i].target]


def check_reads_miss_or_match(client: Client, namespace: str, keys: list[bytes]) -> list[bytes]:
    """Every get returns the right bytes or None, never an error; the keys missed."""
    missed = []
    for key in keys:
        value = client.get(namespace, key)
        if value is None:
            missed.append(key)
        else:
            assert value == value_of(key)
    return missed


def test_stopped_owner_costs_misses_within_the_deadline(pool: list[DaemonProcess]) -> None:
    a, b, _ = clients(pool)
    b_grpc = client_of(pool[1], bulk=False)
    keys = chain("stopped", 40)
    store_chain(a, "stopped", keys)
    assert wait_until(lambda: b.lookup("stopped", keys) == len(keys))
    on_c = _owned_by(pool, "stopped", keys, 2)
    on_a = _owned_by(pool, "stopped", keys, 0)
    assert on_c and on_a
    os.kill(pool[2].proc.pid, signal.SIGSTOP)
    try:
        # b holds none of c's keys: each is a miss (no error inside the client's
        # deadline); a's keys still read, over both transports.
        assert check_reads_miss_or_match(b, "stopped", on_c) == on_c
        assert check_reads_miss_or_match(b_grpc, "stopped", on_c) == on_c
        # One shared-memory batch of both: a's values land and are copied,
        # c's are misses.
        b_shm = shm_client_of(pool[1])
        mixed, size = on_a[:3] + on_c[:3], len(value_of(keys[0]))
        views = rooms(b_shm, size, len(mixed))
        assert b_shm.get_many_into("stopped", mixed, views) == [size] * 3 + [None] * 3
        assert [bytes(view) for view in views[:3]] == [value_of(key) for key in on_a[:3]]
        assert check_reads_miss_or_match(b, "stopped", on_a) == []
        assert b.lookup("stopped", keys) <= keys.index(on_c[0])  # the chain ends at c's keys
        assert metric(pool[1].metrics_port, "kvd_cluster_peer_errors_total") > 0
    finally:
        os.kill(pool[2].proc.pid, signal.SIGCONT)
    # c is back: its keys read again once b tries it again (within PEER_DOWN_S).
    assert wait_until(lambda: b_grpc.get("stopped", on_c[0]) == value_of(on_c[0]))


def test_killed_owner_costs_misses_and_the_rest_serve(pool: list[DaemonProcess]) -> None:
    a, b, _ = clients(pool)
    keys = chain("killed", 40)
    store_chain(a, "killed", keys)
    assert wait_until(lambda: b.lookup("killed", keys) == len(keys))
    on_c = _owned_by(pool, "killed", keys, 2)
    pool[2].kill()
    assert check_reads_miss_or_match(b, "killed", on_c) == on_c
    assert check_reads_miss_or_match(a, "killed", keys) == []  # a kept every put it took
    assert b.lookup("killed", keys) <= keys.index(on_c[0])
    # New puts through a still land and are read through b, for keys a or b own.
    fresh = chain("after", 20)
    store_chain(a, "after", fresh)
    live = [k for k in fresh if k not in _owned_by(pool, "after", fresh, 2)]
    assert wait_until(lambda: all(b.get("after", k) == value_of(k) for k in live))


def test_a_value_its_member_cannot_keep_is_a_counted_miss(tmp_path: Path) -> None:
    """A member whose L1 is pinned full by a lease cannot keep a value it
    reads from the owner: the get is a miss, counted apart from the owner's."""
    daemons = start_static_pool(tmp_path, 2, "--dram-bytes", "2MiB", "--max-value-bytes", "64KiB")
    try:
        here, there = daemons
        keys = [b"k-%04d" % i for i in range(400)]
        mine, theirs = _owned_by(daemons, "full", keys, 0), _owned_by(daemons, "full", keys, 1)[0]
        value = bytes(60_000)  # a 64 KiB page each
        with Client(there.target, timeout_s=CLIENT_TIMEOUT_S) as owner:
            owner.put("full", theirs, value)
        with Client(here.target, timeout_s=CLIENT_TIMEOUT_S) as client:
            for key in mine[:40]:  # more than its 32 pages hold
                client.put("full", key, value)
            kept = list(compress(mine[:40], client.exists("full", mine[:40])))
            found = client.lookup_ex("full", kept, lease_ms=30_000)  # every page pinned
            assert found.prefix_len == len(kept)
            assert client.get("full", theirs) is None
            client.release("full", found.lease_id)
            assert client.get("full", theirs) == value  # room again: read and kept
        port = here.metrics_port
        assert metric(port, "kvd_cluster_remote_not_kept_total") == 1
        assert metric(port, "kvd_cluster_remote_misses_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()


def test_list_not_naming_the_daemon_serves_alone(tmp_path: Path) -> None:
    daemon = DaemonProcess(
        tmp_path, ["--pool-members", "static:127.0.0.1:1,127.0.0.1:2,127.0.0.1:1"], ssd=""
    )
    try:
        client = client_of(daemon)
        client.put("alone", b"k", b"v")
        assert client.get("alone", b"k") == b"v"
        assert client.lookup("alone", [b"k", b"other"]) == 1
        assert metric(daemon.metrics_port, "kvd_cluster_members") == 1
        text = "\n".join(daemon.log)
        assert "does not name this daemon" in text
        assert "more than once" in text
    finally:
        daemon.discard()


def test_the_callers_deadline_bounds_peer_calls(tmp_path: Path) -> None:
    """Peer calls may take 3 s here, the caller gives 0.5 s: a stopped owner
    must still cost a miss inside the caller's deadline, not DEADLINE_EXCEEDED."""
    daemons = start_static_pool(tmp_path, 2, peer_timeout_ms=3000)
    a, b = daemons
    try:
        put = client_of(a)
        keys = chain("deadline", 30)
        store_chain(put, "deadline", keys)
        on_b = _owned_by(daemons, "deadline", keys, 1)
        on_a = _owned_by(daemons, "deadline", keys, 0)
        assert on_a and on_b
        hurried = Client(a.target, timeout_s=0.5, bulk=False)
        _open.append(hurried)
        assert wait_until(lambda: hurried.lookup("deadline", keys) == len(keys))
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            # a asks b only for what a lacks: drop a's own copies of b's keys.
            assert put.delete("deadline", on_b) == len(on_b)
            assert hurried.get("deadline", on_b[0]) is None
            assert hurried.lookup("deadline", keys) == keys.index(on_b[0])
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
    finally:
        for daemon in daemons:
            daemon.discard()


def test_batches_of_remote_values_past_the_held_share_read_every_value(tmp_path: Path) -> None:
    """Two engines' batch gets through one member, at once, of values
    another member owns: more than the share of L1 that holds fetched
    values, and together more than the room its own values leave, so a
    value that lands past the share can be evicted by the other batch's
    before its read. Such a value is read again, held for the get that
    waits on it: every get finds its value, none is a miss nor a value not
    kept."""
    daemons = start_static_pool(tmp_path, 2, "--dram-bytes", "4MiB", "--max-value-bytes", "64KiB")
    try:
        here, there = daemons
        keys = [b"k-%04d" % i for i in range(400)]
        mine = _owned_by(daemons, "held", keys, 0)[:OWN_KEYS]
        theirs = _owned_by(daemons, "held", keys, 1)[: 3 * BATCH_KEYS]
        values = {key: hashlib.sha256(key).digest() * 1875 for key in keys}  # 60,000 bytes each
        with Client(there.target, timeout_s=CLIENT_TIMEOUT_S) as owner:
            owner.put_many("held", [(key, values[key]) for key in theirs])
        with Client(here.target, timeout_s=CLIENT_TIMEOUT_S) as client:
            client.put_many("held", [(key, values[key]) for key in mine])
        batches = [theirs[i : i + BATCH_KEYS] for i in range(0, len(theirs), BATCH_KEYS)]
        wrong: list[bytes] = []

        def engine(batch: list[bytes]) -> None:
            with Client(here.target, timeout_s=CLIENT_TIMEOUT_S) as client:
                for _ in range(BATCH_ROUNDS):
                    got = client.get_many("held", batch)
                    wrong.extend(k for k, v in zip(batch, got, strict=True) if v != values[k])

        done = threading.Event()

        def churn() -> None:  # fresh values this member owns: they evict copies first
            fresh = _owned_by(daemons, "churn", [b"c-%06d" % i for i in range(20_000)], 0)
            with Client(here.target, timeout_s=CLIENT_TIMEOUT_S) as client:
                for key in itertools.cycle(fresh):
                    if done.is_set():
                        return
                    client.put("churn", key, values[mine[0]])

        engines = [threading.Thread(target=engine, args=(batch,)) for batch in batches]
        churner = threading.Thread(target=churn)
        for thread in [*engines, churner]:
            thread.start()
        for thread in engines:
            thread.join()
        done.set()
        churner.join()
        port = here.metrics_port
        assert wrong == []
        assert metric(port, "kvd_cluster_remote_not_kept_total") == 0
        assert metric(port, "kvd_cluster_remote_misses_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()
