"""Raw-socket helpers for the tests that speak kvd's framing by hand."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import urllib.request
from collections.abc import Callable


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer if the peer closed first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def closed_by_daemon(sock: socket.socket) -> bool:
    """True when the daemon closed the connection (EOF or reset) within the timeout."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


def scrape(metrics_port: int) -> str:
    """The daemon's /metrics, as text."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def metric(metrics_port: int, name: str) -> float:
    """An unlabelled sample of the daemon's /metrics."""
    text = scrape(metrics_port)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def sample(metrics_port: int, name: str) -> float:
    """``metric``, 0 while the daemon exports none (nothing counted yet)."""
    try:
        return metric(metrics_port, name)
    except AssertionError:
        return 0.0


def samples(metrics_port: int, *prefixes: str) -> list[str]:
    """The lines of the daemon's /metrics that start with one of ``prefixes``:
    what to look at when a count is off."""
    return [line for line in scrape(metrics_port).splitlines() if line.startswith(prefixes)]


def sockets_on(*ports: int) -> list[str]:
    """Every TCP socket on this machine whose local or peer port is one of
    ``ports``, with its process (``ss -tanp``): who listens there and who is
    connected, when a count says someone else was."""
    try:
        listed = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"ss: {exc}"]
    ends = tuple(f":{port} " for port in ports)
    return [line for line in listed.stdout.splitlines() if any(end in line for end in ends)]


async def most_between_turns(count: Callable[[], float], work: Callable[[], None]) -> float:
    """Run blocking ``work`` in a thread while a task on this event loop reads
    ``count()`` at each of its turns; the largest growth between two turns,
    i.e. the most the daemon's loop did without letting other work run."""
    gaps: list[float] = [0.0]
    stop = asyncio.Event()

    async def probe() -> None:
        last = count()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = count()
            gaps.append(now - last)
            last = now

    watcher = asyncio.create_task(probe())
    try:
        await asyncio.to_thread(work)
    finally:
        stop.set()
        await watcher
    return max(gaps)
