"""A real etcd (Debian's etcd-server) on loopback ports, for tests/pool."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.cluster.cluster import free_ports
from tests.support import DaemonProcess

START_TIMEOUT_S = 20.0
PREFIX = "/kvd-test/pool"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member; ``stop`` and ``start`` again keep its data directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.client_port, self.peer_port = free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        binary = etcd_binary()
        assert binary is not None
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [
                binary, "--name", "kvd-test", "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvd-test={peer}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((self.workdir / "etcd.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as response:
                    if b"true" in response.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("etcd did not become healthy")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def start_member(root: Path, etcd: EtcdServer, name: str, *extra: str) -> DaemonProcess:
    """A daemon without L2 in the pool registered under ``etcd``'s PREFIX
    (a 2 s lease), in ``root / name``."""
    (port,) = free_ports(1)
    where = root / name
    where.mkdir()
    args = [
        "--listen", f"127.0.0.1:{port}",
        "--pool-members", f"etcd://{etcd.endpoint}{PREFIX}",
        "--pool-etcd-ttl-ms", "2000",
        *extra,
    ]  # fmt: skip
    return DaemonProcess(where, args, ssd="")
