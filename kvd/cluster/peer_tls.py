"""TLS between the pool's members (``pool_tls_ca_file``).

With it, a member calls the others over gRPC with TLS: it checks each
member's certificate against the pool's CA (and the name in it against the
member's host, or ``pool_tls_server_name``), and presents its own
``tls_cert_file`` as its client certificate, which a member whose listener
asks for one (``tls_client_ca_file``, mTLS) checks in turn. A member whose
bulk port takes TLS (``bulk_tls``) is read there, over TLS with the same
files (``peer_bulk_tls``); one whose bulk port is in clear, over gRPC.
NIXL carries values in clear: members with TLS do not use it.

The files are read at start and again on SIGHUP (``reload``), once each
time, gRPC's and the bulk port's TLS made from the same bytes: calls after a
reload open new channels with the new files; a reload that fails keeps the
old ones.
"""

from __future__ import annotations

import ssl

from kvd.cluster.client_tls import ClientTls
from kvd.cluster.peer_bulk import BulkTls
from kvd.config.setting import ConfigError
from kvd.config.settings import Config
from kvd.wire.tls_socket import client_context


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


def peer_bulk_tls(tls: ClientTls | None) -> BulkTls | None:
    """The TLS of this member's connections to the others' bulk ports, from
    the files ``peer_tls`` read and checked (the same bytes); None without
    them (no ``pool_tls_ca_file``)."""
    if tls is None:
        return None
    try:
        context = client_context(tls.ca, tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"pool_tls_ca_file: the TLS files do not load: {exc}", key="pool_tls_ca_file"
        ) from None
    return BulkTls(context, tls.server_name)
