"""Members that talk over TLS (``pool_tls_ca_file``): three real daemons on
loopback, each with a certificate the pool's CA signed, read each other's
values over gRPC with TLS, or over their bulk ports with TLS where those
take it (``bulk_tls``), and no value crosses loopback in clear (a capture
of the loopback interface, as root); a member whose certificate another CA
signed gets and gives nothing, as misses; new files take effect on SIGHUP;
a CA file that is not one is refused at start."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.peer_tls import peer_tls
from kvd.cluster.rendezvous import Placement
from kvd.config.loading import load_config
from kvd.config.settings import ConfigError
from tests.certs import make_ca, make_leaf
from tests.cluster.cluster import labelled, pool_auth, start_static_pool
from tests.sockets import Capture, metric, send_in_clear
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

NS = "team-a/tls"


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(b"tls:" + key).digest() * 2048  # 64 KiB, a pattern per key


def member_files(
    root: Path, names: list[str], *, foreign: frozenset[str] = frozenset()
) -> list[list[str]]:
    """Each member's flags: a certificate the pool's CA signed (another CA's
    for the names in ``foreign``), its key, the pool's CA; mTLS on every
    listener (peers must present a certificate the pool's CA signed)."""
    ca, ca_cert, ca_key = make_ca("pool CA")
    _, other_cert, other_key = make_ca("another CA")
    ca_file = root / "pool-ca.crt"
    ca_file.write_bytes(ca.cert)
    flags = []
    for name in names:
        signer = (other_cert, other_key) if name in foreign else (ca_cert, ca_key)
        leaf = make_leaf(*signer, f"kvd-{name}", server=True)
        cert, key = root / f"{name}.crt", root / f"{name}.key"
        cert.write_bytes(leaf.cert)
        key.write_bytes(leaf.key)
        flags.append([
            "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-client-ca-file", str(ca_file), "--pool-tls-ca-file", str(ca_file),
        ])  # fmt: skip
    return flags


# Each case's flags beside the TLS files: the members' bulk ports in clear
# (values then go over gRPC), or taking TLS only (values go there).
BULK = {"grpc": (), "bulk": ("--bulk-tls", "true")}


@contextlib.contextmanager
def members(
    root: Path, count: int, foreign: frozenset[str] = frozenset(), way: str = "grpc"
) -> Iterator[list[DaemonProcess]]:
    own = member_files(root, [f"m{i}" for i in range(count)], foreign=foreign)
    daemons = start_static_pool(root, count, *pool_auth(root), *BULK[way], own=own)
    try:
        yield daemons
    finally:
        for daemon in daemons:
            daemon.discard()


def engine(daemon: DaemonProcess) -> Client:
    """An engine on the member's node: its Unix socket, the engine's token."""
    return Client(daemon.socket_target, token="engine-token-team-a", timeout_s=5)


@pytest.mark.parametrize("way", sorted(BULK))
def test_members_read_each_others_values_over_tls_only(tmp_path: Path, way: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("capturing loopback needs root")
    with members(tmp_path, 3, way=way) as daemons:
        joined = [line for d in daemons for line in d.log if "pool joined" in line]
        assert len(joined) == 3 and all("peer_tls=on" in line for line in joined), joined
        assert all(f"peer_transport={way}" in line for line in joined), joined
        placement = Placement([d.target for d in daemons])
        keys = [b"tls-block-%03d" % i for i in range(24)]
        remote = [k for k in keys if placement.owner(NS, k) != daemons[1].target]
        capture = Capture()
        try:
            with engine(daemons[0]) as client:
                client.put_many(NS, [(key, value_of(key)) for key in keys], chained=True)
            with engine(daemons[1]) as client:
                assert wait_until(lambda: client.lookup(NS, keys) == len(keys))
                assert [client.get(NS, key) for key in keys] == [value_of(key) for key in keys]
            control = send_in_clear()  # the capture sees loopback TCP payloads
        finally:
            wire, drops = capture.stop()
        assert control in wire and drops == 0, drops
        assert remote and metric(daemons[1].metrics_port, "kvd_cluster_remote_gets_total") > 0
        port = daemons[1].metrics_port
        assert labelled(port, "kvd_cluster_peer_reads_total", transport=way) == len(remote)
        leaked = [k for k in keys if hashlib.sha256(b"tls:" + k).digest() in wire]
        assert not leaked, leaked  # no value crossed loopback in clear
        for daemon in daemons:
            assert labelled(daemon.metrics_port, "kvd_cluster_peer_call_errors_total") == 0


@pytest.mark.parametrize("way", sorted(BULK))
def test_a_member_another_ca_signed_gets_and_gives_misses(tmp_path: Path, way: str) -> None:
    with members(tmp_path, 3, frozenset({"m2"}), way) as daemons:
        trusted, stranger = daemons[1], daemons[2]
        placement = Placement([d.target for d in daemons])
        theirs = [k for k in (b"s-%03d" % i for i in range(60))
                  if placement.owner(NS, k) == stranger.target]  # fmt: skip
        ours = [k for k in (b"t-%03d" % i for i in range(60))
                if placement.owner(NS, k) == trusted.target]  # fmt: skip
        with engine(stranger) as client:
            client.put_many(NS, [(key, value_of(key)) for key in theirs])
        with engine(trusted) as client:
            client.put_many(NS, [(key, value_of(key)) for key in ours])
            # Its certificate does not check: its values are misses here...
            assert all(client.get(NS, key) is None for key in theirs)
        with engine(stranger) as client:
            # ...and this member's listener refuses its certificate.
            assert all(client.get(NS, key) is None for key in ours)
            assert [client.get(NS, key) for key in theirs] == [value_of(k) for k in theirs]
        for daemon in (trusted, stranger):
            failed = labelled(daemon.metrics_port, "kvd_cluster_peer_call_errors_total")
            assert failed > 0, daemon.target


@pytest.mark.parametrize("way", sorted(BULK))
def test_new_files_take_effect_on_sighup(tmp_path: Path, way: str) -> None:
    with members(tmp_path, 2, way=way) as daemons:
        reader, owner = daemons
        placement = Placement([d.target for d in daemons])
        keys = [k for k in (b"r-%03d" % i for i in range(60))
                if placement.owner(NS, k) == owner.target]  # fmt: skip
        with engine(owner) as client:
            client.put_many(NS, [(key, value_of(key)) for key in keys])
        half = len(keys) // 2
        with engine(reader) as client:
            assert [client.get(NS, k) for k in keys[:half]] == [value_of(k) for k in keys[:half]]
        # The reader is told to trust another CA only: its next calls fail.
        ca_file = tmp_path / "pool-ca.crt"
        trusted = ca_file.read_bytes()
        ca_file.write_bytes(make_ca("another CA")[0].cert)
        reader.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: sum("kvd reloaded" in line for line in reader.log) == 1)
        with engine(reader) as client:
            assert client.get(NS, keys[half]) is None
            # The pool's CA again: values read (once the owner, marked down
            # after the failed call, is asked again).
            ca_file.write_bytes(trusted)
            reader.proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: sum("kvd reloaded" in line for line in reader.log) == 2)
            key = keys[half + 1]
            assert wait_until(lambda: client.get(NS, key) == value_of(key))
            rest = keys[half + 2 :]
            assert [client.get(NS, k) for k in rest] == [value_of(k) for k in rest]
        # A file that is not a CA bundle is refused; the files in use stay.
        ca_file.write_bytes(b"not a certificate")
        reader.proc.send_signal(signal.SIGHUP)
        assert wait_until(
            lambda: any("reload failed" in line and "pool_tls" in line for line in reader.log)
        )
        with engine(reader) as client:
            assert client.get(NS, keys[0]) == value_of(keys[0])


def test_a_ca_file_that_is_not_one_is_refused_at_start(tmp_path: Path) -> None:
    (flags,) = member_files(tmp_path, ["m0"])
    (tmp_path / "pool-ca.crt").write_bytes(b"not a certificate")
    settings = dict(zip((f[2:].replace("-", "_") for f in flags[::2]), flags[1::2], strict=True))
    config = load_config(overrides={"pool_members": "static:127.0.0.1:7070", **settings})
    with pytest.raises(ConfigError, match="pool_tls_ca_file"):
        peer_tls(config)
