"""A kvd daemon in a child process, for benchmarks and tests, and a wait for
its write-back to settle (``written_back``).

Started as ``python -m kvd serve`` on ephemeral ports (0); the ports it bound
are read from its start-up log line, so runs never collide on a port. Stopped
with SIGTERM, then SIGKILL after a deadline.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvd.client import Client

START_TIMEOUT_S = 30.0
# How often ``written_back`` asks the daemon, and how long it waits at most.
WRITTEN_BACK_POLL_S = 0.05
WRITTEN_BACK_WAIT_S = 60.0
# Log lines kept per daemon: enough for any test to read its start and stop.
LOG_LINES_MAX = 10_000


class SpawnedDaemon:
    """A running ``kvd serve`` and what it printed."""

    # Every daemon started in this process, so a test run can kill leftovers.
    started: ClassVar[list[SpawnedDaemon]] = []

    def __init__(
        self,
        workdir: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        dram: str = "64MiB",
        max_value: str = "32MiB",
        ssd: str = "256MiB",
        segment: str = "64MiB",
        prefix: Sequence[str] = (),
    ) -> None:
        """``ssd=""`` starts a daemon without L2, or on the ``--ssd-path``
        the caller's ``args`` give. ``prefix``: a command the daemon runs
        under, as ``ip netns exec NAME`` (it execs, so the pid is the daemon's)."""
        self.workdir = workdir
        self.socket = str(workdir / "kvd.sock")
        self.log: list[str] = []
        self._started = threading.Event()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        if ssd:
            l2 = ["--ssd-path", str(workdir / "ssd-0.dat"), "--ssd-bytes", ssd,
                  "--ssd-segment-bytes", segment]  # fmt: skip
        elif "--ssd-path" in args:
            l2 = []  # the caller's own L2
        else:
            l2 = ["--no-ssd"]
        cmd = [
            *prefix, sys.executable, "-m", "kvd", "serve",
            "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0",
            "--socket", self.socket,
            "--dram-bytes", dram,
            "--max-value-bytes", max_value,
            *l2,
            "--shm-dir", str(workdir / "shm"),
            "--bulk-listen", "127.0.0.1:0",
            *args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        SpawnedDaemon.started.append(self)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self._started.wait(START_TIMEOUT_S)
        line = next((line for line in self.log if "kvd started" in line), None)
        if line is None or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError("kvd did not start:\n" + "\n".join(self.log))
        listen = re.search(r"listen=[^ ]*:(\d+)", line)
        metrics = re.search(r"metrics=[^ ]*:(\d+)", line)
        bulk = re.search(r"bulk=[^ ]*:(\d+)", line)
        self.bulk_port = int(bulk.group(1)) if bulk else 0
        self.port = int(listen.group(1)) if listen else 0
        self.metrics_port = int(metrics.group(1)) if metrics else 0

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if len(self.log) < LOG_LINES_MAX:
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

    def _reap(self) -> None:
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reap()
        return self.proc.returncode

    def discard(self) -> int:
        """Stop the daemon and remove its working directory (and its L2 file):
        a preallocated L2 file holds its disk space until it is deleted."""
        code = self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._reap()

    def alive(self) -> bool:
        return self.proc.poll() is None


def written_back(client: Client, timeout_s: float = WRITTEN_BACK_WAIT_S) -> bool:
    """Whether every value ``client``'s daemon took is on L2 within
    ``timeout_s``: none waits for its write and none is being written (a
    value leaves the queue when its write starts, and stays pinned until
    the write ends). A daemon without L2 has no write-back: True at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if not stats.get("writeback_queue") and not stats.get("writeback_writing"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(WRITTEN_BACK_POLL_S)
