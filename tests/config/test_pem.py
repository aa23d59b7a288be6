"""The TLS files are read once and those bytes checked and used
(``kvd.config.pem``): a certificate that a tool rewrites in place while the
daemon reads it is either whole and checked or refused. Read twice (once to
check, once to use), a certificate read empty the second time went to gRPC
beside its key, which aborts the process. Here the certificate is a FIFO
that gives the certificate to its first reader and nothing to any later
one, so a second read shows."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvd.client import Tls
from kvd.cluster.client_tls import ClientTls
from kvd.config.pem import TlsFiles, read_tls_files
from kvd.config.setting import ConfigError
from kvd.wire.errors import InvalidArgument
from tests.certs import Pki, make_pki, write_server_files


def rewritten_in_place(path: Path, first: bytes) -> tuple[threading.Thread, threading.Event]:
    """``path`` as a FIFO: ``first`` for its first reader, nothing for each
    later one, until the event is set (``release``)."""
    os.mkfifo(path)
    done = threading.Event()

    def serve() -> None:
        payload = first
        while not done.is_set():
            with open(path, "wb") as fifo:  # waits for a reader
                fifo.write(payload)
            payload = b""

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, done


def release(path: Path, writer: tuple[threading.Thread, threading.Event]) -> None:
    """Stop the FIFO's writer (a last reader that takes nothing)."""
    thread, done = writer
    done.set()
    while thread.is_alive():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        os.close(fd)
        thread.join(0.1)


def key_and_ca(where: Path) -> tuple[Pki, Path, Path]:
    """A PKI, and its server key and CA bundle written under ``where`` (the
    certificate is each test's own)."""
    pki = make_pki("pem")
    _, key, ca = write_server_files(where, pki)
    return pki, key, ca


def server_files(cert: Path, key: Path, ca: Path) -> TlsFiles:
    """The files as the daemon's listener reads them."""
    return read_tls_files(
        (str(cert), "tls_cert_file"), (str(key), "tls_key_file"),
        (str(ca), "tls_client_ca_file"), server=True,
    )  # fmt: skip


def etcd_client_files(cert: Path, key: Path, ca: Path) -> ClientTls:
    """The files as the daemon's etcd client reads them."""
    return ClientTls.read(
        (str(ca), "pool_etcd_ca_file"), (str(cert), "pool_etcd_cert_file"),
        (str(key), "pool_etcd_key_file"),
    )  # fmt: skip


def test_a_certificate_is_read_once_and_the_bytes_checked_are_the_ones_used(
    tmp_path: Path,
) -> None:
    pki, key, ca = key_and_ca(tmp_path)
    cert = tmp_path / "rotating.crt"
    writer = rewritten_in_place(cert, pki.server.cert)
    try:
        files = server_files(cert, key, ca)
    finally:
        release(cert, writer)
    assert (files.cert, files.key, files.ca) == (pki.server.cert, pki.server.key, pki.ca.cert)


def test_a_client_certificate_read_empty_is_refused_never_used_without_it(
    tmp_path: Path,
) -> None:
    pki, key, ca = key_and_ca(tmp_path)
    cert = tmp_path / "empty.crt"
    cert.write_bytes(b"")
    with pytest.raises(ConfigError, match="pool_etcd_cert_file"):
        etcd_client_files(cert, key, ca)
    # A whole one is taken, and gRPC's credentials are made of the same bytes.
    cert.write_bytes(pki.server.cert)
    tls = etcd_client_files(cert, key, ca)
    assert (tls.cert, tls.key, tls.ca) == (pki.server.cert, pki.server.key, pki.ca.cert)
    tls.credentials()


@pytest.mark.parametrize("bad", ["key", "ca"])
def test_a_key_that_does_not_match_or_a_ca_that_is_none_is_refused(
    tmp_path: Path, bad: str
) -> None:
    pki, other = make_pki("pem"), make_pki("other")
    cert, key, ca = write_server_files(tmp_path, pki)
    if bad == "key":
        key.write_bytes(other.server.key)
    else:
        ca.write_bytes(b"not a certificate")
    setting = {"key": "tls_cert_file", "ca": "tls_client_ca_file"}[bad]
    with pytest.raises(ConfigError, match=setting):
        server_files(cert, key, ca)


def test_a_client_never_hands_grpc_a_key_without_its_certificate(tmp_path: Path) -> None:
    """The same for ``kvd.client``'s ``Tls`` (an engine's connector): a
    certificate read empty (rewritten in place) is an error it turns into a
    miss, not a channel gRPC aborts the engine's process on."""
    pki, key, ca = key_and_ca(tmp_path)
    cert = tmp_path / "client.crt"
    cert.write_bytes(b"")
    tls = Tls(ca_file=str(ca), cert_file=str(cert), key_file=str(key))
    with pytest.raises(InvalidArgument, match="cert_file"):
        tls.credentials()
    with pytest.raises(InvalidArgument, match="cert_file"):
        tls.context()
    cert.write_bytes(pki.server.cert)
    tls.credentials()
    tls.context()
