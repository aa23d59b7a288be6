"""Shared fixtures: a real kvd daemon process per test (or per module),
on ports no earlier test had and a Unix socket under the test's tmp dir;
a failed test's report shows what its daemons logged above info."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.tools.bench import shmem
from kvd.tools.bench.daemon import SpawnedDaemon
from tests.support import DaemonFactory, DaemonProcess

# A failed test's report shows at most this many of each daemon's lines.
LOG_LINES_SHOWN = 60


FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Whether the test's own body failed, for its fixtures' teardown."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.stash[FAILED] = report.failed


@pytest.fixture(autouse=True)
def environment_kept() -> Iterator[None]:
    """Each test leaves this process's environment as it found it. A library
    a test loads may set variables (LMCache's metrics set
    PROMETHEUS_MULTIPROC_DIR), and every daemon started after inherits them."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def daemon_warnings(request: pytest.FixtureRequest) -> Iterator[None]:
    """What each daemon the test started logged above info, in a failed
    test's report (a connection the daemon closed, a peer it gave up on, a
    plan it refused, with the reason): every daemon, whichever fixture or
    helper started it. Set up first, so it reports after their teardown."""
    first = len(SpawnedDaemon.started)
    yield
    if not request.node.stash.get(FAILED, False):
        return
    for daemon in SpawnedDaemon.started[first:]:
        lines = [line for line in daemon.log if "level=info" not in line]
        print(f"--- {daemon.workdir}: {len(lines)} log lines above info ---")
        print("\n".join(lines[-LOG_LINES_SHOWN:]))


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


@pytest.fixture
def shmem_huge_pages() -> Iterator[str]:
    """The kernel's shmem huge pages on ``advise`` for the test (as an operator
    sets them for kvd), the old mode back after; skipped where it cannot be
    set (not root, no THP, a read-only /sys)."""
    try:
        with shmem.shmem_huge_pages("advise") as old:
            yield old
    except shmem.ShmemError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for a whole module of tests that do not disturb each other."""
    daemon = DaemonProcess(tmp_path_factory.mktemp("kvd"), [])
    yield daemon
    daemon.discard()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No daemon outlives the test run, whatever a failed test left behind."""
    session.config._kvd_session = session  # type: ignore[attr-defined]  # for pytest_unconfigure
    for daemon in SpawnedDaemon.started:
        daemon.kill()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After everything is reported: a run that made a NIXL agent with a UCX
    backend in this process (tests/cluster/test_peer_nixl.py's bad owner)
    ends with os._exit and the run's status, since UCX's own teardown at
    interpreter exit crashed here (kvd.cluster.nixl_node.exit_past_ucx)."""
    nixl = sys.modules.get("kvd.cluster.nixl_node")
    if nixl is not None and nixl.ucx_loaded():
        session = getattr(config, "_kvd_session", None)
        nixl.exit_past_ucx(int(session.exitstatus) if session is not None else 0)
