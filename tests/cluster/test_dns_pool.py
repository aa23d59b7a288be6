"""Pool membership from DNS, as the DaemonSet gets it from its headless
Service: three daemons on three loopback addresses and one port resolve one
name at a real DNS server (dnsmasq) and place keys over what it answers. A
member taken out of the records leaves the others' pool (and refuses a list
without itself); a name with no records is refused; the DNS server going
away keeps the last members (kvd_cluster_membership_stale) until it is back.
A pod that stops with ``pool_leave_handoff_ms`` hands on what it owns first.

What this does not run is Kubernetes itself: the records here come from a
hosts file, where in a cluster CoreDNS answers the Service's name with the
ready pods' IPs (docs/pool.md says what the manifests set for that)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.config.pool_members import parse_spec
from tests.cluster.cluster import free_ports
from tests.cluster.dns_server import DnsServer, dnsmasq_binary, port_free_on
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(dnsmasq_binary() is None, reason="no dnsmasq (apt-get install dnsmasq)"),
]

NAME = "kvd-pool.kvd.svc.cluster.local"
HOSTS = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
WAIT_S = 10.0


def members_of(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_members")


def stale(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_membership_stale")


def refused(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_membership_refused_total")


def target(daemon: DaemonProcess) -> str:
    """The member's own address (``DaemonProcess.target`` assumes 127.0.0.1)."""
    args = [str(arg) for arg in daemon.proc.args]  # type: ignore[union-attr]
    return args[args.index("--pool-advertise") + 1]


def shared_port(hosts: list[str]) -> int:
    """One port free on every member's address (a DaemonSet's pods share it)."""
    for _ in range(20):
        (port,) = free_ports(1)
        if port_free_on(hosts, port):
            return port
    raise AssertionError("no port free on every loopback address")


def start_members(
    root: Path, server: DnsServer, hosts: list[str], *last: str
) -> list[DaemonProcess]:
    """A daemon on each of ``hosts`` (one port for all), members of the pool
    ``server`` answers ``NAME`` with; ``last``: the last one's flags of its own."""
    port = shared_port(hosts)
    daemons: list[DaemonProcess] = []
    try:
        for i, host in enumerate(hosts):
            where = root / f"m{i}"
            where.mkdir()
            args = [
                "--listen", f"{host}:{port}", "--pool-advertise", f"{host}:{port}",
                "--pool-members", f"dns://{NAME}:{port}",
                "--pool-dns-server", server.address, "--pool-dns-refresh-ms", "200",
                "--bulk-listen", f"{host}:0",  # peers read values from the member's own address
                *(last if i == len(hosts) - 1 else ()),
            ]  # fmt: skip
            daemons.append(DaemonProcess(where, args, ssd=""))
    except BaseException:
        for daemon in daemons:
            daemon.discard()
        raise
    return daemons


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[DnsServer, list[DaemonProcess]]]:
    root = tmp_path_factory.mktemp("dnspool")
    server = DnsServer(root)
    server.serve(NAME, HOSTS)
    daemons: list[DaemonProcess] = []
    try:
        daemons = start_members(root, server, HOSTS)
        yield server, daemons
    finally:
        for daemon in daemons:
            daemon.discard()
        server.kill()


def test_members_come_from_the_names_records(pool: tuple[DnsServer, list[DaemonProcess]]) -> None:
    _, daemons = pool
    assert all(wait_until(lambda d=d: members_of(d) == 3, WAIT_S) for d in daemons)
    keys = [f"dns-{i}".encode() for i in range(30)]
    with Client(target(daemons[0]), timeout_s=5) as first:
        for key in keys:
            first.put("dns", key, hashlib.sha256(key).digest() * 64)
    with Client(target(daemons[1]), timeout_s=5) as second:
        # The chain, whoever owns each key (puts reach their owner in the background).
        assert wait_until(lambda: second.lookup("dns", keys) == len(keys), WAIT_S)
        assert second.get("dns", keys[-1]) == hashlib.sha256(keys[-1]).digest() * 64


def test_a_member_out_of_the_records_leaves_and_dns_away_keeps_the_last(
    pool: tuple[DnsServer, list[DaemonProcess]],
) -> None:
    server, (a, b, c) = pool
    assert wait_until(lambda: members_of(a) == 3 and members_of(c) == 3, WAIT_S)
    refused_before = refused(c)
    server.serve(NAME, HOSTS[:2])
    assert wait_until(lambda: members_of(a) == 2 and members_of(b) == 2, WAIT_S)
    # c is not in the records: the list is refused, c keeps its last members.
    assert wait_until(lambda: refused(c) > refused_before, WAIT_S)
    assert members_of(c) == 3
    # No record at all: refused by everyone, who keep what they had.
    refused_a = refused(a)
    server.serve(NAME, [])
    assert wait_until(lambda: refused(a) > refused_a, WAIT_S)
    assert members_of(a) == 2 and stale(a) == 0
    # The DNS server goes away: the last members stay, marked stale.
    server.kill()
    assert wait_until(lambda: stale(a) == 1 and stale(b) == 1, WAIT_S)
    assert members_of(a) == 2
    with Client(target(a), timeout_s=5) as client:
        client.put("dns", b"while-dns-is-away", b"v" * 1000)
        assert client.get("dns", b"while-dns-is-away") == b"v" * 1000
    # Back, answering all three again: not stale, all three members.
    server.start()
    server.serve(NAME, HOSTS)
    assert all(wait_until(lambda d=d: stale(d) == 0 and members_of(d) == 3, WAIT_S)
               for d in (a, b, c))  # fmt: skip


def test_a_pod_stopping_hands_on_what_it_owns_before_it_goes(tmp_path: Path) -> None:
    """As the DaemonSet's pods do (``pool_leave_handoff_ms``): a member taken
    out of the Service's records and stopped (SIGTERM) first hands the
    values it owns to the members that own them once it is gone; every
    value, each stored only at its owner, is read right through the others."""
    hosts = ["127.0.0.21", "127.0.0.22", "127.0.0.23"]
    server = DnsServer(tmp_path)
    server.serve(NAME, hosts)
    daemons: list[DaemonProcess] = []
    try:
        daemons = start_members(tmp_path, server, hosts, "--pool-leave-handoff-ms", "10000")
        assert all(wait_until(lambda d=d: members_of(d) == 3, WAIT_S) for d in daemons)
        placement = Placement([target(d) for d in daemons])
        keys = [b"pod-%03d" % i for i in range(120)]
        values = {key: hashlib.sha256(key).digest() * 64 for key in keys}
        for daemon in daemons:  # through its owner: no copy anywhere else
            with Client(target(daemon), timeout_s=5) as client:
                mine = [key for key in keys if placement.owner("dns", key) == target(daemon)]
                client.put_many("dns", [(key, values[key]) for key in mine])
        leaving = daemons.pop()
        owned = sum(placement.owner("dns", key) == target(leaving) for key in keys)
        server.serve(NAME, hosts[:2])  # the pod is terminating: out of the records
        leaving.stop()
        said = [line for line in leaving.log if "pool values handed on before leaving" in line]
        assert said and f"handed_on={owned} " in said[0], leaving.log
        assert all(wait_until(lambda d=d: members_of(d) == 2, WAIT_S) for d in daemons)
        for daemon in daemons:
            with Client(target(daemon), timeout_s=5) as client:
                assert [client.get("dns", key) for key in keys] == [values[k] for k in keys]
    finally:
        for daemon in daemons:
            daemon.discard()
        server.kill()


def test_a_dns_server_that_is_not_an_address_is_refused_at_start(tmp_path: Path) -> None:
    args = ["--pool-members", f"dns://{NAME}:7070", "--pool-dns-server", "dns.example:53"]
    with pytest.raises(RuntimeError, match=r"pool_dns_server: dns\.example:53 is not IP:PORT"):
        DaemonProcess(tmp_path, args, ssd="")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("dns://:7070", "is not HOST:PORT"),
        ("dns://kvd pool:7070", "write dns://NAME:PORT"),
        ("dns://kvd-pool:0", "write dns://NAME:PORT"),
        ("dns://kvd-pool", "is not HOST:PORT"),
    ],
)
def test_bad_dns_specs_are_refused_with_a_clear_error(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_spec(text)


def test_a_dns_spec_names_its_name_and_port() -> None:
    spec = parse_spec(f"dns://{NAME}.:7070")
    assert spec is not None and spec.kind == "dns" and spec.endpoints == ((NAME, 7070),)
