"""Certificates the tests make (``kvd.tools.bench.certs``): a CA, and
leaves it signs (a server's with the SANs localhost and 127.0.0.1, usable
as a client's too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from kvd.tools.bench import certs
from kvd.tools.bench.certs import Pem, make_ca

__all__ = ["Pem", "Pki", "make_ca", "make_leaf", "make_pki", "write_server_files"]


def make_leaf(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, server: bool
) -> Pem:
    """A client's certificate, or a server's for localhost and 127.0.0.1."""
    return certs.make_leaf(ca_cert, ca_key, name, ("localhost", "127.0.0.1") if server else ())


@dataclass
class Pki:
    ca: Pem
    server: Pem
    client: Pem


def make_pki(name: str) -> Pki:
    ca, ca_cert, ca_key = make_ca(f"{name} CA")
    return Pki(
        ca,
        make_leaf(ca_cert, ca_key, "kvd-server", server=True),
        make_leaf(ca_cert, ca_key, "kvd-client", server=False),
    )


def write_server_files(where: Path, pki: Pki) -> tuple[Path, Path, Path]:
    cert, key, ca = where / "server.crt", where / "server.key", where / "ca.crt"
    cert.write_bytes(pki.server.cert)
    key.write_bytes(pki.server.key)
    ca.write_bytes(pki.ca.cert)
    return cert, key, ca
