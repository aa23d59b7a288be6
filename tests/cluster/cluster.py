"""Several real kvd daemons on loopback forming one pool, for tests/pool."""

from __future__ import annotations

import socket
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from kvd.cluster.rendezvous import Placement
from tests.support import DaemonProcess


def free_ports(count: int) -> list[int]:
    """Ports the kernel gives now (held together, so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def start_static_pool(
    root: Path, count: int, *extra: str, peer_timeout_ms: int = 200
) -> list[DaemonProcess]:
    """``count`` daemons without L2, each naming all of them in pool_members."""
    ports = free_ports(count)
    members = "static:" + ",".join(f"127.0.0.1:{port}" for port in ports)
    daemons: list[DaemonProcess] = []
    try:
        for i, port in enumerate(ports):
            where = root / f"m{i}"
            where.mkdir(parents=True, exist_ok=True)
            args = [
                "--listen", f"127.0.0.1:{port}",
                "--pool-members", members,
                "--pool-peer-timeout-ms", str(peer_timeout_ms),
                *extra,
            ]  # fmt: skip
            daemons.append(DaemonProcess(where, args, ssd=""))
    except BaseException:
        for daemon in daemons:
            daemon.kill()
        raise
    return daemons


def labelled(port: int, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def keys_owned(placement: Placement, owner: str, count: int, suffix: bytes = b"") -> list[bytes]:
    """``count`` keys of namespace ``ns`` ending in ``suffix`` that ``owner`` owns."""
    keys = (b"k-%04d" % i + suffix for i in range(10_000))
    return [k for k in keys if placement.owner("ns", k) == owner][:count]


def recv_all(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; ConnectionError if the peer closes first."""
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise ConnectionError("closed")
        data += piece
    return bytes(data)
