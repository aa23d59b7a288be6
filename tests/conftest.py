"""Shared fixtures: a real kvd daemon process per test (or per module).

The daemon is started as ``python -m kvd serve`` on ephemeral ports (0) and a
Unix socket under the test's tmp dir; the ports it bound are read from its
start-up log line. It is stopped with SIGTERM (SIGKILL after 10 s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0


class DaemonProcess:
    """A running ``kvd serve`` and what it printed."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.socket = str(workdir / "kvd.sock")
        self.log: list[str] = []
        self._started = threading.Event()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "kvd",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--socket",
            self.socket,
            "--dram-bytes",
            "64MiB",
            "--max-value-bytes",
            "32MiB",
            "--ssd-path",
            str(workdir / "ssd-0.dat"),
            "--ssd-bytes",
            "256MiB",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        if not self._started.wait(START_TIMEOUT_S) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError("kvd did not start:\n" + "\n".join(self.log))
        line = next(line for line in self.log if "kvd started" in line)
        self.port = int(re.search(r"listen=[^ ]*:(\d+)", line).group(1))  # type: ignore[union-attr]
        metrics = re.search(r"metrics=[^ ]*:(\d+)", line)
        self.metrics_port = int(metrics.group(1)) if metrics else 0

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))
            if "kvd started" in line:
                self._started.set()
        self._started.set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def socket_target(self) -> str:
        return f"unix://{self.socket}"

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def alive(self) -> bool:
        return self.proc.poll() is None


DaemonFactory = Callable[..., DaemonProcess]


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    started: list[DaemonProcess] = []

    def start(
        *args: str, env: dict[str, str] | None = None, workdir: Path | None = None
    ) -> DaemonProcess:
        where = workdir or tmp_path / f"d{len(started)}"
        where.mkdir(parents=True, exist_ok=True)
        daemon = DaemonProcess(where, list(args), env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for a whole module of tests that do not disturb each other."""
    daemon = DaemonProcess(tmp_path_factory.mktemp("kvd"), [])
    yield daemon
    daemon.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
