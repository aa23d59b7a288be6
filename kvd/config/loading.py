"""Loading the configuration: defaults < TOML file < ``KVD_*`` environment
< flags, each value converted and checked against its row of the settings
table (``kvd.config.settings``), an unknown key or variable refused with a
close match named."""

import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from kvd.config.setting import ENV_PREFIX, ConfigError, convert
from kvd.config.settings import SETTINGS, SETTINGS_BY_NAME, Config
from kvd.config.sizes import SizeError, format_size
from kvd.config.together import validate_together

# KVD_* variables read by something other than the settings table: the config
# file path for `kvd serve`, the default target and token of the client commands.
ENV_NOT_SETTINGS = frozenset({"KVD_CONFIG", "KVD_TARGET", "KVD_TOKEN"})

# A config file is a few hundred bytes; refusing more than 1 MiB keeps a wrong
# path (a log, a disk image) from being read into memory.
CONFIG_FILE_MAX_BYTES = 1 << 20


def _unknown(key: str, where: str, known: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"{key}: unknown setting in {where}{hint}", key=key)


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            data = file.read(CONFIG_FILE_MAX_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    if len(data) > CONFIG_FILE_MAX_BYTES:
        raise ConfigError(f"config file {path} is larger than {format_size(CONFIG_FILE_MAX_BYTES)}")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Build the Config from defaults < TOML file < ``KVD_*`` environment < overrides.

    ``overrides`` maps setting names to values (flags give text, or a list of
    text for repeatable ones); a value of None means "not given".
    """
    raw: dict[str, tuple[object, str]] = {}
    names = list(SETTINGS_BY_NAME)
    if path:
        for key, value in _read_file(path).items():
            if key not in SETTINGS_BY_NAME:
                raise _unknown(key, f"config file {path}", names)
            raw[key] = (value, f"config file {path}")
    for variable, text in sorted((env or {}).items()):
        if not variable.startswith(ENV_PREFIX) or variable in ENV_NOT_SETTINGS:
            continue
        name = variable[len(ENV_PREFIX) :].lower()
        if name not in SETTINGS_BY_NAME or variable != SETTINGS_BY_NAME[name].env:
            envs = [setting.env for setting in SETTINGS]
            raise _unknown(variable, "the environment", envs)
        raw[name] = (text, f"environment {variable}")
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in SETTINGS_BY_NAME:
            raise _unknown(name, "overrides", names)
        raw[name] = (value, f"flag {SETTINGS_BY_NAME[name].flag}")

    values: dict[str, object] = {}
    for name, (value, source) in raw.items():
        try:
            values[name] = convert(SETTINGS_BY_NAME[name], value)
        except (ValueError, SizeError) as error:
            raise ConfigError(f"{name}: {error} (from {source})", key=name) from None
    try:
        config = Config(**values)  # type: ignore[arg-type]  # checked against the table
        validate_together(config)
        return config
    except ConfigError as error:
        # Name where each setting the message mentions came from, if not a default.
        given = [f"{name} from {raw[name][1]}" for name in raw if name in str(error)]
        if not given:
            raise
        raise ConfigError(f"{error} ({'; '.join(given)})", key=error.key) from None


def config_from_environment(
    path: str | None = None, overrides: Mapping[str, object] | None = None
) -> Config:
    """load_config with this process's environment; ``KVD_CONFIG`` names the file."""
    return load_config(path or os.environ.get("KVD_CONFIG"), os.environ, overrides)
