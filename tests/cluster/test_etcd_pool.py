"""Pool membership from a real etcd: daemons register under a lease and see
each other join and leave; garbage under the prefix is ignored; etcd going
away keeps the last members (kvd_cluster_membership_stale says so) and the
daemons register again when it is back."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from kvd.client import Client
from tests.cluster.cluster import free_ports
from tests.cluster.etcd_server import PREFIX, EtcdServer, etcd_binary, start_member
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd (apt-get install etcd-server)"),
]


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 100


def members_of(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_members")


def stale(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_membership_stale")


async def etcd_put(endpoint: str, key: str, value: bytes) -> None:
    import aetcd

    host, _, port = endpoint.rpartition(":")
    async with aetcd.Client(host, int(port), timeout=5) as client:
        await client.put(key.encode(), value)


def test_members_join_leave_and_survive_etcd_going_away(tmp_path: Path, etcd: EtcdServer) -> None:
    daemons = [start_member(tmp_path, etcd, f"m{i}") for i in range(3)]
    clients = [Client(d.target, timeout_s=5) for d in daemons]
    try:
        assert wait_until(lambda: all(members_of(d) == 3 for d in daemons))
        a, b, c = clients
        keys = [b"etcd-block-%03d" % i for i in range(30)]
        for key in keys:
            a.put("etcd", key, value_of(key))
        assert wait_until(lambda: b.lookup("etcd", keys) == len(keys))
        assert [c.get("etcd", key) for key in keys] == [value_of(key) for key in keys]

        # Garbage under the prefix: a warning, and the members stay as they are.
        asyncio.run(etcd_put(etcd.endpoint, f"{PREFIX}/members/junk", b"\xffnot an address"))
        asyncio.run(etcd_put(etcd.endpoint, f"{PREFIX}/unrelated", b"anything"))
        assert wait_until(lambda: any("garbage under the etcd" in line for line in daemons[0].log))
        assert all(members_of(d) == 3 for d in daemons)

        # etcd goes away: the last members are kept and the pool keeps serving.
        etcd.kill()
        assert wait_until(lambda: all(stale(d) == 1 for d in daemons[:2]), timeout_s=15)
        assert members_of(daemons[0]) == 3
        assert [b.get("etcd", key) for key in keys] == [value_of(key) for key in keys]
        etcd.start()
        assert wait_until(lambda: all(stale(d) == 0 for d in daemons), timeout_s=20)
        assert all(members_of(d) == 3 for d in daemons)

        # A daemon stopped with SIGTERM revokes its lease: the others see it go.
        clients.pop().close()
        daemons[2].stop()
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons[:2]))
        # A daemon killed outright leaves when its lease (2 s) runs out.
        clients.pop().close()
        daemons[1].kill()
        assert wait_until(lambda: members_of(daemons[0]) == 1, timeout_s=15)
        assert a.get("etcd", keys[0]) == value_of(keys[0])  # a kept every put it took
    finally:
        for client in clients:
            client.close()
        for daemon in daemons:
            daemon.discard()


def test_daemon_starts_alone_when_etcd_is_not_there(tmp_path: Path) -> None:
    (port, nobody) = free_ports(2)
    args = ["--listen", f"127.0.0.1:{port}", "--pool-members", f"etcd://127.0.0.1:{nobody}/p"]
    daemon = DaemonProcess(tmp_path, args, ssd="")
    client = Client(daemon.target, timeout_s=5)
    try:
        assert stale(daemon) == 1
        assert members_of(daemon) == 1
        client.put("alone", b"k", b"v")
        assert client.get("alone", b"k") == b"v"
        assert any("membership source unreachable" in line for line in daemon.log)
    finally:
        client.close()
        daemon.discard()
