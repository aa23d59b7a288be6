"""The bench's members with TLS between them: the ``grpc+tls`` and
``bulk+tls`` transports of ``kvd bench pool``'s remote gets
(``pool_tls_ca_file``; with ``bulk_tls`` for the second, whose members read
each other's values on their bulk ports, over TLS).

As a DaemonSet would: a CA made for the run signs one certificate with the
name ``SERVER_NAME`` (``pool_tls_server_name``), which every member serves
and presents to the others, and every listener asks its callers for a
certificate that CA signed (``tls_client_ca_file``, mTLS). Certificates are
made with ``cryptography`` (``kvd.tools.bench.certs``; installed with kvd's
test extras); without it the transport is not offered.
"""

from __future__ import annotations

from pathlib import Path

# The remote gets' transport names for members over gRPC with TLS, and over
# their bulk ports with TLS.
TLS_TRANSPORT = "grpc+tls"
BULK_TLS_TRANSPORT = "bulk+tls"
TRANSPORTS = (TLS_TRANSPORT, BULK_TLS_TRANSPORT)
# The name in the members' certificate.
SERVER_NAME = "kvd-pool"


def available() -> bool:
    """Whether certificates can be made here."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def member_flags(where: Path, transport: str = TLS_TRANSPORT) -> list[str]:
    """The flags of every member for ``transport``: the run's certificate,
    key and CA, written under ``where``."""
    from kvd.tools.bench.certs import write_run_files  # cryptography: test extras

    ca, cert, key = write_run_files(where, "kvd bench pool CA", SERVER_NAME, (SERVER_NAME,))
    ca_file = str(ca)
    return [
        "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-client-ca-file", ca_file, "--pool-tls-ca-file", ca_file,
        "--pool-tls-server-name", SERVER_NAME,
        *(("--bulk-tls", "true") if transport == BULK_TLS_TRANSPORT else ()),
    ]  # fmt: skip
