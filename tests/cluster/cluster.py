"""Several real kvd daemons on loopback forming one pool, for tests/pool."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from pathlib import Path

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
