"""A real etcd (Debian's etcd-server) on loopback ports, for the pool's
membership in ``kvd bench pool``'s join and in the tests."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvd.tools.bench.services import spawn_logged, wait_ready

START_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    return shutil.which("etcd")


@dataclass(frozen=True)
class EtcdTlsFiles:
    """etcd's certificate and key, and the CA whose client certificates it
    asks for (``--client-cert-auth``); a client's certificate and key for
    its health checks."""

    cert: Path
    key: Path
    ca: Path
    client_cert: Path
    client_key: Path


class EtcdServer:
    """One etcd member on ``client_port`` and ``peer_port`` of 127.0.0.1
    (with ``tls``, its client port over TLS only, asking for client
    certificates); ``kill`` and ``start`` again keep its data directory."""

    def __init__(
        self, workdir: Path, client_port: int, peer_port: int, tls: EtcdTlsFiles | None = None
    ) -> None:
        self.workdir = workdir
        self.client_port, self.peer_port = client_port, peer_port
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary (apt-get install etcd-server)")
        scheme = "https" if self.tls is not None else "http"
        client = f"{scheme}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = self.workdir / "etcd.log"
        tls_flags: list[str] = []
        context = None
        if self.tls is not None:
            tls_flags = [
                "--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth",
            ]  # fmt: skip
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        self.proc = spawn_logged(
            [
                binary, "--name", "kvd-test", "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvd-test={peer}", *tls_flags,
            ],
            log,
        )  # fmt: skip
        wait_ready(self.proc, lambda: _healthy(client, context), log, "etcd", START_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def _healthy(client_url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1, context=context) as response:
            return b"true" in response.read()
    except OSError:
        return False
