"""What the real-engine tests share besides fixtures: free ports, and a
daemon that restarts on the same ports and files (a restart the engine's
connector must ride through without being told)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from kvd.client import Client
from tests.support import DaemonProcess, free_ports


class RestartableDaemon:
    """A daemon on fixed ports and one L2 file, stopped, killed, frozen and
    started again by the tests."""

    def __init__(self, workdir: Path, dram: str = "512MiB", ssd: str = "1GiB") -> None:
        self.workdir = workdir
        self.port, self.bulk_port = free_ports(2)
        self.dram, self.ssd = dram, ssd
        self.daemon: DaemonProcess | None = None

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

    def start(self, *args: str) -> DaemonProcess:
        assert self.daemon is None or not self.daemon.alive()
        self.daemon = DaemonProcess(
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
