"""TLS on the bulk TCP port (``bulk_tls``): a client with ``tls`` moves
values there, over TLS, and none crosses loopback in clear; a client
speaking in clear, or without the certificate mTLS asks for, gets nothing
and the daemon serves on; new files take effect on SIGHUP; a daemon whose
bulk port is in clear is never sent values by a TLS client."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from kvd.client import Client, Tls, Unavailable
from kvd.config.loading import load_config
from kvd.config.settings import ConfigError
from kvd.wire.bulk import OP_HELLO, encode_request
from tests.certs import Pki, make_pki, write_server_files
from tests.sockets import Capture, closed_by_daemon, metric, send_in_clear
from tests.support import DaemonFactory, DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return make_pki("bulk")


def value_of(key: bytes, size: int) -> bytes:
    """``size`` bytes of a pattern that is the key's alone."""
    block = hashlib.sha256(b"bulk-tls:" + key).digest()
    return (block * (size // len(block) + 1))[:size]


def tls_daemon(factory: DaemonFactory, root: Path, pki: Pki, *more: str) -> DaemonProcess:
    cert, key, _ = write_server_files(root, pki)
    return factory(
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--bulk-tls", "true", *more
    )


def client_files(root: Path, pki: Pki) -> Tls:
    cert, key = root / "client.crt", root / "client.key"
    cert.write_bytes(pki.client.cert)
    key.write_bytes(pki.client.key)
    return Tls(ca_file=str(root / "ca.crt"), cert_file=str(cert), key_file=str(key))


def test_values_go_over_the_bulk_port_with_tls_only(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    if os.geteuid() != 0:
        pytest.skip("capturing loopback needs root")
    daemon = tls_daemon(daemon_factory, tmp_path, pki)
    assert any("bulk_tls=on" in line for line in daemon.log if "kvd started" in line)
    sizes = [64 << 10, 1 << 20, 4 << 20, 100]
    keys = [b"v-%d" % size for size in sizes]
    capture = Capture()
    try:
        with Client(daemon.target, tls=Tls(ca_file=str(tmp_path / "ca.crt"))) as client:
            _, bulk = client._fast_paths()
            assert bulk is not None  # the bulk port, over TLS
            for key, size in zip(keys, sizes, strict=True):
                assert client.put("t", key, value_of(key, size)) is False
            assert [client.get("t", k) for k in keys] == [
                value_of(k, s) for k, s in zip(keys, sizes, strict=True)
            ]
            rooms = [bytearray(size) for size in sizes]
            assert client.get_many_into("t", keys, rooms) == sizes
            assert [bytes(r) for r in rooms] == [
                value_of(k, s) for k, s in zip(keys, sizes, strict=True)
            ]
        control = send_in_clear()  # the capture sees loopback TCP payloads
    finally:
        wire, drops = capture.stop()
    assert control in wire and drops == 0, drops
    leaked = [k for k in keys if hashlib.sha256(b"bulk-tls:" + k).digest() in wire]
    assert not leaked, leaked


def test_pipelined_batches_over_tls(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    """Batches of many values: requests pipelined on each TLS connection,
    their answers read while later ones are still being sent."""
    daemon = tls_daemon(daemon_factory, tmp_path, pki)
    keys = [b"p-%03d" % i for i in range(200)]
    sizes = [(64 << 10) + 7 * i for i in range(len(keys))]
    values = [value_of(k, size) for k, size in zip(keys, sizes, strict=True)]
    with Client(daemon.target, tls=Tls(ca_file=str(tmp_path / "ca.crt"))) as client:
        assert client._fast_paths()[1] is not None
        assert client.put_many("t", list(zip(keys, values, strict=True))) == [False] * len(keys)
        assert client.get_many("t", [*keys, b"none"]) == [*values, None]


def test_a_client_in_clear_or_without_its_certificate_gets_nothing(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    daemon = tls_daemon(
        daemon_factory, tmp_path, pki, "--tls-client-ca-file", str(tmp_path / "ca.crt")
    )
    # A HELLO in clear is no TLS handshake: the connection closes, and the
    # daemon says why.
    with socket.create_connection(("127.0.0.1", daemon.bulk_port), timeout=5) as sock:
        token = b"any"
        sock.sendall(encode_request(OP_HELLO, 0, length=len(token)) + token)
        assert closed_by_daemon(sock)
    assert wait_until(
        lambda: any("bulk connection closed" in line and "SSL" in line for line in daemon.log)
    )
    refused = 'kvd_rejected_requests_total{reason="unauthenticated"}'
    assert wait_until(lambda: metric(daemon.metrics_port, refused) == 1)
    # TLS without the client certificate mTLS asks for: refused there and on gRPC.
    no_cert = Tls(ca_file=str(tmp_path / "ca.crt"))
    with Client(daemon.target, tls=no_cert, timeout_s=2) as client, pytest.raises(Unavailable):
        client.get("t", b"k")
    # The daemon serves on, over TLS with the certificate.
    value = value_of(b"k", 2 << 20)
    with Client(daemon.target, tls=client_files(tmp_path, pki)) as client:
        assert client._fast_paths()[1] is not None
        assert client.put("t", b"k", value) is False
        assert client.get("t", b"k") == value


def test_a_stalled_handshake_is_closed_and_the_port_serves_on(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    """A client that connects and sends nothing, or half a ClientHello, is
    closed within bulk_hello_timeout_ms (the handshake counts against it),
    while a TLS client is served meanwhile."""
    daemon = tls_daemon(daemon_factory, tmp_path, pki, "--bulk-hello-timeout-ms", "300")
    silent = socket.create_connection(("127.0.0.1", daemon.bulk_port), timeout=5)
    half = socket.create_connection(("127.0.0.1", daemon.bulk_port), timeout=5)
    half.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's start
    started = time.monotonic()
    value = value_of(b"h", 1 << 20)
    with Client(daemon.target, tls=Tls(ca_file=str(tmp_path / "ca.crt"))) as client:
        assert client.put("t", b"h", value) is False
        assert client.get("t", b"h") == value
    assert closed_by_daemon(silent) and closed_by_daemon(half)
    assert time.monotonic() - started < 5  # the hello timeout, not the sockets' own
    assert wait_until(lambda: sum("no HELLO within" in line for line in daemon.log) == 2)


def test_new_files_take_effect_on_sighup(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    daemon = tls_daemon(daemon_factory, tmp_path, pki)
    value = value_of(b"s", 1 << 20)
    with Client(daemon.target, tls=Tls(ca_file=str(tmp_path / "ca.crt"))) as client:
        assert client.put("t", b"s", value) is False
    second = make_pki("bulk second")
    write_server_files(tmp_path, second)  # the CA file the clients use changes too
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: any("kvd reloaded" in line for line in daemon.log))
    with Client(daemon.target, tls=Tls(ca_file=str(tmp_path / "ca.crt"))) as client:
        assert client._fast_paths()[1] is not None
        assert client.get("t", b"s") == value  # new connections get the new certificate
    old_ca = tmp_path / "old-ca.crt"
    old_ca.write_bytes(pki.ca.cert)
    old = Tls(ca_file=str(old_ca))
    with Client(daemon.target, tls=old, timeout_s=2) as client, pytest.raises(Unavailable):
        client.get("t", b"s")  # the old CA no longer vouches for the daemon


def test_a_tls_client_sends_nothing_to_a_bulk_port_in_clear(
    daemon_factory: DaemonFactory, tmp_path: Path, pki: Pki
) -> None:
    cert, key, ca = write_server_files(tmp_path, pki)
    daemon = daemon_factory("--tls-cert-file", str(cert), "--tls-key-file", str(key))
    value = value_of(b"c", 2 << 20)
    with Client(daemon.target, tls=Tls(ca_file=str(ca)), bulk=True) as client:
        assert client.put("t", b"c", value) is False
        assert client.get("t", b"c") == value
        assert client._fast_paths() == (None, None)  # gRPC with TLS carried them


def test_bulk_tls_settings_go_together() -> None:
    with pytest.raises(ConfigError, match=r"bulk_tls.*tls_cert_file"):
        load_config(None, {}, {"bulk_tls": True})
    tls = {"tls_cert_file": "c", "tls_key_file": "k"}
    with pytest.raises(ConfigError, match=r"bulk_tls.*bulk_listen"):
        load_config(None, {}, {**tls, "bulk_tls": True, "bulk_listen": ""})
    assert load_config(None, {}, {**tls, "bulk_tls": True}).bulk_tls
    pool = {**tls, "pool_members": "static:127.0.0.1:7070", "pool_tls_ca_file": "ca"}
    with pytest.raises(ConfigError, match="nixl carries values in clear"):
        load_config(None, {}, {**pool, "pool_peer_transport": "nixl"})
    for transport in ("auto", "bulk", "grpc"):
        config = load_config(None, {}, {**pool, "pool_peer_transport": transport, "bulk_tls": True})
        assert config.pool_peer_transport == transport
