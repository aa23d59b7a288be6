"""Fixtures for the real-engine tests: the engine environment, and a daemon
that restarts on the same ports and files (a restart the engine's connector
must ride through without being told)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvd.tools.bench.engine_proc import EngineEnv, EngineUnavailable, find_engine_env
from tests.engines.support import RestartableDaemon


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


@pytest.fixture(scope="module")
def kvd_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableDaemon]:
    daemon = RestartableDaemon(tmp_path_factory.mktemp("kvd-engine"))
    daemon.start()
    yield daemon
    daemon.close()
