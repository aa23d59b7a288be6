"""Certificates made for a run: a CA, and leaves it signs (EC P-256,
SHA-256, valid from an hour before now for ``VALID_FOR``), for the bench's
members with TLS between them (``kvd.tools.bench.pool_tls``), its daemon
with TLS (``kvd.tools.bench.paths``) and the tests. Needs ``cryptography``
(kvd's test extras)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# How long a run's certificates are valid.
VALID_FOR = datetime.timedelta(days=1)


@dataclass
class Pem:
    cert: bytes
    key: bytes


def make_ca(name: str) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA named ``name``: its PEM files, certificate and key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, key)
        .issuer_name(subject)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), cert, key


def make_leaf(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str,
    names: Sequence[str] = (),
) -> Pem:  # fmt: skip
    """A certificate ``ca_cert`` signs for ``name``, with ``names`` (DNS
    names or IP addresses) as its SANs, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = _builder(subject, key).issuer_name(ca_cert.subject)
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def write_run_files(
    where: Path, ca_name: str, leaf_name: str, names: Sequence[str]
) -> tuple[Path, Path, Path]:
    """A CA named ``ca_name`` and a leaf it signs for ``leaf_name`` (SANs
    ``names``), written under ``where`` (made): the CA's, the leaf's
    certificate's and its key's files."""
    where.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, ca_key = make_ca(ca_name)
    leaf = make_leaf(ca_cert, ca_key, leaf_name, names)
    files = (where / "ca.crt", where / "leaf.crt", where / "leaf.key")
    for path, data in zip(files, (ca.cert, leaf.cert, leaf.key), strict=True):
        path.write_bytes(data)
    return files


def _builder(subject: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + VALID_FOR)
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
