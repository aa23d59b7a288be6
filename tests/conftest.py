"""Shared fixtures: a real kvd daemon process per test (or per module),
on ephemeral ports and a Unix socket under the test's tmp dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.tools.bench.daemon import SpawnedDaemon
from tests.support import DaemonFactory, DaemonProcess


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
    daemon.discard()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No daemon outlives the test run, whatever a failed test left behind."""
    for daemon in SpawnedDaemon.started:
        daemon.kill()
