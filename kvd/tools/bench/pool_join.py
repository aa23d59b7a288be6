"""``kvd bench pool``'s join (``kvd.tools.bench.pool``): four members whose
membership comes from a real etcd hold chains, and a fifth joins.

A chain's lookup stops at its first key held nowhere, and a join moves
about a fifth of every chain's keys to the new member: until the values
move too (``kvd.cluster.rebalance``), lookups find only each chain's
blocks before its first moved key. Reported: the share of the blocks
member 0's lookups find at the first look after every member saw the
fifth, how long after that they find every block again, the values the
old members handed on (and the share of all values), the old members' CPU
meanwhile, and every value then read back through the new member and
checked.

Then two leaves (``leave``): fresh chains, each value put through its
owner, so no other member keeps a copy (as when the others' L1s have
evicted theirs); the fifth member, started with ``pool_leave_handoff_ms``,
stops (SIGTERM), and then member 3, without it. Reported for each: the
share of the blocks member 0's lookups find once every member left saw
it go, the values handed on before it left and how long that took, and
every value read back through its owner (no copy made elsewhere) and
checked. The members run on loopback (etcd with them); without the etcd
binary (Debian's ``etcd-server``) the case is skipped and says so.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.bench.etcd import EtcdServer, etcd_binary
from kvd.tools.bench.pool_nodes import Member, free_ports, write_tokens
from kvd.tools.bench.pool_puts import cpu_s
from kvd.tools.replay.run import block_value

MEMBERS = 4
CHAINS = 256
CHAIN_BLOCKS = 64
VALUE_BYTES = 64 * 1024
MiB = 1 << 20
PREFIX = "/kvd-bench/pool"
ETCD_TTL_MS = 2000
# Member 0 looks every chain up this often until it finds every block.
POLL_S = 0.05
JOIN_WAIT_S = 60.0
# The fifth member's hand-off before it leaves: time enough here for its
# fifth of the leave's chains (1 GiB in all by default) to go.
LEAVE_HANDOFF_MS = 20_000
LEAVE_NS = "leave"
NS = "join"


class EtcdMembers:
    """Members whose membership comes from a fresh etcd under ``root``,
    each with ``dram`` of L1 (values up to ``max_value``) and no L2;
    stopped with ``stop``."""

    def __init__(self, root: Path, dram: str, max_value: str | None = None) -> None:
        self.root = root
        (root / "etcd").mkdir()
        client_port, peer_port = free_ports(2)
        self.etcd = EtcdServer(root / "etcd", client_port, peer_port)
        self.token, self._auth = write_tokens(root)
        self._options: dict[str, Any] = {"dram": dram, "ssd": ""}
        if max_value is not None:
            self._options["max_value"] = max_value
        self.members: list[Member] = []

    def add(self, *extra: str) -> Member:
        """A new member, started (it registers itself), with ``extra`` flags."""
        index = len(self.members)
        (port,) = free_ports(1)
        address = f"127.0.0.1:{port}"
        args = ["--listen", address,
                "--pool-members", f"etcd://{self.etcd.endpoint}{PREFIX}",
                "--pool-etcd-ttl-ms", str(ETCD_TTL_MS), *self._auth, *extra]  # fmt: skip
        new = Member(index, address, self.root / f"m{index}", args, self._options, None,
                     SpawnedDaemon)  # fmt: skip
        new.start()
        self.members.append(new)
        return new

    def wait_members(self) -> None:
        """Until every member counts them all."""
        count = len(self.members)
        _wait(lambda: all(m.metric("kvd_cluster_members") == count for m in self.members),
              f"{count} members")  # fmt: skip

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        self.etcd.kill()


def run(root: Path, progress: Callable[[str], None], chain_count: int = CHAINS) -> dict[str, Any]:
    """The join with ``chain_count`` chains stored (module doc)."""
    if etcd_binary() is None:
        return {"skipped": "no etcd binary (apt-get install etcd-server)"}
    # L1 of each member: what it owns (a quarter) and the copies of the
    # chains put through it (three quarters of a quarter), with room to spare.
    dram = f"{chain_count * CHAIN_BLOCKS * VALUE_BYTES * 3 // 4 // MiB + 64}MiB"
    pool = EtcdMembers(Path(tempfile.mkdtemp(prefix="join-", dir=root)), dram)
    members, token = pool.members, pool.token
    try:
        progress(f"pool: join: {MEMBERS} members from etcd, {chain_count} chains")
        for _ in range(MEMBERS):
            pool.add()
        pool.wait_members()
        chains, values = _chains(b"c", chain_count)
        for c, chain in enumerate(chains):
            with Client(members[c % MEMBERS].socket_target, token=token, timeout_s=60) as client:
                client.put_many(NS, [(key, values[key]) for key in chain], chained=True)
        with Client(members[0].socket_target, token=token, timeout_s=60) as looker:

            def found() -> float:
                return _found(looker, NS, chains)

            _wait(lambda: found() == 1.0, "the chains stored")
            old = list(members)
            cpu_before = [cpu_s(m.running.proc.pid) for m in old]
            progress("pool: join: a fifth member joins")
            joined = pool.add("--pool-leave-handoff-ms", str(LEAVE_HANDOFF_MS))
            pool.wait_members()
            seen = time.perf_counter()
            first = found()
            timeline = [(0.0, first)]
            while timeline[-1][1] < 1.0 and time.perf_counter() - seen < JOIN_WAIT_S:
                time.sleep(POLL_S)
                timeline.append((time.perf_counter() - seen, found()))
            cpu_ms = [(cpu_s(m.running.proc.pid) - before) * 1e3
                      for m, before in zip(old, cpu_before, strict=True)]  # fmt: skip
        handed_on = sum(m.metric("kvd_cluster_rebalanced_total") for m in old)
        errors = sum(m.metric("kvd_cluster_forward_errors_total") for m in members)
        with Client(joined.socket_target, token=token, timeout_s=60) as engine:
            wrong, misses = _checked(values, lambda key: engine.get(NS, key))
        leaves = _leaves(pool, chain_count, progress)
        return {
            "members": MEMBERS,
            "values": len(values),
            "value_bytes": VALUE_BYTES,
            "found_at_join": first,
            "found_after_s": timeline[-1][0] if timeline[-1][1] == 1.0 else None,
            "timeline": timeline,
            "handed_on": handed_on,
            "handed_on_share": handed_on / len(values),
            "forward_errors": errors,
            "old_members_cpu_ms": cpu_ms,
            "wrong": wrong,
            "misses": misses,
            "leave": leaves,
        }
    finally:
        pool.stop()


def _leaves(
    pool: EtcdMembers, chain_count: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The fifth member leaving with its hand-off, then member 3 without
    (module doc); the pool's members are the five."""
    members = pool.members
    placement = Placement([m.address for m in members])
    chains, values = _chains(b"l", chain_count)
    for member in members:  # each value through its owner: no copy elsewhere
        mine = [(key, value) for key, value in values.items()
                if placement.owner(LEAVE_NS, key) == member.address]  # fmt: skip
        with Client(member.socket_target, token=pool.token, timeout_s=60) as client:
            client.put_many(LEAVE_NS, mine)
    rows = []
    with Client(members[0].socket_target, token=pool.token, timeout_s=60) as looker:

        def found() -> float:
            return _found(looker, LEAVE_NS, chains)

        _wait(lambda: found() == 1.0, "the leave's chains stored")
        for leaving, handoff_ms in ((members[MEMBERS], LEAVE_HANDOFF_MS), (members[3], 0)):
            progress(f"pool: leave: member {leaving.index} stops, hand-off {handoff_ms} ms")
            owned = sum(1 for key in values if placement.owner(LEAVE_NS, key) == leaving.address)
            started = time.perf_counter()
            leaving.stop()  # SIGTERM: the hand-off, then its lease revoked
            stop_s = time.perf_counter() - started
            members.remove(leaving)
            pool.wait_members()
            share = found()
            said = handoff_line(leaving)
            handed = re.search(r"handed_on=(\d+)", said)
            took = re.search(r" ms=(\d+)", said)
            placement = Placement([m.address for m in members])
            clients = {m.address: Client(m.socket_target, token=pool.token, timeout_s=60)
                       for m in members}  # fmt: skip
            try:  # each through its owner now: no copy made
                wrong, misses = _checked(values, partial(_at_owner, clients, placement))
            finally:
                for client in clients.values():
                    client.close()
            rows.append({
                "member": leaving.index,
                "handoff_ms_allowed": handoff_ms,
                "owned": owned,
                "handed_on": int(handed.group(1)) if handed else 0,
                "handoff_ms": int(took.group(1)) if took else None,
                "stop_s": stop_s,
                "found_after": share,
                "wrong": wrong,
                "misses": misses,
            })  # fmt: skip
    return rows


def handoff_line(member: Member) -> str:
    """The log line of a stopped member's hand-off before it left; empty
    where it made none."""
    return next(
        (line for line in member.running.log if "pool values handed on before leaving" in line), ""
    )


def _at_owner(clients: dict[str, Client], placement: Placement, key: bytes) -> bytes | None:
    """The leave's value of ``key``, read through its owner."""
    return clients[placement.owner(LEAVE_NS, key)].get(LEAVE_NS, key)


def _chains(tag: bytes, chain_count: int) -> tuple[list[list[bytes]], dict[bytes, bytes]]:
    """``chain_count`` chains of CHAIN_BLOCKS keys starting with ``tag``, and
    each key's value."""
    positions = range(CHAIN_BLOCKS)
    chains = [[tag + b"%04d-b%03d" % (c, b) for b in positions] for c in range(chain_count)]
    values = {key: block_value(c * CHAIN_BLOCKS + b, VALUE_BYTES)
              for c, chain in enumerate(chains) for b, key in enumerate(chain)}  # fmt: skip
    return chains, values


def _found(looker: Client, namespace: str, chains: list[list[bytes]]) -> float:
    """The share of the chains' blocks ``looker``'s lookups find."""
    blocks = sum(looker.lookup(namespace, chain) for chain in chains)
    return blocks / sum(map(len, chains))


def _checked(values: dict[bytes, bytes], get: Callable[[bytes], bytes | None]) -> tuple[int, int]:
    """Every value read back with ``get``: (wrong, missing)."""
    wrong = misses = 0
    for key, value in values.items():
        got = get(key)
        misses += got is None
        wrong += got is not None and got != value
    return wrong, misses


def _wait(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + JOIN_WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"pool join: no {what} within {JOIN_WAIT_S:g} s")
        time.sleep(0.05)
