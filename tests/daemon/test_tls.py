"""TLS and mTLS on the gRPC TCP listener, with certificates the tests make."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.client import AsyncClient, Client, InvalidArgument, Tls, Unavailable
from kvd.config.loading import load_config
from kvd.config.settings import ConfigError
from kvd.connectors.common import tls_config
from kvd.daemon.tls import ServerTls
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import KVStoreStub
from tests.certs import Pki, make_pki, write_server_files
from tests.support import DaemonFactory, DaemonProcess, wait_until

CALL_TIMEOUT_S = 5


def channel(daemon: DaemonProcess, pki: Pki, *, client_cert: bool) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert,
        private_key=pki.client.key if client_cert else None,
        certificate_chain=pki.client.cert if client_cert else None,
    )
    return grpc.secure_channel(daemon.target, creds)


def healthy(ch: grpc.Channel) -> bool:
    answer = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S
    )
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return make_pki("first")


def test_tls_serves_tls_clients_only(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    cert, key, _ = write_server_files(tmp_path, pki)
    daemon = daemon_factory("--tls-cert-file", str(cert), "--tls-key-file", str(key))
    assert any("tls=tls" in line for line in daemon.log if "kvd started" in line)
    with channel(daemon, pki, client_cert=False) as ch:
        assert healthy(ch)
        stub = KVStoreStub(ch)
        stub.BatchPut(
            pb.BatchPutRequest(namespace="n", items=[pb.PutItem(key=b"k", value=b"v")]),
            timeout=CALL_TIMEOUT_S,
        )
        got = stub.BatchGet(pb.BatchGetRequest(namespace="n", keys=[b"k"]), timeout=CALL_TIMEOUT_S)
        assert got.items[0].value == b"v"
    with grpc.insecure_channel(daemon.target) as plain, pytest.raises(grpc.RpcError) as caught:
        healthy(plain)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_without_a_certificate(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    cert, key, ca = write_server_files(tmp_path, pki)
    daemon = daemon_factory(
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-client-ca-file", str(ca)
    )
    with channel(daemon, pki, client_cert=False) as ch, pytest.raises(grpc.RpcError) as caught:
        healthy(ch)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
    stranger = make_pki("stranger")  # a certificate from a CA the daemon does not trust
    stranger.ca = pki.ca
    with channel(daemon, stranger, client_cert=True) as ch, pytest.raises(grpc.RpcError):
        healthy(ch)
    with channel(daemon, pki, client_cert=True) as ch:
        assert healthy(ch)


def test_sighup_loads_new_certificates(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    cert, key, _ = write_server_files(tmp_path, pki)
    daemon = daemon_factory("--tls-cert-file", str(cert), "--tls-key-file", str(key))
    with channel(daemon, pki, client_cert=False) as ch:
        assert healthy(ch)
    second = make_pki("second")
    write_server_files(tmp_path, second)
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: any("kvd reloaded" in line for line in daemon.log))
    with channel(daemon, second, client_cert=False) as ch:
        assert healthy(ch)  # a new connection gets the new certificate
    with channel(daemon, pki, client_cert=False) as ch, pytest.raises(grpc.RpcError):
        healthy(ch)  # the old CA no longer vouches for the server


def test_mismatched_key_is_refused(tmp_path: Path, pki: Pki) -> None:
    other = make_pki("other")
    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    cert.write_bytes(pki.server.cert)
    key.write_bytes(other.server.key)
    with pytest.raises(ConfigError, match="tls_cert_file"):
        ServerTls(str(cert), str(key), "")
    key.write_bytes(pki.server.key)
    tls = ServerTls(str(cert), str(key), "")
    key.write_bytes(other.server.key)
    with pytest.raises(ConfigError):
        tls.reload()  # the old pair stays in force
    assert tls.mode == "tls"


def test_tls_settings_go_together() -> None:
    with pytest.raises(ConfigError, match="tls_key_file"):
        load_config(None, {}, {"tls_cert_file": "c.pem"})
    with pytest.raises(ConfigError, match="tls_client_ca_file"):
        load_config(None, {}, {"tls_client_ca_file": "ca.pem"})
    config = load_config(
        None, {}, {"tls_cert_file": "c", "tls_key_file": "k", "tls_client_ca_file": "ca"}
    )
    assert config.tls_client_ca_file == "ca"


def test_client_library_over_tls_and_mtls(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    """``Client(tls=...)`` against a TLS daemon, then an mTLS one: values of every
    size go over gRPC (the bulk port is in clear without bulk_tls:
    tests/daemon/test_bulk_tls.py); a client without the right
    certificate or CA is refused; TLS settings that cannot work are refused up front."""
    cert, key, ca = write_server_files(tmp_path, pki)
    client_cert, client_key = tmp_path / "client.crt", tmp_path / "client.key"
    client_cert.write_bytes(pki.client.cert)
    client_key.write_bytes(pki.client.key)
    value = bytes(range(256)) * 8192  # 2 MiB: streamed, and would be bulk without TLS
    daemon = daemon_factory("--tls-cert-file", str(cert), "--tls-key-file", str(key))
    with Client(daemon.target, tls=Tls(ca_file=str(ca))) as client:
        assert client.put("t", b"big", value) is False
        assert client.get("t", b"big") == value
        room = bytearray(len(value))
        got = client.get_many_into("t", [b"big", b"no"], [room, bytearray(1)])
        assert got == [len(value), None]
        assert room == value
        assert client._fast_paths() == (None, None)  # no shm, no bulk: only TLS carries values

    async def async_round_trip() -> bytes | None:
        async with AsyncClient(daemon.target, tls=Tls(ca_file=str(ca))) as client:
            await client.put("t", b"small", b"x" * 100)
            return await client.get("t", b"small")

    assert asyncio.run(async_round_trip()) == b"x" * 100
    with Client(daemon.target, timeout_s=2) as plain, pytest.raises(Unavailable):
        plain.get("t", b"big")  # a plain client does not get in
    stranger = tmp_path / "stranger-ca.crt"
    stranger.write_bytes(make_pki("stranger").ca.cert)
    wrong_ca = Tls(ca_file=str(stranger))
    with Client(daemon.target, timeout_s=2, tls=wrong_ca) as client, pytest.raises(Unavailable):
        client.get("t", b"big")  # the server's certificate is not from this CA

    mutual = daemon_factory(
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-client-ca-file", str(ca)
    )
    mtls = Tls(ca_file=str(ca), cert_file=str(client_cert), key_file=str(client_key))
    with Client(mutual.target, tls=mtls) as client:
        assert client.put("t", b"m", value) is False
        assert client.get("t", b"m") == value
    no_cert = Tls(ca_file=str(ca))
    with Client(mutual.target, timeout_s=2, tls=no_cert) as client, pytest.raises(Unavailable):
        client.get("t", b"m")  # no client certificate

    with pytest.raises(InvalidArgument, match="Unix socket"):
        Client(daemon.socket_target, tls=Tls(ca_file=str(ca)))
    with pytest.raises(InvalidArgument, match="go together"):
        Client(daemon.target, tls=Tls(ca_file=str(ca), cert_file=str(client_cert)))
    with pytest.raises(InvalidArgument, match="ca_file"):
        Client(daemon.target, tls=Tls(ca_file=str(tmp_path / "missing.crt")))


def test_connectors_read_tls_settings() -> None:
    config = {"tls_ca_file": "/etc/kvd/ca.crt", "tls_cert_file": "c", "tls_key_file": "k"}
    assert tls_config(lambda name, default: config.get(name, default)) == Tls(
        "/etc/kvd/ca.crt", "c", "k"
    )
    assert tls_config(lambda name, default: {"tls": True}.get(name, default)) == Tls()
    assert tls_config(lambda name, default: default) is None
