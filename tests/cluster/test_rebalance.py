"""After the pool's members change, values go where lookups look for them
(kvd.cluster.rebalance): a member that joins gets the values it now owns
from their old owners (from L1, and from L2, at most at the rate set from
all of them together), so a lookup through any member still finds every
block; when it leaves again, the copies the old owners kept of those
values become their own again; a member back under another address (a
pod's new IP) hands what its L2 kept to the keys' owners now. Membership
from a real etcd."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.forwards import FORWARD_TIMEOUT_S
from kvd.cluster.rendezvous import Placement
from kvd.tools.bench.daemon import written_back
from tests.cluster.etcd_server import EtcdServer, etcd_binary, start_member
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd (apt-get install etcd-server)"),
]

NS = "rebalance"


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 300


def members_of(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_members")


def counted(daemons: list[DaemonProcess], name: str) -> float:
    return sum(metric(d.metrics_port, name) for d in daemons)


def handed_on(daemons: list[DaemonProcess]) -> dict[str, dict[str, float]]:
    """Each member's hand-off counters (what a failed check says)."""
    names = ("rebalanced", "rebalanced_from_l2", "forwards", "forward_errors", "forwards_dropped")
    return {
        d.target: {n: metric(d.metrics_port, f"kvd_cluster_{n}_total") for n in names}
        for d in daemons
    }


def finds_all(client: Client, keys: list[bytes]) -> bool:
    """Whether a lookup through ``client`` finds the whole chain, soon."""
    return wait_until(lambda: client.lookup(NS, keys) == len(keys))


def test_a_joining_member_gets_what_it_owns_and_gives_it_back_when_it_leaves(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    old = [start_member(tmp_path, etcd, name) for name in ("a", "b")]
    daemons = list(old)
    try:
        assert wait_until(lambda: all(members_of(d) == 2 for d in old))
        keys = [b"chain-%04d" % i for i in range(200)]
        with Client(old[0].target, timeout_s=10) as client:
            client.put_many(NS, [(key, value_of(key)) for key in keys], chained=True)
        with Client(old[1].target, timeout_s=10) as client:
            assert finds_all(client, keys)

        joined = start_member(tmp_path, etcd, "c")
        daemons.append(joined)
        assert wait_until(lambda: all(members_of(d) == 3 for d in daemons))
        placement = Placement([d.target for d in daemons])
        moved = [key for key in keys if placement.owner(NS, key) == joined.target]
        assert 0 < len(moved) < len(keys)
        # Each value had one owner among a and b: it hands it on, once.
        assert wait_until(
            lambda: counted(old, "kvd_cluster_rebalanced_total") == len(moved), timeout_s=20
        )
        # Each was looked up: its history in its old owner's policy went with it.
        histories = "kvd_cluster_histories_taken_total"
        assert wait_until(lambda: metric(joined.metrics_port, histories) == len(moved))
        for daemon in daemons:
            with Client(daemon.target, timeout_s=10) as client:
                assert finds_all(client, keys), handed_on(daemons)
                assert [client.get(NS, key) for key in keys] == [value_of(key) for key in keys]
        # The joined member serves what it owns from its own L1.
        remote_gets = metric(joined.metrics_port, "kvd_cluster_remote_gets_total")
        with Client(joined.target, timeout_s=10) as client:
            assert [client.get(NS, key) for key in moved] == [value_of(key) for key in moved]
        assert metric(joined.metrics_port, "kvd_cluster_remote_gets_total") == remote_gets
        assert counted(daemons, "kvd_cluster_forward_errors_total") == 0
        assert counted(daemons, "kvd_cluster_forwards_dropped_total") == 0  # none evicted unsent

        # It leaves (SIGTERM revokes its lease): the old owners kept copies
        # of what they handed on, and keep them as their own again.
        daemons.remove(joined)
        joined.stop()
        assert wait_until(lambda: all(members_of(d) == 2 for d in old), timeout_s=15)
        assert wait_until(
            lambda: counted(old, "kvd_cluster_rebalance_adopted_total") == len(moved),
            timeout_s=20,
        )
        with Client(old[1].target, timeout_s=10) as client:
            assert client.lookup(NS, keys) == len(keys)
            assert [client.get(NS, key) for key in keys] == [value_of(key) for key in keys]
    finally:
        for daemon in daemons:
            daemon.discard()


def test_values_only_on_l2_go_to_their_new_owner_too_at_the_rate_set(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    sizes = {"ssd": "64MiB", "segment": "8MiB", "dram": "2MiB", "max_value": "1MiB"}
    rate = 512 << 10  # the walks take 4 s or more, against ~1.2 s unpaced
    paced = ("--pool-rebalance-bytes-per-s", str(rate))
    old = [start_member(tmp_path, etcd, name, *paced, **sizes) for name in ("a", "b")]
    daemons = list(old)
    try:
        assert wait_until(lambda: all(members_of(d) == 2 for d in old))
        keys = [b"cold-%04d" % i for i in range(96)]  # 6 MiB: most only on L2
        values = {key: hashlib.sha256(key).digest() * 2048 for key in keys}
        before = Placement([d.target for d in old])
        for daemon in old:  # each through its owner: an L1 this small hands on little
            with Client(daemon.target, timeout_s=10) as client:
                mine = [key for key in keys if before.owner(NS, key) == daemon.target]
                client.put_many(NS, [(key, values[key]) for key in mine])
        with Client(old[1].target, timeout_s=10) as client:
            assert finds_all(client, keys)

        joined = start_member(tmp_path, etcd, "c", **sizes)
        daemons.append(joined)
        assert wait_until(lambda: all(members_of(d) == 3 for d in daemons))
        placement = Placement([d.target for d in daemons])
        moved = [key for key in keys if placement.owner(NS, key) == joined.target]
        began = time.monotonic()
        assert wait_until(
            lambda: counted(old, "kvd_cluster_rebalanced_total") == len(moved), timeout_s=20
        )
        # The new member gets at most ``rate`` a second from both together
        # (each old member's first value at once).
        assert time.monotonic() - began >= (len(moved) - len(old)) * (64 << 10) / rate
        assert counted(old, "kvd_cluster_rebalanced_from_l2_total") > 0
        with Client(joined.target, timeout_s=10) as client:
            assert finds_all(client, keys), handed_on(daemons)
            assert [client.get(NS, key) for key in keys] == [values[key] for key in keys]
        assert counted(daemons, "kvd_cluster_forward_errors_total") == 0
        assert counted(daemons, "kvd_cluster_forwards_dropped_total") == 0  # none evicted unsent
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_member_back_under_another_address_hands_on_what_its_l2_kept(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    sizes = {"ssd": "64MiB", "segment": "8MiB", "max_value": "1MiB"}  # L1 goes, L2 stays
    a, b = (start_member(tmp_path, etcd, name, **sizes) for name in ("a", "b"))
    daemons = [a, b]
    try:
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons))
        keys = [b"kept-%04d" % i for i in range(96)]
        values = {key: hashlib.sha256(key).digest() * 2048 for key in keys}
        before = Placement([a.target, b.target])
        for daemon in daemons:
            with Client(daemon.target, timeout_s=10) as client:
                mine = [key for key in keys if before.owner(NS, key) == daemon.target]
                client.put_many(NS, [(key, values[key]) for key in mine])
        with Client(b.target, timeout_s=10) as client:
            assert written_back(client)
        b.stop()  # SIGTERM: its lease is revoked
        assert wait_until(lambda: members_of(a) == 1, timeout_s=15)

        back = start_member(tmp_path, etcd, "b", **sizes)  # its L2 file, another port
        daemons[1] = back
        assert back.target != b.target
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons))
        after = Placement([a.target, back.target])
        # Keys b owned that a owns now: only b's L2 has them.
        moved = (b.target, a.target)
        to_a = [k for k in keys if (before.owner(NS, k), after.owner(NS, k)) == moved]
        assert to_a
        assert wait_until(
            lambda: metric(back.metrics_port, "kvd_cluster_rebalanced_from_l2_total") >= len(to_a),
            timeout_s=20,
        )
        for daemon in daemons:
            with Client(daemon.target, timeout_s=10) as client:
                assert finds_all(client, keys), handed_on(daemons)
                assert [client.get(NS, key) for key in keys] == [values[key] for key in keys]
        assert counted(daemons, "kvd_cluster_forwards_dropped_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_value_the_new_owner_refuses_stays_the_old_members_own(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    old = start_member(tmp_path, etcd, "a")
    daemons = [old]
    try:
        assert wait_until(lambda: members_of(old) == 1)
        small = [b"small-%03d" % i for i in range(60)]
        large = [b"large-%03d" % i for i in range(60)]
        values = {key: value_of(key) for key in small}
        values |= {key: hashlib.sha256(key).digest() * 4096 for key in large}  # 128 KiB
        with Client(old.target, timeout_s=10) as client:
            client.put_many(NS, list(values.items()))
        joined = start_member(tmp_path, etcd, "b", max_value="64KiB")  # refuses the large
        daemons.append(joined)
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons))
        placement = Placement([d.target for d in daemons])
        moved_small = [k for k in small if placement.owner(NS, k) == joined.target]
        moved_large = [k for k in large if placement.owner(NS, k) == joined.target]
        assert moved_small and moved_large
        # The ones it took are guests here now; the ones it refused are still a's own.
        assert wait_until(
            lambda: metric(old.metrics_port, "kvd_guest_entries") == len(moved_small), timeout_s=20
        ), handed_on(daemons)
        assert wait_until(
            lambda: metric(old.metrics_port, "kvd_cluster_forward_errors_total") >= len(moved_large)
        )
        assert metric(old.metrics_port, "kvd_guest_entries") == len(moved_small)
        with Client(joined.target, timeout_s=10) as client:
            assert [client.get(NS, key) for key in moved_small] == [values[k] for k in moved_small]
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_member_stopping_hands_what_it_owns_to_the_others_before_it_leaves(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """With ``pool_leave_handoff_ms``, a member stopped (SIGTERM) first hands
    the values its L1 owns to the members that own them once it is gone:
    every value, each stored only at its owner, is still read right through
    the others. Without the setting, a member's values go with it."""
    handoff = ("--pool-leave-handoff-ms", "10000")
    daemons = [start_member(tmp_path, etcd, "a"), start_member(tmp_path, etcd, "b"),
               start_member(tmp_path, etcd, "c", *handoff)]  # fmt: skip
    try:
        assert wait_until(lambda: all(members_of(d) == 3 for d in daemons))
        placement = Placement([d.target for d in daemons])
        keys = [b"owned-%04d" % i for i in range(150)]
        owned = {d.target: [k for k in keys if placement.owner(NS, k) == d.target] for d in daemons}
        for daemon in daemons:  # through its owner: no copy anywhere else
            with Client(daemon.target, timeout_s=10) as client:
                client.put_many(NS, [(key, value_of(key)) for key in owned[daemon.target]])
        a, b, leaving = daemons
        assert all(metric(d.metrics_port, "kvd_entries") == len(owned[d.target]) for d in daemons)

        daemons.remove(leaving)
        leaving.stop()
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons), timeout_s=15)
        said = [line for line in leaving.log if "pool values handed on before leaving" in line]
        assert said and f"handed_on={len(owned[leaving.target])} " in said[0], leaving.log
        assert counted(daemons, "kvd_entries") == len(keys)  # each value once
        assert counted(daemons, "kvd_guest_entries") == 0  # kept as their own, not as copies
        for daemon in daemons:
            with Client(daemon.target, timeout_s=10) as client:
                assert [client.get(NS, key) for key in keys] == [value_of(key) for key in keys]

        # b stops without the setting: what it owned goes with it (misses through a).
        placement = Placement([a.target, b.target])
        fresh = [
            k for k in (b"fresh-%04d" % i for i in range(100)) if placement.owner(NS, k) == b.target
        ]
        with Client(b.target, timeout_s=10) as client:
            client.put_many(NS, [(key, value_of(key)) for key in fresh])
        daemons.remove(b)
        b.stop()
        assert wait_until(lambda: members_of(a) == 1, timeout_s=15)
        with Client(a.target, timeout_s=10) as client:
            assert fresh and all(client.get(NS, key) is None for key in fresh)
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_member_stopping_hands_on_what_only_its_l2_holds_too(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """With L1s of 2 MiB and 4 MiB of values a member owns, most of them
    only on its L2: stopped with ``pool_leave_handoff_ms``, it reads those
    from L2 and hands them on as well; every value is read right through
    the others, none left as a copy."""
    sizes = {"ssd": "64MiB", "segment": "8MiB", "dram": "2MiB", "max_value": "1MiB"}
    handoff = ("--pool-leave-handoff-ms", "10000")
    daemons = [start_member(tmp_path, etcd, "a", **sizes),
               start_member(tmp_path, etcd, "b", **sizes),
               start_member(tmp_path, etcd, "c", *handoff, **sizes)]  # fmt: skip
    try:
        assert wait_until(lambda: all(members_of(d) == 3 for d in daemons))
        placement = Placement([d.target for d in daemons])
        keys = [b"cold-%04d" % i for i in range(192)]
        values = {key: hashlib.sha256(key).digest() * 2048 for key in keys}  # 64 KiB each
        leaving = daemons[2]
        for daemon in daemons:  # through its owner: no copy anywhere else
            with Client(daemon.target, timeout_s=10) as client:
                mine = [key for key in keys if placement.owner(NS, key) == daemon.target]
                client.put_many(NS, [(key, values[key]) for key in mine])
                assert written_back(client)
        owned = sum(placement.owner(NS, key) == leaving.target for key in keys)
        assert metric(leaving.metrics_port, "kvd_entries") < owned  # most only on L2

        daemons.remove(leaving)
        leaving.stop()
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons), timeout_s=15)
        said = [line for line in leaving.log if "pool values handed on before leaving" in line]
        assert said and f"handed_on={owned} " in said[0], leaving.log
        from_l2 = re.search(r"from_l2=(\d+)", said[0])
        assert from_l2 and int(from_l2.group(1)) >= owned - 32, said[0]  # 2 MiB of L1 at most
        assert counted(daemons, "kvd_guest_entries") == 0
        for daemon in daemons:
            with Client(daemon.target, timeout_s=10) as client:
                assert [client.get(NS, key) for key in keys] == [values[key] for key in keys]
        assert counted(daemons, "kvd_cluster_forwards_dropped_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_stop_waits_for_its_hand_off_no_longer_than_it_is_allowed(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """A member stopping while the member its values go to is stopped
    (SIGSTOP: its calls hang) exits after its hand-off time and its grace,
    not after the forwards' own timeout; nothing it held was lost for
    having tried."""
    handoff = ("--pool-leave-handoff-ms", "1500", "--shutdown-grace-ms", "1000")
    leaving = start_member(tmp_path, etcd, "a", *handoff)
    stuck = start_member(tmp_path, etcd, "b")
    daemons = [leaving, stuck]
    try:
        assert wait_until(lambda: all(members_of(d) == 2 for d in daemons))
        placement = Placement([d.target for d in daemons])
        mine = [k for k in (b"held-%04d" % i for i in range(200))
                if placement.owner(NS, k) == leaving.target]  # fmt: skip
        with Client(leaving.target, timeout_s=10) as client:
            client.put_many(NS, [(key, value_of(key)) for key in mine])
        os.kill(stuck.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        leaving.stop()
        took_s = time.monotonic() - started
        # Its 1.5 s of hand-off, then at most its grace and a margin: not
        # the 10 s a forward may take (FORWARD_TIMEOUT_S).
        assert 1.4 <= took_s < FORWARD_TIMEOUT_S - 1.0, took_s
        said = [line for line in leaving.log if "pool values handed on before leaving" in line]
        assert said and f"handed_on={len(mine)} " in said[0], leaving.log
    finally:
        os.kill(stuck.proc.pid, signal.SIGCONT)
        for daemon in daemons:
            daemon.discard()
