"""Membership from an etcd that takes TLS only and asks for client
certificates (``--client-cert-auth``), as production etcds are run: daemons
with ``pool_etcd_ca_file`` and a client certificate the etcd's CA signed
register and see each other; one without a client certificate is refused
by etcd, says so, and serves alone; a client certificate replaced on disk
is used from the next session on; a CA file that is not one is refused
at start (the settings' rules: tests/cluster/test_membership.py). A real
etcd (Debian's etcd-server) on loopback ports."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.etcd_tls import etcd_tls
from kvd.config.loading import load_config
from kvd.config.settings import ConfigError
from tests.certs import make_ca, make_leaf
from tests.cluster.etcd_server import EtcdTlsFiles, etcd_binary, start_etcd, start_member
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd (apt-get install etcd-server)"),
]


def etcd_files(root: Path) -> EtcdTlsFiles:
    """etcd's certificate (SAN 127.0.0.1) and a client's, one CA signing both."""
    ca, ca_cert, ca_key = make_ca("etcd CA")
    paths = {name: root / name for name in ("ca.crt", "etcd.crt", "etcd.key", "c.crt", "c.key")}
    paths["ca.crt"].write_bytes(ca.cert)
    server = make_leaf(ca_cert, ca_key, "etcd", server=True)
    client = make_leaf(ca_cert, ca_key, "kvd", server=False)
    for name, data in (("etcd", server), ("c", client)):
        paths[f"{name}.crt"].write_bytes(data.cert)
        paths[f"{name}.key"].write_bytes(data.key)
    return EtcdTlsFiles(paths["etcd.crt"], paths["etcd.key"], paths["ca.crt"],
                        paths["c.crt"], paths["c.key"])  # fmt: skip


def tls_flags(files: EtcdTlsFiles, *, client_cert: bool = True) -> list[str]:
    flags = ["--pool-etcd-ca-file", str(files.ca)]
    if client_cert:
        flags += ["--pool-etcd-cert-file", str(files.client_cert),
                  "--pool-etcd-key-file", str(files.client_key)]  # fmt: skip
    return flags


def members_of(daemon: DaemonProcess) -> float:
    return metric(daemon.metrics_port, "kvd_cluster_members")


def test_members_register_and_see_each_other_over_tls(tmp_path: Path) -> None:
    (tmp_path / "etcd").mkdir()
    files = etcd_files(tmp_path)
    etcd = start_etcd(tmp_path / "etcd", files)
    daemons: list[DaemonProcess] = []
    try:
        daemons = [start_member(tmp_path, etcd, name, *tls_flags(files)) for name in "ab"]
        assert all(wait_until(lambda d=d: members_of(d) == 2, 15) for d in daemons)
        joined = [line for d in daemons for line in d.log if "pool joined" in line]
        assert len(joined) == 2 and all("etcd_tls=on" in line for line in joined), joined
        keys = [b"tls-etcd-%03d" % i for i in range(40)]
        values = {key: hashlib.sha256(key).digest() * 64 for key in keys}
        with Client(daemons[0].target, timeout_s=5) as client:
            client.put_many("ns", list(values.items()), chained=True)
        with Client(daemons[1].target, timeout_s=5) as client:
            assert wait_until(lambda: client.lookup("ns", keys) == len(keys))
            assert [client.get("ns", key) for key in keys] == [values[key] for key in keys]

        # Without a client certificate etcd refuses it: it says so, and serves alone.
        alone = start_member(tmp_path, etcd, "c", *tls_flags(files, client_cert=False))
        daemons.append(alone)
        assert wait_until(lambda: metric(alone.metrics_port, "kvd_cluster_membership_stale") == 1)
        said = [line for line in alone.log if "membership source unreachable" in line]
        assert said and "etcd://" in said[0], alone.log
        assert members_of(alone) == 1
        assert all(members_of(d) == 2 for d in daemons[:2])
        with Client(alone.target, timeout_s=5) as client:
            client.put("ns", b"alone", b"v" * 100)
            assert client.get("ns", b"alone") == b"v" * 100

        # A client certificate another CA signed is refused too, until the
        # files on disk are replaced by good ones: the next session reads them.
        _, other_cert, other_key = make_ca("another CA")
        stranger = make_leaf(other_cert, other_key, "kvd", server=False)
        cert, key = tmp_path / "d.crt", tmp_path / "d.key"
        cert.write_bytes(stranger.cert)
        key.write_bytes(stranger.key)
        flags = ["--pool-etcd-ca-file", str(files.ca),
                 "--pool-etcd-cert-file", str(cert), "--pool-etcd-key-file", str(key)]  # fmt: skip
        rotated = start_member(tmp_path, etcd, "d", *flags)
        daemons.append(rotated)
        assert wait_until(lambda: metric(rotated.metrics_port, "kvd_cluster_membership_stale") == 1)
        cert.write_bytes(files.client_cert.read_bytes())
        key.write_bytes(files.client_key.read_bytes())
        assert wait_until(lambda: members_of(rotated) == 3, 20)
        assert metric(rotated.metrics_port, "kvd_cluster_membership_stale") == 0
    finally:
        for daemon in daemons:
            daemon.discard()
        etcd.kill()


ETCD = {"pool_members": "etcd://127.0.0.1:2379/kvd"}


def test_an_etcd_ca_file_that_is_not_one_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_bytes(b"not a certificate")
    config = load_config(overrides={**ETCD, "pool_etcd_ca_file": str(tmp_path / "ca.crt")})
    with pytest.raises(ConfigError, match="pool_etcd_ca_file"):
        etcd_tls(config)
