"""The connectors' shared Guard: every failure is the caller's miss value,
and a daemon found down or slow is not asked again for a retry window."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from kvd.config.settings import SETTINGS_BY_NAME
from kvd.connectors import common
from kvd.connectors.common import Guard
from kvd.wire.errors import DeadlineExceeded, InvalidArgument, Unavailable


def test_a_down_daemon_is_not_asked_again_within_the_window() -> None:
    guard = Guard("test", retry_after_s=0.2)
    asked: list[int] = []

    def down() -> int:
        asked.append(1)
        raise DeadlineExceeded("slow")

    assert guard.call("lookup", 0, down) == 0
    assert guard.down()
    for _ in range(5):
        assert guard.call("lookup", 0, down) == 0
    assert len(asked) == 1 and guard.skipped == 5 and guard.failures() == 6
    time.sleep(0.25)
    assert not guard.down()
    assert guard.call("lookup", 7, lambda: 7) == 7


@pytest.mark.parametrize("error", [Unavailable("gone"), ConnectionResetError(), TimeoutError()])
def test_unreachable_kinds_open_the_window(error: Exception) -> None:
    guard = Guard("test", retry_after_s=60)

    def fail() -> None:
        raise error

    guard.call("save", None, fail)
    assert guard.down()


@pytest.mark.parametrize("error", [InvalidArgument("bad"), ValueError("bug"), KeyError("k")])
def test_a_bad_answer_to_one_call_does_not(error: Exception) -> None:
    guard = Guard("test", retry_after_s=60)

    def fail() -> None:
        raise error

    assert guard.call("load", 0, fail) == 0
    assert not guard.down()
    assert guard.call("load", 3, lambda: 3) == 3 and guard.skipped == 0


def test_without_a_url_a_connector_prefers_the_default_socket(tmp_path: Path) -> None:
    assert SETTINGS_BY_NAME["socket"].default == common.DEFAULT_SOCKET
    path = tmp_path / "grpc.sock"
    assert common.default_target(str(path)) == common.DEFAULT_TARGET  # no daemon here
    path.write_text("")
    assert common.default_target(str(path)) == common.DEFAULT_TARGET  # not a socket
    path.unlink()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        assert common.default_target(str(path)) == f"unix://{path}"
    assert common.parse_target("kvd://10.0.0.1:7070") == "10.0.0.1:7070"
