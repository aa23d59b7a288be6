"""Raw-socket helpers for the tests that speak kvd's framing by hand."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import threading
import urllib.request
from collections.abc import Callable

# Linux's AF_PACKET constants (not in Python's socket module).
ETH_P_ALL = 3
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_RCVBUFFORCE = 33
CAPTURE_BUFFER_BYTES = 256 << 20


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


class Capture:
    """Every frame on the loopback interface while it runs (AF_PACKET, root),
    and how many the kernel dropped (none, for a capture that proves anything)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, CAPTURE_BUFFER_BYTES)
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self.frames: list[bytes] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.frames.append(self._sock.recv(1 << 17))
            except TimeoutError:
                if self._stop.is_set():
                    return  # stopped, and nothing more came for a while

    def stop(self) -> tuple[bytes, int]:
        """What crossed loopback, and the frames the kernel dropped."""
        self._stop.set()
        self._thread.join()
        stats = self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
        self._sock.close()
        _, drops = struct.unpack("II", stats)
        return b"".join(self.frames), drops


def send_in_clear() -> bytes:
    """A pattern sent over a plain TCP connection on loopback, for a
    ``Capture`` to show it sees loopback payloads: the pattern."""
    control = b"sent in clear, for the capture " * 2
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as out,
    ):
        out.sendall(control * 4)
        accepted, _ = server.accept()
        accepted.recv(1024)
        accepted.close()
    return control
