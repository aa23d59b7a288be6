"""TLS and mTLS for the gRPC TCP listener, with certificates reloaded on SIGHUP.

gRPC asks ``_fetch`` for a certificate configuration at each new handshake
(``grpc.dynamic_ssl_server_credentials``); a reload reads and checks the
files and hands the new configuration over at the next handshake, so
connections already open keep theirs. A reload that fails (a missing file,
a key that does not match its certificate) keeps the old configuration.

Whether client certificates are required is fixed at start: gRPC takes it
once, with the credentials. With ``bulk_tls`` the bulk TCP port takes TLS
too, from the same files (``bulk_context``: an ``ssl.SSLContext`` for each
new connection, made again on reload). The Unix socket does not use TLS
(it is guarded by its file mode); nor does the bulk port without
``bulk_tls`` (guarded by the token in its HELLO frame).
"""

from __future__ import annotations

import logging
import ssl
import threading

import grpc

from kvd.config.pem import TlsFiles, read_tls_files
from kvd.config.setting import ConfigError
from kvd.config.settings import Config
from kvd.wire.tls_socket import server_context

log = logging.getLogger("kvd.daemon.tls")


class ServerTls:
    """The listener's certificate, key and client CA; ``reload()`` re-reads them."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str, bulk: bool = False) -> None:
        """``bulk``: the bulk port takes TLS too (``bulk_tls``)."""
        self.cert_file = cert_file
        self.key_file = key_file
        self.ca_file = ca_file
        self.require_client_cert = bool(ca_file)
        self.bulk = bulk
        self._lock = threading.Lock()  # _fetch runs on gRPC's threads
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._initial, self._bulk_context = self._load()

    @classmethod
    def from_config(cls, config: Config) -> ServerTls | None:
        if not config.tls_cert_file:
            return None
        return cls(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file, config.bulk_tls
        )

    @property
    def mode(self) -> str:
        return "mtls" if self.require_client_cert else "tls"

    def _load(self) -> tuple[grpc.ServerCertificateConfiguration, ssl.SSLContext | None]:
        """gRPC's configuration and the bulk port's context (``bulk_tls``), both
        from one read of the files, checked (``kvd.config.pem``)."""
        files = read_tls_files(
            (self.cert_file, "tls_cert_file"), (self.key_file, "tls_key_file"),
            (self.ca_file, "tls_client_ca_file"), server=True,
        )  # fmt: skip
        config = grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.ca or None
        )
        return config, self._load_bulk(files)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=self.require_client_cert
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def _load_bulk(self, files: TlsFiles) -> ssl.SSLContext | None:
        if not self.bulk:
            return None
        try:
            return server_context(files.cert, files.key, files.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"bulk_tls: the TLS files do not load: {exc}", key="tls_cert_file"
            ) from None

    def bulk_context(self) -> ssl.SSLContext:
        """The bulk port's TLS for a new connection (``bulk_tls``)."""
        assert self._bulk_context is not None, "bulk_tls is off"
        return self._bulk_context

    def reload(self) -> None:
        """Read the files again; the next handshake uses them. ConfigError keeps the old."""
        loaded, bulk = self._load()
        with self._lock:
            self._pending = loaded
        if bulk is not None:
            self._bulk_context = bulk
