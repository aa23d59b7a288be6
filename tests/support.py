"""What test modules share besides fixtures: the repository root, the daemon
process a test talks to (``kvd bench``'s own, so tests and the bench start
daemons the same way) and a bounded wait. Test modules import this, never
each other or conftest.

``TEST_IO_BACKEND=threads`` (or ``uring``) runs every daemon the tests start
on that I/O backend, unless a test picks one itself: the suite runs on
both backends this way (not a ``KVD_*`` name: kvd refuses those it does not
know, and a test daemon gets none of the caller's)."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

from kvd.tools.bench.daemon import SpawnedDaemon

REPO = Path(__file__).resolve().parent.parent

IO_BACKEND = os.environ.get("TEST_IO_BACKEND", "")


LISTENERS = ("--listen", "--metrics-listen", "--bulk-listen")


class DaemonProcess(SpawnedDaemon):
    """A test's daemon: ``kvd bench``'s, on ``TEST_IO_BACKEND`` when set.

    It listens on ports no earlier test of the run had (unless its ``args``
    name them), not on the kernel's ephemeral ones: a client an earlier test
    left behind keeps reconnecting to its daemon's port, and reached a later
    daemon the kernel gave that port (CI runs counted its calls in another
    test's figures)."""

    def __init__(self, workdir: Path, args: list[str], *more: Any, **options: Any) -> None:
        if IO_BACKEND and "--io-backend" not in args:
            args = [*args, "--io-backend", IO_BACKEND]
        unset = [flag for flag in LISTENERS if flag not in args]
        for flag, port in zip(unset, free_ports(len(unset)), strict=True):
            args = [*args, flag, f"127.0.0.1:{port}"]
        super().__init__(workdir, args, *more, **options)


DaemonFactory = Callable[..., DaemonProcess]

T = TypeVar("T")

# Ports a test names before a daemon binds them come from below the
# kernel's ephemeral range: a port the kernel handed out and took back may
# go to the next ":0" listener or outgoing connection (an earlier daemon's
# metrics or bulk port, say) before the daemon meant to take it starts. A
# CI run lost a pool test to that ("Address already in use"). No port is
# handed out twice in one run, so nothing an earlier test left pointing at
# a port finds a later test's listener there.
PORTS_LOW = 20_000
PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now, below the ephemeral range
    and never returned before in this process (random ones, each bound to
    check it, held together so they differ)."""
    try:
        ephemeral_low = int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768
    high = max(ephemeral_low, PORTS_LOW + 4_096)
    found: list[int] = []
    with ExitStack() as held:
        for port in random.sample(range(PORTS_LOW, high), high - PORTS_LOW):
            if port in _handed_out:
                continue
            sock = held.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            found.append(port)
            if len(found) == count:
                _handed_out.update(found)
                return found
    raise RuntimeError(f"fewer than {count} free ports in {PORTS_LOW}..{high - 1}")


# How long a test waits for the daemon's write-back to settle
# (kvd.tools.bench.daemon.written_back).
WRITE_BACK_WAIT_S = 30.0


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def first_answer(call: Callable[[], T], timeout_s: float = 10.0) -> T:
    """``call()``'s result once it stops raising: the first calls after a
    daemon restarted may find it still starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped: the signal
    is delivered asynchronously, and a test that races a still-running
    daemon sees it answer."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("T", "t")

    assert wait_until(stopped, timeout_s), f"process {pid} did not stop"
