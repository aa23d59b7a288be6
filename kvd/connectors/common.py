"""Pieces every engine connector shares.

- ``namespace()`` builds a namespace name from everything that changes the
  bytes of a KV block (model, dtype, layout, rank, world size, salt, ...), so
  blocks of different layouts never meet (DESIGN §3).
- ``text_key()`` / ``int_key()`` turn an engine's block id (a hex digest, a
  string, an integer hash) into a kvd key of at most 64 bytes, injectively
  and the same way in every process (no ``hash()``).
- ``Guard`` runs a daemon call and turns every failure (daemon down, deadline
  passed, bad data, or a bug in the connector itself) into the caller's miss
  value, logging at most one line per ``LOG_INTERVAL_S`` per operation. An
  engine's step loop never sees an exception from kvd; it recomputes. After
  the daemon is found down or slow, calls are misses at once for
  ``RETRY_AFTER_S``: a stopped daemon costs the engine one deadline per
  window, not one per call.
- ``encode_meta()`` / ``decode_meta()``: the small JSON blob kept in a value's
  ``meta`` (shape, dtype, format), bounded by the daemon's 4 KiB.
- ``get_with_meta()`` reads a value together with its ``meta``.
- ``tls_config()`` reads a connector's TLS settings for ``Client(tls=...)``.
- ``load_groups()`` / ``get_prefix_into()``: pages straight into the engine's
  buffers, one batch per ``LOAD_BATCH_BYTES``, counting the leading hits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvd.client import Client, Tls
from kvd.wire.errors import Unavailable
from kvd.wire.limits import KEY_BYTES_MAX, META_BYTES_MAX, NAMESPACE_BYTES_MAX

log = logging.getLogger("kvd.connectors")

T = TypeVar("T")

# Bytes one batched load asks for at once: the pages an engine stages for
# it, and the daemon's copies in flight, stay bounded however long the prefix.
LOAD_BATCH_BYTES = 64 << 20
# A connector's calls sit on the engine's critical path: a lookup that takes
# longer than a prefill of a few hundred tokens (~0.5 s on a GPU) is worth
# less than recomputing, so the default deadline is short.
DEFAULT_TIMEOUT_S = 2.0
# Scheduler-side leases keep looked-up blocks in place until the worker has
# fetched them; a step takes well under a second, so 10 s covers a slow one.
DEFAULT_LEASE_MS = 10_000
# One warning per operation per this many seconds: a down daemon must not
# flood the engine's log at one line per block.
LOG_INTERVAL_S = 30.0
DEFAULT_TARGET = "127.0.0.1:7070"
# The daemon's default gRPC Unix socket (the ``socket`` setting's default; a
# test holds the two equal). Without a ``url``, a connector on the daemon's
# node uses it, and with it the shared-memory path: no setting needed.
DEFAULT_SOCKET = "/dev/shm/kvd/grpc.sock"
# After an unreachable or too-slow daemon, calls are misses without asking
# for this long. One engine step makes 3-4 calls (lookup, load, save,
# release); at a 2 s deadline each, a stopped daemon would otherwise add
# 6-8 s to every step. 2 s is about one recompute of a 1K-token prompt on
# a CPU, so a daemon that comes back is used again within a request or two.
RETRY_AFTER_S = 2.0

_KEY_TAG_HEX = b"\x01"
_KEY_TAG_TEXT = b"\x02"
_KEY_TAG_DIGEST = b"\x03"
_KEY_TAG_INT = b"\x04"
_UNSAFE = set("/=%@")


def _escape(value: str) -> str:
    out = []
    for ch in value:
        if ch in _UNSAFE or not ch.isprintable() or ch.isspace():
            out.append("".join(f"%{b:02X}" for b in ch.encode()))
        else:
            out.append(ch)
    return "".join(out)


def namespace(engine: str, fields: Mapping[str, object]) -> str:
    """``engine/k=v/k=v...`` in the given order, escaped; hashed down when too long.

    Every field separates: two field sets that differ in any value give
    different names (values are escaped, so no value can fake a separator).
    """
    parts = [_escape(engine)]
    for name, value in fields.items():
        parts.append(f"{_escape(name)}={_escape(str(value))}")
    full = "/".join(parts)
    if len(full.encode()) <= NAMESPACE_BYTES_MAX:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:32]
    head = full.encode()[: NAMESPACE_BYTES_MAX - len(digest) - 1].decode(errors="ignore")
    return f"{head}#{digest}"


def text_key(value: str) -> bytes:
    """A kvd key for an engine's string block id (hex digests stay compact)."""
    if value and len(value) % 2 == 0 and len(value) // 2 < KEY_BYTES_MAX:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if raw and raw.hex() == value:
            return _KEY_TAG_HEX + raw
    encoded = value.encode()
    if len(encoded) < KEY_BYTES_MAX:
        return _KEY_TAG_TEXT + encoded
    return _KEY_TAG_DIGEST + hashlib.sha256(encoded).digest()


def int_key(value: int, suffix: bytes = b"") -> bytes:
    """A kvd key for an integer block hash of any sign and size."""
    length = max(1, (value.bit_length() + 8) // 8)
    body = value.to_bytes(length, "big", signed=True) + suffix
    if len(body) < KEY_BYTES_MAX:
        return _KEY_TAG_INT + body
    return _KEY_TAG_DIGEST + hashlib.sha256(body).digest()


def bytes_key(value: bytes) -> bytes:
    """A kvd key for an engine's binary block hash (vLLM's 32-byte digests)."""
    if 0 < len(value) <= KEY_BYTES_MAX:
        return value
    return hashlib.sha256(value).digest()


def default_target(socket_path: str = DEFAULT_SOCKET) -> str:
    """The daemon's default Unix socket when it is there, else its default TCP address."""
    try:
        if stat.S_ISSOCK(os.stat(socket_path).st_mode):
            return "unix://" + socket_path
    except OSError:
        pass
    return DEFAULT_TARGET


def parse_target(url: str | None) -> str:
    """``kvd://host:port``, ``host:port``, ``kvd:///a.sock``, ``unix:///a.sock`` → a
    target; none: ``default_target()``."""
    if not url:
        return default_target()
    if url.startswith("unix://"):
        return url
    if url.startswith("kvd://"):
        rest = url[len("kvd://") :]
        if rest.startswith("/"):
            return "unix://" + rest
        return rest.split("?", 1)[0].rstrip("/") or DEFAULT_TARGET
    if "://" in url:
        raise ValueError(f"not a kvd address: {url!r}")
    return url


def encode_meta(fields: Mapping[str, Any]) -> bytes:
    blob = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    if len(blob) > META_BYTES_MAX:
        raise ValueError(f"meta of {len(blob)} bytes is over {META_BYTES_MAX}")
    return blob


def decode_meta(blob: bytes) -> dict[str, Any] | None:
    """The meta dict, or None when it is missing or not ours (a miss, never a guess)."""
    if not blob or len(blob) > META_BYTES_MAX:
        return None
    try:
        value = json.loads(blob)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def get_with_meta(client: Client, ns: str, key: bytes) -> tuple[bytes, bytes] | None:
    """(value, meta) of one key, or None on a miss; checksums checked."""
    return client.get_with_meta(ns, key)


def get_many_with_meta(
    client: Client, ns: str, keys: Sequence[bytes]
) -> list[tuple[bytes, bytes] | None]:
    """``get_with_meta`` for several keys: small values in one BatchGet."""
    return client.get_many_with_meta(ns, keys)


@dataclass
class GuardStats:
    calls: int = 0
    failures: int = 0


class Guard:
    """Runs daemon calls; any exception becomes the caller's miss value.

    Catches ``Exception`` on purpose, not only ``KvdError``: the engine's step
    loop must never stop because of the cache (a miss costs a recompute, an
    exception costs the whole batch). Failures are counted and logged at most
    once per ``LOG_INTERVAL_S`` per operation name.
    """

    def __init__(
        self,
        component: str,
        log_interval_s: float = LOG_INTERVAL_S,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self.component = component
        self.log_interval_s = log_interval_s
        self.retry_after_s = retry_after_s
        self.stats: dict[str, GuardStats] = {}
        self.skipped = 0  # of the failures, calls not made: the daemon was down
        self._last_log_s: dict[str, float] = {}
        self._down_until_s = 0.0
        self._lock = threading.Lock()

    def call(self, op: str, default: T, fn: Callable[[], T]) -> T:
        with self._lock:
            stats = self.stats.setdefault(op, GuardStats())
            stats.calls += 1
            if time.monotonic() < self._down_until_s:
                stats.failures += 1  # a miss for the daemon's sake, as a failed call is
                self.skipped += 1
                return default
        try:
            return fn()
        except Exception as exc:
            self.failed(op, exc)
            return default

    def down(self) -> bool:
        """Whether calls are being skipped because the daemon was found down."""
        with self._lock:
            return time.monotonic() < self._down_until_s

    def failed(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            stats = self.stats.setdefault(op, GuardStats())
            stats.failures += 1
            # Down or slow (not a bad answer to one call): stop asking for a while.
            if isinstance(exc, Unavailable | OSError | TimeoutError):
                self._down_until_s = now + self.retry_after_s
            last = self._last_log_s.get(op)
            if last is not None and now - last < self.log_interval_s:
                return
            self._last_log_s[op] = now
            failures = stats.failures
        log.warning(
            "kvd %s %s failed, treated as a miss (%d failures so far): %s: %s",
            self.component,
            op,
            failures,
            type(exc).__name__,
            exc,
        )

    def failures(self, op: str | None = None) -> int:
        with self._lock:
            if op is not None:
                return self.stats.get(op, GuardStats()).failures
            return sum(s.failures for s in self.stats.values())


def prefix_hits(found: Sequence[bool]) -> int:
    """Number of leading True values."""
    for i, hit in enumerate(found):
        if not hit:
            return i
    return len(found)


def config_value(config: Mapping[str, Any] | None, name: str, default: T) -> T:
    """``config[name]`` converted to the type of ``default``, or ``default``."""
    if not config or name not in config or config[name] is None:
        return default
    value = config[name]
    if isinstance(default, bool):
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
        return bool(value)  # type: ignore[return-value]
    if isinstance(default, int):
        return int(value)  # type: ignore[return-value]
    if isinstance(default, float):
        return float(value)  # type: ignore[return-value]
    return str(value)  # type: ignore[return-value]


def load_groups(sizes: Sequence[int], limit: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, end)`` runs of consecutive items of at most ``limit`` bytes
    together (default ``LOAD_BATCH_BYTES``; a larger item forms a run alone)."""
    limit = LOAD_BATCH_BYTES if limit is None else limit
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            yield start, i
            start, total = i, 0
        total += size
    if start < len(sizes):
        yield start, len(sizes)


def get_prefix_into(
    client: Client, ns: str, keys: Sequence[bytes], views: Sequence[memoryview]
) -> int:
    """Read ``keys`` into ``views`` (one batch); how many leading keys hit. A
    stored value whose size is not its view's is an error, never a hit."""
    hits = 0
    for key, size, view in zip(keys, client.get_many_into(ns, keys, views), views, strict=True):
        if size is None:
            break
        if size != len(view):
            raise ValueError(f"{key!r}: {size} bytes stored, {len(view)} expected")
        hits += 1
    return hits


def tls_config(get: Callable[[str, Any], Any]) -> Tls | None:
    """A connector's TLS settings, read with ``get(name, default)``: ``tls``
    (true: TLS with the system's CA roots), ``tls_ca_file``, ``tls_cert_file``
    and ``tls_key_file`` (either file set turns TLS on); None without them."""
    files = {name: get(f"tls_{name}", "") or None for name in ("ca_file", "cert_file", "key_file")}
    if not get("tls", False) and not any(files.values()):
        return None
    return Tls(**files)
