"""Fixtures of the L2 tier tests: each io backend kind, and a small tier."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.l2 import BACKENDS, SMALL_SEGMENT_BYTES, Env


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def small(tmp_path: Path, kind: str) -> AsyncIterator[Env]:
    """One path, 4 segments of 256 KiB: full after 12 records of 60 KiB."""
    env = Env(tmp_path, kind, paths=1, segments=4, segment_bytes=SMALL_SEGMENT_BYTES)
    yield env
    env.close_all()
