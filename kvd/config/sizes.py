"""Byte sizes as people write them: ``512MiB``, ``4GiB``, ``1.5GiB``, ``100MB``.

Used by the settings table (every ``*_bytes`` setting) and by the CLI. Binary
units (KiB, MiB, ...) are powers of 1024 and decimal units (KB, MB, ...)
powers of 1000, as in IEC 80000-13. A bare ``K``/``M``/``G`` is refused on
purpose: tools disagree on whether it means 1000 or 1024, and a cache sized
2.4% off is a surprise nobody wants to debug.
"""

import re
from fractions import Fraction

_UNIT_BYTES: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}

# Longest accepted text; anything longer is a typo or an attack, not a size.
_MAX_TEXT_CHARS = 64

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

# format_size prints the largest binary unit that divides the value exactly.
_FORMAT_UNITS: tuple[tuple[str, int], ...] = (
    ("PiB", 1 << 50),
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
)


class SizeError(ValueError):
    """Text that is not a byte size; the message says why."""


def parse_size(text: str | int) -> int:
    """Return the number of bytes that ``text`` names.

    Accepts a non-negative int, or a string of digits (optionally with a
    fraction) followed by an optional unit. The result must be a whole
    number of bytes: ``1.5KiB`` is 1536, ``0.3KiB`` is refused.
    """
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(f"size must not be negative: {text}")
        return text
    if len(text) > _MAX_TEXT_CHARS:
        raise SizeError(f"size text longer than {_MAX_TEXT_CHARS} characters")
    match = _SIZE_RE.match(text)
    if match is None:
        raise SizeError(f"not a size: {text!r} (examples: 65536, 64KiB, 512MiB, 4GiB, 100MB)")
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _UNIT_BYTES:
        raise SizeError(
            f"unknown size unit {match.group(2)!r} in {text!r}: "
            "use B, KiB, MiB, GiB, TiB, PiB (powers of 1024) or KB, MB, GB, TB, PB (powers of 1000)"
        )
    total = Fraction(number) * _UNIT_BYTES[unit]
    if total.denominator != 1:
        raise SizeError(f"{text!r} is not a whole number of bytes")
    return int(total)


def format_size(size_bytes: int) -> str:
    """Return ``size_bytes`` in the largest binary unit that divides it exactly."""
    assert size_bytes >= 0, size_bytes
    for unit, unit_bytes in _FORMAT_UNITS:
        if size_bytes and size_bytes % unit_bytes == 0:
            return f"{size_bytes // unit_bytes}{unit}"
    return f"{size_bytes}B"
