"""The members of a pool for ``kvd bench pool`` and the pool's failure tests:
real daemons, each in its own network namespace (``kvd.tools.bench.netns``)
with its own address, or on loopback where namespaces are not permitted.

Every member names all of them in a ``static:`` pool_members. Engines reach
their node's daemon the way they do on a node: its Unix socket (and shared
memory), which any namespace of this host can open; only the daemons' peer
calls cross the (virtual) network. A member is restarted on its own working
directory, so a member with an L2 file comes back warm.

Members stand for separate nodes, so their NIXL agents' UCX runs without its
shared-memory transports (``UCX_TLS=^sm`` unless UCX_TLS is set): on one
host UCX would otherwise move a peer read through shared memory (cma), which
no two real nodes share. With them, 8 values of 4 MiB a call read at 2.3-3.4
GB/s between namespaces, above the TCP ceiling; without, at 0.7-1.0 GB/s.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import socket
import threading
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvd.cluster.rendezvous import Placement
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.bench.netns import Lab, unavailable

# Each member has its own address in a lab, so all listen on one port.
LAB_PORT = 7400
# UCX's transports for members, as between nodes: every one but shared memory.
UCX_TLS_BETWEEN_NODES = "^sm"
METRICS_TIMEOUT_S = 5.0


def write_tokens(root: Path) -> tuple[str, list[str]]:
    """An engine token and a pool token, both admitted to every namespace (a
    daemon listening on a non-loopback address needs auth); the engine's
    token and the daemon flags that use them."""
    engine, pool = secrets.token_hex(16), secrets.token_hex(16)
    table = root / "tokens.toml"
    table.write_text("".join(
        f'[[tokens]]\nname = "{name}"\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
        'namespaces = ["*"]\n'
        for name, token in (("engine", engine), ("pool", pool))
    ))  # fmt: skip
    (root / "pool-token").write_text(pool + "\n")
    return engine, ["--auth-tokens-file", str(table), "--pool-token-file", str(root / "pool-token")]


DaemonFactory = Callable[..., SpawnedDaemon]


def free_ports(count: int) -> list[int]:
    """Loopback ports the kernel gives now (held together, so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


class Member:
    """One daemon of the pool, restartable on its own working directory."""

    def __init__(
        self, index: int, address: str, workdir: Path, args: list[str],
        options: dict[str, Any], lab: Lab | None, factory: DaemonFactory,
    ) -> None:  # fmt: skip
        self.index = index
        self.address = address  # HOST:PORT, as pool_members names it
        self.workdir = workdir
        self.lab = lab
        self._args = args
        self._options = options
        self._factory = factory
        self.daemon: SpawnedDaemon | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        prefix = self.lab.command(self.index, []) if self.lab is not None else []
        self.daemon = self._factory(self.workdir, self._args, prefix=prefix, **self._options)

    @property
    def running(self) -> SpawnedDaemon:
        if self.daemon is None:
            raise RuntimeError(f"member {self.index} is not running")
        return self.daemon

    @property
    def socket_target(self) -> str:
        """Where an engine on this node reaches its daemon."""
        return self.running.socket_target

    def signal(self, signum: int) -> None:
        os.kill(self.running.proc.pid, signum)

    def kill(self) -> None:
        self.running.kill()

    def stop(self) -> None:
        if self.daemon is not None:
            if self.daemon.alive():
                self.signal(signal.SIGCONT)  # a stopped daemon cannot act on SIGTERM
            self.daemon.stop()

    def restart(self) -> None:
        """Start again on the same working directory (and L2 file)."""
        self.stop()
        self.start()

    def metrics_text(self) -> str:
        port = self.running.metrics_port

        def fetch() -> str:
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
                return str(response.read().decode())

        return self.lab.call_in(self.index, fetch) if self.lab is not None else fetch()

    def metric(self, name: str) -> float:
        """An unlabelled sample of its /metrics; 0 when not exported yet."""
        for line in self.metrics_text().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


class Pool:
    """``count`` members in one static pool; a context manager that stops them
    (and removes the lab). ``netns=False``, or no permission for namespaces,
    puts them on loopback; ``note`` then says why."""

    def __init__(
        self,
        root: Path,
        count: int,
        extra: Sequence[str] = (),
        *,
        netns: bool = True,
        peer_timeout_ms: int = 200,
        factory: DaemonFactory = SpawnedDaemon,
        **options: Any,
    ) -> None:
        self.note = "" if netns else "loopback (asked for)"
        if netns and unavailable():
            self.note = f"loopback: {unavailable()}"
        self.lab = Lab(count) if not self.note else None
        if self.lab is not None:
            addresses = [f"{node.address}:{LAB_PORT}" for node in self.lab.nodes]
        else:
            addresses = [f"127.0.0.1:{port}" for port in free_ports(count)]
        members = "static:" + ",".join(addresses)
        root.mkdir(parents=True, exist_ok=True)
        if "UCX_TLS" not in os.environ:
            options["env"] = {"UCX_TLS": UCX_TLS_BETWEEN_NODES, **options.get("env", {})}
        self.token, auth = write_tokens(root)
        self.members = [
            Member(
                i, address, root / f"m{i}",
                ["--listen", address, "--pool-members", members,
                 # Peers reach the bulk port at the member's host too.
                 "--bulk-listen", address.rpartition(":")[0] + ":0",
                 "--pool-peer-timeout-ms", str(peer_timeout_ms), *auth, *extra],
                options, self.lab, factory,
            )
            for i, address in enumerate(addresses)
        ]  # fmt: skip
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise

    def _start_all(self) -> None:
        """Start the members at once (each waits for its start-up line)."""
        _each(self.members, Member.start)

    @property
    def where(self) -> str:
        return "network namespaces" if self.lab is not None else self.note

    def placement(self) -> Placement:
        return Placement([m.address for m in self.members])

    def owned_by(self, index: int, namespace: str, keys: Sequence[bytes]) -> list[bytes]:
        owner = self.members[index].address
        owners = self.placement().owners(namespace, keys)
        return [key for key, o in zip(keys, owners, strict=True) if o == owner]

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        _each(self.members, Member.stop)
        if self.lab is not None:
            self.lab.close()


def _each(members: Sequence[Member], work: Callable[[Member], None]) -> None:
    """``work`` on every member at once (a daemon takes a second or more to
    start or stop); the first failure is raised once all are done."""
    failures: list[BaseException] = []

    def one(member: Member) -> None:
        try:
            work(member)
        except BaseException as exc:  # re-raised below
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
