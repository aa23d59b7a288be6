"""One eviction plan for the pool (kvd.cluster.plans, PEER_PLAN): real
daemons on loopback. The plan holder answers the frame to the pool token
only, once it has planned; the other members ask for it as lookups go by
and keep their blocks by it; a member running another policy refuses it,
says so once, and plans for itself."""

from __future__ import annotations

import functools
import itertools
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.store.eviction.density import _REFRESH as PLANNED_EVERY
from kvd.wire import bulk
from tests.cluster.cluster import (
    ENGINE_TOKEN,
    POOL_TOKEN,
    free_ports,
    pool_auth,
    recv_all,
    start_static_pool,
)
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

NS = "team-a/model"
# Keys of the chain each member owns: the same count for each, so their
# sizes (blocks tracked) are within a plan's 1.25x bound. Each value takes a
# 64 KiB page, and the member the chain is put through keeps all of them.
OWNED_KEYS = 150
# density's plan: the blocks tracked, then a u32 retention per class.
DENSITY_PLAN_BYTES = 8 + 73 * 4


def _connect(port: int, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = token.encode()
    sock.sendall(bulk.encode_request(bulk.OP_HELLO, 0, length=len(hello)) + hello)
    head = bulk.RESPONSE.unpack(recv_all(sock, bulk.RESPONSE.size))
    recv_all(sock, head[6] + head[7])
    assert head[5] == bulk.CODE_OK
    return sock


def _plan(sock: socket.socket, rid: int) -> tuple[str, bytes, bytes]:
    """(code name, meta, payload) of a PEER_PLAN."""
    sock.sendall(bulk.encode_request(bulk.OP_PEER_PLAN, rid, flags=bulk.FLAG_HOP))
    head = bulk.RESPONSE.unpack(recv_all(sock, bulk.RESPONSE.size))
    meta = recv_all(sock, head[6])
    recv_all(sock, head[7])
    payload = recv_all(sock, head[8]) if head[5] == bulk.CODE_OK else b""
    return bulk.NAME_BY_CODE[head[5]], meta, payload


def _chain(members: list[DaemonProcess]) -> list[bytes]:
    """OWNED_KEYS keys of each member, in turn."""
    placement = Placement([member.target for member in members])
    owned: dict[str, list[bytes]] = {member.target: [] for member in members}
    for i in itertools.count():
        key = b"plan-%06d" % i
        keys = owned[placement.owner(NS, key)]
        if len(keys) < OWNED_KEYS:
            keys.append(key)
        if all(len(keys) == OWNED_KEYS for keys in owned.values()):
            return [key for turn in zip(*owned.values(), strict=True) for key in turn]
    raise AssertionError("unreachable")


def _fill_and_look_up(members: list[DaemonProcess], target: str, lookups: int) -> None:
    """The chain stored through ``target``, each put handed to its owner
    before the first lookup, then looked up there ``lookups`` times.

    Lookups made while the puts were still on their way (66 in a run beside
    two busy loops) had the holder plan with 111 of its 150 blocks, and a
    member holding its 150 refused that plan (sizes past 1.25x), as it
    should."""
    keys = _chain(members)
    through = next(member for member in members if member.target == target)
    handed_on = OWNED_KEYS * (len(members) - 1)
    with Client(target, token=ENGINE_TOKEN, timeout_s=10) as client:
        client.put_many(NS, [(key, key * 8) for key in keys], chained=True)
        forwards = functools.partial(metric, through.metrics_port, "kvd_cluster_forwards_total")
        assert wait_until(lambda: forwards() == handed_on), forwards()
        assert client.lookup(NS, keys) == len(keys)
        for _ in range(lookups):
            assert client.lookup(NS, keys) == len(keys)


def _adopted_one(metrics_port: int) -> bool:
    return metric(metrics_port, "kvd_cluster_plans_adopted_total") >= 1


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    daemons = start_static_pool(tmp_path, 3, *pool_auth(tmp_path), peer_timeout_ms=2000)
    yield daemons
    for daemon in daemons:
        daemon.discard()


def test_the_plan_is_answered_to_the_pool_token_once_there_is_one(
    pool: list[DaemonProcess],
) -> None:
    holder = min(pool, key=lambda d: d.target)
    with _connect(holder.bulk_port, POOL_TOKEN) as sock:
        assert _plan(sock, 1) == ("NOT_FOUND", b"", b"")  # nothing planned yet
        _fill_and_look_up(pool, holder.target, 2 * PLANNED_EVERY)
        code, meta, plan = _plan(sock, 2)
        assert (code, meta, len(plan)) == ("OK", b"density", DENSITY_PLAN_BYTES)
    with _connect(holder.bulk_port, ENGINE_TOKEN) as sock:
        assert _plan(sock, 1)[0] == "PERMISSION_DENIED"


def test_members_keep_their_blocks_by_the_holders_plan(pool: list[DaemonProcess]) -> None:
    holder = min(pool, key=lambda d: d.target)
    others = [d for d in pool if d is not holder]
    # Lookups through one member: every owner hears of each, and the other
    # member learns of them as shares; both ask the holder as they go.
    _fill_and_look_up(pool, others[0].target, 4 * PLANNED_EVERY)
    for member in others:
        assert wait_until(functools.partial(_adopted_one, member.metrics_port))
        assert metric(member.metrics_port, "kvd_cluster_plans_refused_total") == 0
    # The holder keeps its own plan: it asks no one.
    assert metric(holder.metrics_port, "kvd_cluster_plans_adopted_total") == 0
    assert metric(holder.metrics_port, "kvd_cluster_peer_errors_total") == 0


def test_a_member_of_another_policy_refuses_the_plan_and_says_so(tmp_path: Path) -> None:
    ports = free_ports(2)
    members = "static:" + ",".join(f"127.0.0.1:{port}" for port in ports)
    holder_port, lru_port = sorted(ports, key=lambda port: f"127.0.0.1:{port}")
    daemons: list[DaemonProcess] = []
    try:
        for port, policy in ((holder_port, "density"), (lru_port, "lru")):
            where = tmp_path / policy
            where.mkdir()
            args = ["--listen", f"127.0.0.1:{port}", "--pool-members", members,
                    "--pool-peer-timeout-ms", "2000", "--eviction-policy", policy,
                    *pool_auth(tmp_path)]  # fmt: skip
            daemons.append(DaemonProcess(where, args, ssd=""))
        lru = daemons[1]
        _fill_and_look_up(daemons, lru.target, 4 * PLANNED_EVERY)
        assert wait_until(lambda: metric(lru.metrics_port, "kvd_cluster_plans_refused_total") >= 1)
        assert metric(lru.metrics_port, "kvd_cluster_plans_adopted_total") == 0
        refusals = [line for line in lru.log if "plans for itself" in line]
        assert len(refusals) == 1, refusals  # once per holder, however often it asks
    finally:
        for daemon in daemons:
            daemon.discard()
