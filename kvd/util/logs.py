"""Structured logging: one line per event, logfmt or JSON.

The daemon logs its start-up summary, errors with their reason, and
lifecycle events; never one line per request at INFO. Refused requests
(bad token, over a limit) are logged through a ``Throttle``: one line per
reason per second at most, carrying the count of those it held back, so a
misconfigured client cannot flood the log.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in record.__dict__.items():
        if key not in _RESERVED and not key.startswith("_"):
            out[key] = value
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


def _logfmt_value(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' ="\n\t'):
        return text
    return json.dumps(text)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def configure(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc's own logger speaks per connection at INFO.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))


class Throttle:
    """Lets one log line per key through per ``interval_s``; counts the rest."""

    # Distinct keys remembered; past it the table starts afresh (keys are
    # reasons, a handful, so this only bounds a bug).
    KEYS_MAX = 1024

    def __init__(self, interval_s: float = 1.0, clock: Any = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """None to hold this line back, else how many lines of ``key`` were held back."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._last) >= self.KEYS_MAX:
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)
