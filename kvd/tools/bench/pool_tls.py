"""The bench's members with TLS between them: the ``grpc+tls`` transport of
``kvd bench pool``'s remote gets (``pool_tls_ca_file``).

As a DaemonSet would: a CA made for the run signs one certificate with the
name ``SERVER_NAME`` (``pool_tls_server_name``), which every member serves
and presents to the others, and every listener asks its callers for a
certificate that CA signed (``tls_client_ca_file``, mTLS). Certificates are
made with ``cryptography`` (installed with kvd's test extras); without it
the transport is not offered.
"""

from __future__ import annotations

import datetime
from pathlib import Path

# The remote gets' transport name for members over gRPC with TLS.
TLS_TRANSPORT = "grpc+tls"
# The name in the members' certificate.
SERVER_NAME = "kvd-pool"
# How long the run's certificates are valid.
VALID_FOR = datetime.timedelta(days=1)


def available() -> bool:
    """Whether certificates can be made here."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def member_flags(where: Path) -> list[str]:
    """The flags of every member: the run's certificate, key and CA, written under ``where``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    where.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def signed(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
        signer: ec.EllipticCurvePrivateKey, ca: bool,
    ) -> x509.Certificate:  # fmt: skip
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvd bench pool CA")])
    ca = signed("kvd bench pool CA", ca_key, ca_name, ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = signed(SERVER_NAME, key, ca_name, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": ca.public_bytes(pem),
        "member.crt": cert.public_bytes(pem),
        "member.key": key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    for name, data in files.items():
        (where / name).write_bytes(data)
    ca_file = str(where / "ca.crt")
    return [
        "--tls-cert-file", str(where / "member.crt"), "--tls-key-file", str(where / "member.key"),
        "--tls-client-ca-file", ca_file, "--pool-tls-ca-file", ca_file,
        "--pool-tls-server-name", SERVER_NAME,
    ]  # fmt: skip
