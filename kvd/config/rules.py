"""Rules the settings table checks single values against: addresses, paths,
socket groups, fault specs (``kvd.config.io_faults``: the grammar without the
injector), pool specs, and the start-up warning on L2's size. The rules that
tie several settings together take a whole ``Config`` and live with it
(``kvd.config.settings``). Imports no daemon layer.
"""

from __future__ import annotations

import os
import re

from kvd.config.addresses import parse_address
from kvd.config.io_faults import parse as parse_fault_spec
from kvd.config.pool_members import parse_spec
from kvd.config.sizes import format_size

# sun_path in struct sockaddr_un is 108 bytes on Linux, one of them the NUL.
UNIX_SOCKET_PATH_MAX_BYTES = 107

KiB = 1 << 10


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


def check_patterns(value: object) -> None:
    assert isinstance(value, tuple)
    if any(not pattern for pattern in value):
        raise ValueError("contains an empty pattern")


def check_io_faults(value: object) -> None:
    parse_fault_spec(str(value))


def check_pool_members(value: object) -> None:
    parse_spec(str(value))


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
