"""The PEM files the TLS settings name: read with a bound, once, and those
bytes checked the way TLS will use them (a key that does not match its
certificate, or a CA bundle without a certificate, is a ConfigError naming
its setting).

Each file is read once, and the bytes read are the ones checked and then
used: a file replaced on disk while it is read (a certificate rotated by a
tool that rewrites it in place) is either whole and checked, or refused,
never half-checked. Reading the files once to check and again to use let a
certificate read empty in between reach gRPC beside its key, which aborts
the process (``grpc_tls_certificate_distributor``: ``cert_chain != nullptr``).
OpenSSL loads a certificate chain and key only from files, so the checked
bytes go to it through in-memory files (``memfd``), never to disk.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kvd.config.setting import ConfigError
from kvd.util.memfile import load_chain

# A PEM chain or CA bundle is a few KiB; 1 MiB stops a wrong path.
PEM_FILE_MAX_BYTES = 1 << 20

# A file and the setting that names it (for the errors); path "": none.
Named = tuple[str, str]


@dataclass(frozen=True)
class TlsFiles:
    """A certificate chain, its key and a CA bundle, as read and checked (b"": none)."""

    cert: bytes
    key: bytes
    ca: bytes


def read_pem(path: str, setting: str) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read(PEM_FILE_MAX_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{setting}: cannot read {path}: {error.strerror}", key=setting) from None
    if len(data) > PEM_FILE_MAX_BYTES:
        raise ConfigError(f"{setting}: {path} is over {PEM_FILE_MAX_BYTES} bytes", key=setting)
    return data


def read_tls_files(cert: Named, key: Named, ca: Named, *, server: bool) -> TlsFiles:
    """Read each file once and check those bytes as a TLS server (``server``)
    or client would: the key, where there is a certificate, must match it;
    the CA bundle, where named, must hold a certificate."""
    cert_pem, key_pem, ca_pem = (
        read_pem(path, setting) if path else b"" for path, setting in (cert, key, ca)
    )
    files = TlsFiles(cert_pem, key_pem, ca_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    if cert[0]:
        try:
            load_chain(context, cert_pem, key_pem)
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"{cert[1]}: {cert[0]} with {key[0]}: {error}", key=cert[1]) from None
    if ca[0]:
        try:
            context.load_verify_locations(cadata=ca_pem.decode("latin-1"))
        except (ssl.SSLError, ValueError) as error:
            raise ConfigError(f"{ca[1]}: {ca[0]}: {error}", key=ca[1]) from None
    return files
