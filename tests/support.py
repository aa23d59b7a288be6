"""What test modules share besides fixtures: the repository root, the daemon
process a test talks to (``kvd bench``'s own, so tests and the bench start
daemons the same way) and a bounded wait. Test modules import this, never
each other or conftest."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvd.tools.bench.daemon import SpawnedDaemon

REPO = Path(__file__).resolve().parent.parent

DaemonProcess = SpawnedDaemon

DaemonFactory = Callable[..., DaemonProcess]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
