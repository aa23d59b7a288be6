"""Rules the settings table checks values against: addresses, paths,
socket groups, fault specs, and the rules that tie several settings together
(L2 geometry, TLS files, what may listen beyond loopback).
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import TYPE_CHECKING

from kvd.config.sizes import format_size

if TYPE_CHECKING:
    from kvd.config.settings import Config

# sun_path in struct sockaddr_un is 108 bytes on Linux, one of them the NUL.
UNIX_SOCKET_PATH_MAX_BYTES = 107

KiB = 1 << 10


class ConfigError(Exception):
    """A setting is unknown, malformed or out of bounds; the message names it."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def parse_address(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[IPV6]:PORT``; port 0 asks the kernel for one."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, as [::1]:7070")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{text!r}: port {port} is above 65535")
    if not host:
        raise ValueError(f"{text!r} has no host")
    return host, port


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback IPs; any other name could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(value: object) -> None:
    assert isinstance(value, str)
    parse_address(value)


def check_address_or_empty(value: object) -> None:
    assert isinstance(value, str)
    if value:
        parse_address(value)


def check_socket_path(value: object) -> None:
    assert isinstance(value, str)
    if len(os.fsencode(value)) > UNIX_SOCKET_PATH_MAX_BYTES:
        raise ValueError(f"unix socket path longer than {UNIX_SOCKET_PATH_MAX_BYTES} bytes")


def check_group(value: object) -> None:
    assert isinstance(value, str)
    if value and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}", value):
        raise ValueError(f"{value!r} is not a group name or number")


def check_nonempty(value: object) -> None:
    assert isinstance(value, str)
    if not value:
        raise ValueError("must not be empty")


def check_paths(value: object) -> None:
    assert isinstance(value, tuple)
    if any(not path for path in value):
        raise ValueError("contains an empty path")
    if len(set(value)) != len(value):
        raise ValueError("lists a path twice")


def check_io_faults(value: object) -> None:
    from kvd.io.faults import parse  # the grammar lives with the injector

    parse(str(value))


def check_pool_members(value: object) -> None:
    from kvd.cluster.spec import parse_spec  # the grammar lives with the pool

    parse_spec(str(value))


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
    if config.pool_members and config.tls_cert_file:
        raise ConfigError(
            "pool_members: peers call each other over plaintext gRPC for now; "
            "a pool with tls_cert_file is not supported yet",
            key="pool_members",
        )
    if config.pool_members and config.auth_tokens_file and not config.pool_token_file:
        raise ConfigError(
            "pool_token_file: with auth_tokens_file, peers refuse calls without a token; "
            "give the pool a token file (admitted to every namespace by each member)",
            key="pool_token_file",
        )
    if config.auth_tokens_file:
        return  # every request carries a checked token: any address may listen
    if config.bulk_listen:
        bulk_host, _ = parse_address(config.bulk_listen)
        if not is_loopback_host(bulk_host):
            raise ConfigError(
                f"bulk_listen: refusing to listen on {config.bulk_listen} without auth; "
                "set auth_tokens_file, use a loopback address (127.0.0.1) or leave it empty",
                key="bulk_listen",
            )
    host, _ = parse_address(config.listen)
    if not is_loopback_host(host):
        # Without auth any reachable TCP listener would serve anyone.
        raise ConfigError(
            f"listen: refusing to listen on {config.listen} without auth; "
            "set auth_tokens_file, or use a loopback address (127.0.0.1) or the unix socket",
            key="listen",
        )


def _validate_tls(config: Config) -> None:
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        raise ConfigError(
            "tls_cert_file: TLS needs both tls_cert_file and tls_key_file", key="tls_cert_file"
        )
    if config.tls_client_ca_file and not config.tls_cert_file:
        raise ConfigError(
            "tls_client_ca_file: client certificates need TLS: set tls_cert_file and tls_key_file",
            key="tls_client_ca_file",
        )


def _validate_l2(config: Config) -> None:
    page = 64 * KiB
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


def l2_capacity_warning(
    dram_bytes: int, l2_capacity_bytes: int, logical_segment_bytes: int
) -> str | None:
    """A start-up warning when L2 cannot keep what L1 holds, else None.

    L2 keeps at most its capacity less one segment (the one being filled
    again after a reclaim); when that is below ``dram_bytes``, reclaim keeps
    meeting values still in L1. They are rewritten only within write-back's
    rewrite credit (L2 writes stay within 1.5x the bytes put); the others
    live in L1 only and do not survive a restart. Not refused: the daemon
    works, its L2 is just too small to help.
    """
    keeps = l2_capacity_bytes - logical_segment_bytes
    if keeps >= dram_bytes:
        return None
    return (
        f"L2 holds less than L1: ssd_bytes gives {format_size(l2_capacity_bytes)} of L2, which "
        f"keeps {format_size(max(0, keeps))} between reclaims (one "
        f"{format_size(logical_segment_bytes)} segment is refilled), below dram_bytes "
        f"{format_size(dram_bytes)}: values beyond it live in L1 only and are lost on restart; "
        "raise ssd_bytes above dram_bytes plus one segment"
    )
