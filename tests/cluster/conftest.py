"""Fixtures of the pool's tests: a real etcd (``tests.cluster.etcd_server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.etcd_server import EtcdServer, start_etcd


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    (tmp_path / "etcd").mkdir()
    server = start_etcd(tmp_path / "etcd")
    yield server
    server.kill()
