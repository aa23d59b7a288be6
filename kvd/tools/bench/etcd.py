"""A real etcd (Debian's etcd-server) on loopback ports, for the pool's
membership in ``kvd bench pool``'s join and in the tests."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from pathlib import Path

from kvd.tools.bench.services import spawn_logged, wait_ready

START_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member on ``client_port`` and ``peer_port`` of 127.0.0.1;
    ``kill`` and ``start`` again keep its data directory."""

    def __init__(self, workdir: Path, client_port: int, peer_port: int) -> None:
        self.workdir = workdir
        self.client_port, self.peer_port = client_port, peer_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary (apt-get install etcd-server)")
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = self.workdir / "etcd.log"
        self.proc = spawn_logged(
            [
                binary, "--name", "kvd-test", "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvd-test={peer}",
            ],
            log,
        )  # fmt: skip
        wait_ready(self.proc, lambda: _healthy(client), log, "etcd", START_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def _healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1) as response:
            return b"true" in response.read()
    except OSError:
        return False
