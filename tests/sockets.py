"""Raw-socket helpers for the tests that speak kvd's framing by hand."""

from __future__ import annotations

import socket
import urllib.request


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


def metric(metrics_port: int, name: str) -> float:
    """An unlabelled sample of the daemon's /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")
