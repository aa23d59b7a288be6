"""A real DNS server (Debian's dnsmasq) on a loopback port, answering the
pool's name from a hosts file, as a Kubernetes headless Service's name is
answered with its pods' addresses. ``serve`` rewrites the file and sends
SIGHUP (dnsmasq reads it again); ``kill`` and ``start`` take it away and
bring it back on the same port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode

from kvd.tools.bench.services import spawn_logged, wait_ready
from tests.cluster.cluster import free_ports

START_TIMEOUT_S = 10.0


def dnsmasq_binary() -> str | None:
    return shutil.which("dnsmasq")


class DnsServer:
    """dnsmasq on 127.0.0.1, no upstream, answering only from ``hosts``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.hosts = workdir / "pool.hosts"
        self.hosts.write_text("")
        self.hosts.chmod(0o644)
        (self.port,) = free_ports(1)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = dnsmasq_binary()
        assert binary is not None
        log = self.workdir / "dnsmasq.log"
        self.proc = spawn_logged(
            [
                binary, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
                "--no-hosts", f"--addn-hosts={self.hosts}", f"--port={self.port}",
                # Answer cluster.local itself (a name without AAAA: no data),
                # as CoreDNS does, rather than look for an upstream.
                "--local=/cluster.local/",
                "--listen-address=127.0.0.1", "--bind-interfaces", "--log-facility=-",
                f"--pid-file={self.workdir / 'dnsmasq.pid'}", "--cache-size=0",
                *(["--user=root"] if os.geteuid() == 0 else []),
            ],
            log,
        )  # fmt: skip
        wait_ready(self.proc, self._answers, log, "dnsmasq", START_TIMEOUT_S)

    def _answers(self) -> bool:
        query = dns.message.make_query("kvd-probe.invalid.", "A")
        try:
            reply = dns.query.udp(query, "127.0.0.1", port=self.port, timeout=0.2)
        except (OSError, dns.exception.Timeout):
            return False
        return reply.rcode() in (dns.rcode.NXDOMAIN, dns.rcode.NOERROR, dns.rcode.REFUSED)

    def serve(self, name: str, addresses: list[str]) -> None:
        """Answer ``name`` with ``addresses`` from now on (none: no record)."""
        self.hosts.write_text("".join(f"{address} {name}\n" for address in addresses))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def port_free_on(hosts: list[str], port: int) -> bool:
    """Whether ``port`` can be bound on every one of ``hosts`` now."""
    for host in hosts:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True
