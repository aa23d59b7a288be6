"""One row of the settings table (``kvd.config.settings``): a setting's derived names
(environment variable, flag), how its values are shown and written as TOML,
and how a value from a file, the environment or a flag is converted and
checked against the row's type and bounds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd.config.sizes import format_size, parse_size


class ConfigError(Exception):
    """A setting is unknown, malformed or out of bounds; the message names it."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


ENV_PREFIX = "KVD_"


@dataclass(frozen=True)
class Setting:
    """One row of the table, derived from a :class:`Config` field."""

    name: str
    kind: str  # "str", "int", "size", "bool", "float" or "list"
    default: Any
    help: str
    min: int | None
    max: int | None
    choices: tuple[str, ...] | None
    octal: bool
    check: Callable[[object], None] | None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def show(self, value: Any) -> str | int:
        if self.kind == "size":
            return format_size(value)
        if self.octal:
            return f"0o{value:o}"
        if self.kind == "list":
            return ",".join(value)
        if isinstance(value, str | int):
            return value
        return str(value)

    def toml(self, value: Any) -> str:
        if self.kind == "size":
            return json.dumps(format_size(value))
        if self.octal:
            return f"0o{value:o}"
        if self.kind == "bool":
            return "true" if value else "false"
        # JSON strings and arrays of strings are valid TOML.
        return json.dumps(list(value) if self.kind == "list" else value)

    def bounds(self) -> str:
        if self.choices is not None:
            return ", ".join(self.choices)
        if self.min is None and self.max is None:
            return ""
        low = "" if self.min is None else self.format_bound(self.min)
        high = "" if self.max is None else self.format_bound(self.max)
        suffix = " items" if self.kind == "list" else ""
        return f"{low}..{high}{suffix}"

    def format_bound(self, number: int) -> str:
        if self.kind == "size":
            return format_size(number)
        if self.octal and number:
            return f"0o{number:o}"
        return str(number)


def kind_of(name: str, annotation: object) -> str:
    if annotation == tuple[str, ...]:
        return "list"
    if annotation is int:
        # A size, or a rate in bytes a second: both read "256MiB".
        return "size" if name.endswith(("_bytes", "_bytes_per_s")) else "int"
    for kind, python_type in (("str", str), ("bool", bool), ("float", float)):
        if annotation is python_type:
            return kind
    raise AssertionError(f"setting {name}: unsupported type {annotation!r}")


_TRUE_TEXT = frozenset({"1", "true", "yes", "on"})
_FALSE_TEXT = frozenset({"0", "false", "no", "off"})


def from_text(setting: Setting, text: str) -> object:
    """Parse a value given as text (environment variable, flag, TOML string)."""
    kind = setting.kind
    if kind == "str":
        return text
    if kind == "size":
        return parse_size(text)
    if kind == "int":
        if setting.octal:
            return int(text.removeprefix("0o"), 8)
        return int(text, 10)
    if kind == "bool":
        lowered = text.strip().lower()
        if lowered in _TRUE_TEXT | _FALSE_TEXT:
            return lowered in _TRUE_TEXT
        raise ValueError(f"{text!r} is not a boolean (true/false)")
    if kind == "float":
        number = float(text)
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(f"{text!r} is not a finite number")
        return number
    assert kind == "list", kind
    return tuple(item.strip() for item in re.split(r"[,:]", text) if item.strip())


def convert(setting: Setting, raw: object) -> object:
    """Turn a raw value (TOML value, text, list of flag values) into the setting's type."""
    if isinstance(raw, str):
        return from_text(setting, raw)
    kind = setting.kind
    if kind == "list" and isinstance(raw, list | tuple):
        if not all(isinstance(item, str) for item in raw):
            raise ValueError("expected a list of strings")
        return tuple(raw)
    if kind in ("int", "size") and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind == "float" and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if kind == "bool" and isinstance(raw, bool):
        return raw
    raise ValueError(f"expected {_KIND_NAMES[kind]}, got {type(raw).__name__} {raw!r}")


_KIND_NAMES = {
    "str": "a string",
    "int": "an integer",
    "size": "a size such as 65536, 512MiB or 4GiB",
    "bool": "true or false",
    "float": "a number",
    "list": "a list of strings",
}


def _has_type(kind: str, value: object) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind in ("int", "size"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "float":
        return isinstance(value, float)
    assert kind == "list", kind
    return isinstance(value, tuple) and all(isinstance(item, str) for item in value)


def validate(setting: Setting, value: object) -> None:
    """Check one value against its row of the table; raise ConfigError naming it."""
    name = setting.name
    if not _has_type(setting.kind, value):
        raise ConfigError(f"{name}: expected {_KIND_NAMES[setting.kind]}, got {value!r}", key=name)
    if setting.kind == "list":
        assert isinstance(value, tuple)
        count = len(value)
        if setting.min is not None and count < setting.min:
            raise ConfigError(f"{name}: needs at least {setting.min} item(s)", key=name)
        if setting.max is not None and count > setting.max:
            raise ConfigError(f"{name}: at most {setting.max} items, got {count}", key=name)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if setting.min is not None and value < setting.min:
            low = setting.format_bound(setting.min)
            raise ConfigError(f"{name}: {setting.show(value)} is below the minimum {low}", key=name)
        if setting.max is not None and value > setting.max:
            high = setting.format_bound(setting.max)
            raise ConfigError(
                f"{name}: {setting.show(value)} is above the maximum {high}", key=name
            )
    if setting.choices is not None and value not in setting.choices:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(setting.choices)}", key=name)
    if setting.check is not None:
        try:
            setting.check(value)
        except ValueError as error:
            raise ConfigError(f"{name}: {error}", key=name) from None
