"""Fixtures for the real-engine tests: the engine environment, and a daemon
that restarts on the same ports and files (a restart the engine's connector
must ride through without being told)."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client.clients import Client
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.bench.engine_proc import EngineEnv, EngineUnavailable, find_engine_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def engine_env() -> EngineEnv:
    """The engine environment; the tests skip, saying why, where there is none.

    ``REQUIRE_ENGINE_TESTS=1`` (set by CI) turns a missing environment into a
    failure: there the README's command must have built it.
    """
    try:
        return find_engine_env()
    except EngineUnavailable as exc:
        if os.environ.get("REQUIRE_ENGINE_TESTS") == "1":
            pytest.fail(f"REQUIRE_ENGINE_TESTS=1 but {exc}")
        pytest.skip(str(exc))


class RestartableDaemon:
    """A daemon on fixed ports and one L2 file, stopped, killed, frozen and
    started again by the tests."""

    def __init__(self, workdir: Path, dram: str = "512MiB", ssd: str = "1GiB") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.bulk_port = free_port()
        self.dram, self.ssd = dram, ssd
        self.daemon: SpawnedDaemon | None = None

    @property
    def url(self) -> str:
        return f"kvd://127.0.0.1:{self.port}"

    @property
    def socket_url(self) -> str:
        """The daemon's Unix socket: gRPC there, values through shared memory."""
        return f"kvd://{self.workdir / 'kvd.sock'}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *args: str) -> SpawnedDaemon:
        assert self.daemon is None or not self.daemon.alive()
        self.daemon = SpawnedDaemon(
            self.workdir,
            ["--listen", self.target, "--bulk-listen", f"127.0.0.1:{self.bulk_port}", *args],
            dram=self.dram,
            ssd=self.ssd,
            segment="64MiB",
        )
        return self.daemon

    def stop(self) -> int:
        assert self.daemon is not None
        return self.daemon.stop()

    def kill9(self) -> None:
        assert self.daemon is not None
        self.daemon.kill()

    def freeze(self) -> None:
        assert self.daemon is not None
        os.kill(self.daemon.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.daemon is not None
        os.kill(self.daemon.proc.pid, signal.SIGCONT)

    def stats(self) -> dict[str, int]:
        with Client(self.target, timeout_s=10) as client:
            return {k: int(v) for k, v in client.stats().items() if isinstance(v, int | float)}

    def close(self) -> None:
        if self.daemon is not None:
            if self.daemon.alive():
                self.thaw()
            self.daemon.discard()


@pytest.fixture(scope="module")
def kvd_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableDaemon]:
    daemon = RestartableDaemon(tmp_path_factory.mktemp("kvd-engine"))
    daemon.start()
    yield daemon
    daemon.close()
