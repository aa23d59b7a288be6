"""Crash points for the crash-torture tests: SIGKILL the daemon at a chosen
step of the write path, the Nth time it gets there.

Enabled only by the test settings ``test_crash_point`` / ``test_crash_after``
(also ``KVD_TEST_CRASH_POINT`` and ``KVD_TEST_CRASH_AFTER``); unset, ``hit()``
is one string comparison. The points, in write order:

- ``after_payload_write``: an L2 record's bytes are written, not yet synced
  nor in the index;
- ``after_sync``: a durable put's record is synced, the put not yet answered;
- ``after_publish``: a put is linked into L1 and about to be answered.
"""

from __future__ import annotations

import os
import signal

POINTS = ("", "after_payload_write", "after_sync", "after_publish")

_point = ""
_left = 0


def configure(point: str, after: int) -> None:
    global _point, _left
    assert point in POINTS, point
    _point = point
    _left = after


def hit(point: str) -> None:
    global _left
    if point != _point:
        return
    _left -= 1
    if _left <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
