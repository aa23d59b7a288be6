"""TLS between the pool's members (``pool_tls_ca_file``).

With it, a member calls the others over gRPC with TLS: it checks each
member's certificate against the pool's CA (and the name in it against the
member's host, or ``pool_tls_server_name``), and presents its own
``tls_cert_file`` as its client certificate, which a member whose listener
asks for one (``tls_client_ca_file``, mTLS) checks in turn. The bulk port
and NIXL carry values in clear, so members with TLS do not use them with
each other (``pool_peer_transport`` is gRPC).

The files are read at start and again on SIGHUP (``reload``): calls after a
reload open new channels with the new files; a reload that fails keeps the
old ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvd.config.pem import check_pem, read_pem
from kvd.config.settings import Config


@dataclass(frozen=True)
class PeerTls:
    """What a member's channels to the others are opened with."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str  # the name the members' certificates carry; "": each member's host

    @classmethod
    def from_config(cls, config: Config) -> PeerTls | None:
        """The files ``config`` names, checked; None without ``pool_tls_ca_file``."""
        if not config.pool_tls_ca_file:
            return None
        ca_file = config.pool_tls_ca_file
        check_pem(config.tls_cert_file, config.tls_key_file, ca_file, "pool_tls_ca_file",
                  server=False)  # fmt: skip
        return cls(
            read_pem(ca_file, "pool_tls_ca_file"),
            read_pem(config.tls_cert_file, "tls_cert_file"),
            read_pem(config.tls_key_file, "tls_key_file"),
            config.pool_tls_server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def options(self) -> list[tuple[str, str]]:
        """The channel options that name the certificates' name, where set."""
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]
