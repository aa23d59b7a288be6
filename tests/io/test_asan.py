"""The native helper under AddressSanitizer and UndefinedBehaviorSanitizer.

``native/asan_check.sh`` builds kvd.io._uring with both sanitizers into a
scratch copy of the package and runs the tests that drive the native code
(the ring, record reads and their checks, the stripe cut, the region copies,
the L2 tier on top) against it; any out-of-bounds access, use after free or
undefined behaviour stops that run and fails this test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.io.backend import native_available

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "native" / "asan_check.sh"
TIMEOUT_S = 600  # the build and ~230 tests take ~20 s on 2 cores


def _missing() -> str | None:
    ok, reason = native_available()
    if not ok:
        return reason
    if shutil.which("gcc") is None:
        return "gcc is not installed"
    for lib in ("libasan.so", "libubsan.so"):
        out = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True)
        if not os.path.isabs(out.stdout.strip()):
            return f"gcc has no {lib}"
    return None


@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_native_code_is_clean_under_asan_and_ubsan() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTEST_ADDOPTS", None)
    out = subprocess.run(["sh", str(SCRIPT), "-x"], capture_output=True, text=True, env=env,
                         timeout=TIMEOUT_S)  # fmt: skip
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "failed" not in out.stdout, tail
