"""A real etcd (Debian's etcd-server) on loopback ports for tests/pool
(``kvd.tools.bench.etcd``, on ports no other test of the run had), and
daemons registered in it."""

from __future__ import annotations

from pathlib import Path

from kvd.tools.bench.etcd import EtcdServer, EtcdTlsFiles, etcd_binary
from tests.cluster.cluster import free_ports
from tests.support import DaemonProcess

__all__ = ["PREFIX", "EtcdServer", "EtcdTlsFiles", "etcd_binary", "start_etcd", "start_member"]

PREFIX = "/kvd-test/pool"


def start_etcd(workdir: Path, tls: EtcdTlsFiles | None = None) -> EtcdServer:
    client_port, peer_port = free_ports(2)
    return EtcdServer(workdir, client_port, peer_port, tls)


def start_member(
    root: Path, etcd: EtcdServer, name: str, *extra: str, **sizes: str
) -> DaemonProcess:
    """A daemon in the pool registered under ``etcd``'s PREFIX (a 2 s
    lease), in ``root / name`` (again after a restart: its L2 file is
    there), on a port of its own; without L2 unless ``sizes`` give ``ssd``
    (and ``dram``, ``max_value``: ``SpawnedDaemon``'s)."""
    (port,) = free_ports(1)
    where = root / name
    where.mkdir(exist_ok=True)
    args = [
        "--listen", f"127.0.0.1:{port}",
        "--pool-members", f"etcd://{etcd.endpoint}{PREFIX}",
        "--pool-etcd-ttl-ms", "2000",
        *extra,
    ]  # fmt: skip
    return DaemonProcess(where, args, **{"ssd": "", **sizes})
