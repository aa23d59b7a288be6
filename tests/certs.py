"""Certificates the tests make: a CA, and leaves it signs (a server's with
the SANs localhost and 127.0.0.1, usable as a client's too)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(name: str) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), cert, key


def make_leaf(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, server: bool
) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


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
