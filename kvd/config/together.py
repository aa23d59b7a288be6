"""Rules that tie several settings together, checked by ``load_config``
once every setting passed its own (``Config.__post_init__``)."""

from __future__ import annotations

from kvd.config.addresses import is_loopback_host, parse_address
from kvd.config.setting import ConfigError
from kvd.config.settings import Config
from kvd.config.sizes import format_size


def validate_together(config: Config) -> None:
    """Rules that tie several settings together."""
    if config.ssd_path:
        _validate_l2(config)
    if config.max_value_bytes > config.dram_bytes:
        raise ConfigError(
            f"max_value_bytes: {format_size(config.max_value_bytes)} does not fit in "
            f"dram_bytes {format_size(config.dram_bytes)} (every value passes through L1): "
            "lower max_value_bytes or raise dram_bytes",
            key="max_value_bytes",
        )
    if config.max_message_bytes > config.max_inflight_bytes:
        raise ConfigError(
            f"max_message_bytes: {format_size(config.max_message_bytes)} is more than "
            f"max_inflight_bytes {format_size(config.max_inflight_bytes)}: "
            "lower max_message_bytes or raise max_inflight_bytes",
            key="max_message_bytes",
        )
    _validate_tls(config)
    _validate_pool_tls(config)
    _validate_etcd_tls(config)
    if config.pool_members and config.auth_tokens_file and not config.pool_token_file:
        raise ConfigError(
            "pool_token_file: with auth_tokens_file, peers refuse calls without a token; "
            "give the pool a token file (admitted to every namespace by each member)",
            key="pool_token_file",
        )
    if config.auth_tokens_file:
        return  # every request carries a checked token: any address may listen
    # Without auth any reachable TCP listener would serve anyone.
    if config.bulk_listen:
        _loopback_only("bulk_listen", config.bulk_listen, "or leave it empty")
    _loopback_only("listen", config.listen, "or the unix socket")


def _loopback_only(setting: str, address: str, otherwise: str) -> None:
    host, _ = parse_address(address)
    if not is_loopback_host(host):
        raise ConfigError(
            f"{setting}: refusing to listen on {address} without auth; "
            f"set auth_tokens_file, use a loopback address (127.0.0.1) {otherwise}",
            key=setting,
        )


def _validate_tls(config: Config) -> None:
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        raise ConfigError(
            "tls_cert_file: TLS needs both tls_cert_file and tls_key_file", key="tls_cert_file"
        )
    if config.bulk_tls and not config.tls_cert_file:
        raise ConfigError(
            "bulk_tls: the bulk port's TLS uses the gRPC listener's certificate: set "
            "tls_cert_file and tls_key_file",
            key="bulk_tls",
        )
    if config.bulk_tls and not config.bulk_listen:
        raise ConfigError("bulk_tls: there is no bulk port (bulk_listen is empty)", key="bulk_tls")
    if config.tls_client_ca_file and not config.tls_cert_file:
        raise ConfigError(
            "tls_client_ca_file: client certificates need TLS: set tls_cert_file and tls_key_file",
            key="tls_client_ca_file",
        )


def _validate_pool_tls(config: Config) -> None:
    if config.pool_tls_server_name and not config.pool_tls_ca_file:
        raise ConfigError(
            "pool_tls_server_name: names the members' certificates: set pool_tls_ca_file too",
            key="pool_tls_server_name",
        )
    if config.pool_tls_ca_file and not config.pool_members:
        raise ConfigError(
            "pool_tls_ca_file: is for the calls between pool members: set pool_members",
            key="pool_tls_ca_file",
        )
    if not config.pool_members:
        return
    if config.tls_cert_file and not config.pool_tls_ca_file:
        raise ConfigError(
            "pool_tls_ca_file: with tls_cert_file the members' listeners take TLS only: "
            "give the CA bundle that signs their certificates",
            key="pool_tls_ca_file",
        )
    if config.pool_tls_ca_file and not config.tls_cert_file:
        raise ConfigError(
            "pool_tls_ca_file: a member with TLS serves it too: set tls_cert_file and "
            "tls_key_file (its certificate, signed by that CA)",
            key="pool_tls_ca_file",
        )
    if config.pool_tls_ca_file and config.pool_peer_transport == "nixl":
        raise ConfigError(
            "pool_peer_transport: nixl carries values in clear; with pool_tls_ca_file "
            "members read each other's values over the bulk port with TLS (bulk_tls) or "
            "over gRPC (auto, bulk or grpc)",
            key="pool_peer_transport",
        )


def _validate_etcd_tls(config: Config) -> None:
    cert, key, ca = config.pool_etcd_cert_file, config.pool_etcd_key_file, config.pool_etcd_ca_file
    if bool(cert) != bool(key):
        raise ConfigError(
            "pool_etcd_cert_file: a client certificate for etcd needs both "
            "pool_etcd_cert_file and pool_etcd_key_file",
            key="pool_etcd_cert_file",
        )
    if cert and not ca:
        raise ConfigError(
            "pool_etcd_ca_file: a client certificate for etcd goes over TLS: give the CA "
            "bundle that signs etcd's certificate",
            key="pool_etcd_ca_file",
        )
    if ca and not config.pool_members.startswith("etcd://"):
        raise ConfigError(
            "pool_etcd_ca_file: is for an etcd membership: pool_members must be etcd://...",
            key="pool_etcd_ca_file",
        )


def _validate_l2(config: Config) -> None:
    page = 64 << 10
    for name in ("ssd_segment_bytes", "ssd_stripe_bytes"):
        if getattr(config, name) % page:
            raise ConfigError(f"{name}: must be a multiple of 64KiB", key=name)
    if config.ssd_segment_bytes % config.ssd_stripe_bytes:
        raise ConfigError(
            "ssd_segment_bytes: must be a multiple of ssd_stripe_bytes", key="ssd_segment_bytes"
        )
    if config.ssd_bytes < 2 * config.ssd_segment_bytes:
        raise ConfigError(
            f"ssd_bytes: {format_size(config.ssd_bytes)} holds fewer than 2 segments of "
            f"{format_size(config.ssd_segment_bytes)}: raise ssd_bytes or lower ssd_segment_bytes",
            key="ssd_bytes",
        )
    # A record is a header (<= 8 KiB) plus the value, padded to 64 KiB, and must
    # fit in a segment after the segment's own 64 KiB marker record.
    segment_room = config.ssd_segment_bytes * len(config.ssd_path) - 2 * page
    if config.max_value_bytes > segment_room:
        raise ConfigError(
            f"max_value_bytes: {format_size(config.max_value_bytes)} does not fit in an L2 "
            f"segment ({format_size(config.ssd_segment_bytes)} x {len(config.ssd_path)} paths): "
            "raise ssd_segment_bytes or lower max_value_bytes",
            key="max_value_bytes",
        )
