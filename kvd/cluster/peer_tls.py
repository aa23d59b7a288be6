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

from kvd.cluster.client_tls import ClientTls
from kvd.config.settings import Config


def peer_tls(config: Config) -> ClientTls | None:
    """The files ``config`` names, checked; None without ``pool_tls_ca_file``."""
    if not config.pool_tls_ca_file:
        return None
    return ClientTls.read(
        (config.pool_tls_ca_file, "pool_tls_ca_file"),
        (config.tls_cert_file, "tls_cert_file"),
        (config.tls_key_file, "tls_key_file"),
        config.pool_tls_server_name,
    )
