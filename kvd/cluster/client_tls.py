"""A gRPC client's TLS: the CA bundle it checks the server's certificate
against, the client certificate and key it presents where the server asks
for one, and the name the server's certificate carries where it is not the
host's. The calls to the pool's members (``kvd.cluster.peer_tls``) and to
etcd (``kvd.cluster.etcd_tls``) are opened with it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvd.config.pem import Named, read_tls_files


@dataclass(frozen=True)
class ClientTls:
    """The files' contents; no client certificate where ``cert`` is empty."""

    ca: bytes
    cert: bytes = b""
    key: bytes = b""
    server_name: str = ""  # the name the servers' certificates carry; "": each host's

    @classmethod
    def read(cls, ca: Named, cert: Named, key: Named, server_name: str = "") -> ClientTls:
        """The files, checked as a TLS client uses them (ConfigError naming
        the setting of one that does not parse); a certificate and key of
        path "": none."""
        files = read_tls_files(cert, key, ca, server=False)  # once, and those bytes checked
        return cls(files.ca, files.cert, files.key, server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.key or None,
            certificate_chain=self.cert or None,
        )

    def options(self) -> list[tuple[str, str]]:
        """The channel options that name the certificates' name, where set."""
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]
