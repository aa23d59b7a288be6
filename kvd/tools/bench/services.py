"""Helper services a bench or a test starts beside kvd (etcd, dnsmasq,
Prometheus): a child process logging to a file, waited for until it answers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def spawn_logged(command: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` with its output appended to ``log_path`` and no stdin."""
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def wait_ready(
    proc: subprocess.Popen[bytes], ready: Callable[[], bool], log_path: Path, what: str,
    timeout_s: float, poll_s: float = 0.05,
) -> None:  # fmt: skip
    """Return once ``ready()``; RuntimeError (the log's tail) if the process
    ends first, or (after killing it) if it is not ready within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} ended:\n" + _tail(log_path))
        if ready():
            return
        time.sleep(poll_s)
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"{what} not ready within {timeout_s:g} s:\n" + _tail(log_path))


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-2000:]
