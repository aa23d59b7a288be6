"""Bearer-token auth: which namespaces a token reaches, checked on every path.

The token table is a TOML file named by ``auth_tokens_file`` and re-read on
SIGHUP. It holds sha256 digests, never tokens, so the file (a Kubernetes
Secret, a root-only file) does not hand out credentials when it leaks::

    admin_sha256 = ["<hex sha256 of the admin token>"]

    [[tokens]]
    name = "team-a"                       # shown in logs
    sha256 = "<hex sha256 of the token>"
    namespaces = ["llama3-8b/team-a", "team-a/*"]   # exact, or prefix then *

A request's token is hashed and compared with every digest in the table
(``hmac.compare_digest``, no early exit), so the time taken does not depend
on which digest, or how much of one, matched. Admin tokens reach every
namespace and the admin calls (Delete of a whole namespace, Stats of the
whole daemon). The gRPC paths carry the token as ``authorization: Bearer
<token>`` metadata, the bulk TCP port in its HELLO frame, once per
connection; health and reflection stay open. What only gRPC calls need (a
call's context, the namespace a protobuf request names) is
``kvd.paths.grpc.auth``'s; this module imports no protobuf.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvd.config.settings import ConfigError
from kvd.util.namespaces import matches
from kvd.wire.errors import PermissionDenied, Unauthenticated

log = logging.getLogger("kvd.paths.auth")

# A token table is a few KiB; 1 MiB stops a wrong path being read in full.
TOKENS_FILE_MAX_BYTES = 1 << 20
# Each request compares its digest with every entry (~0.1 µs each): 4096
# entries bound that at ~0.4 ms.
TOKENS_MAX = 4096
PATTERNS_PER_TOKEN_MAX = 1024
# Bearer tokens longer than this are refused before hashing (the bulk HELLO
# frame carries at most 4 KiB too).
TOKEN_BYTES_MAX = 4096
_HEX_SHA256 = re.compile(r"[0-9a-f]{64}")
_BEARER = "bearer "


def hash_token(token: str) -> str:
    """The hex sha256 of a token, as the token table stores it."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token: 32 bytes (256 bits) from the OS, URL-safe text."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to and what it may reach."""

    name: str
    admin: bool
    patterns: tuple[str, ...] = ()

    def allows(self, namespace: str) -> bool:
        return self.admin or matches(self.patterns, namespace)


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class TokenTable:
    """The parsed token file."""

    def __init__(self, entries: Iterable[_Entry]) -> None:
        self.entries = tuple(entries)
        assert len(self.entries) <= TOKENS_MAX

    def identify(self, token: str) -> Principal | None:
        """The principal whose digest matches ``token``; compares against every entry."""
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for entry in self.entries:
            if hmac.compare_digest(digest, entry.digest) and found is None:
                found = entry.principal
        return found

    @classmethod
    def load(cls, path: str) -> TokenTable:
        """Read and check a token file; ConfigError names what is wrong."""
        try:
            with open(path, "rb") as file:
                data = file.read(TOKENS_FILE_MAX_BYTES + 1)
        except OSError as error:
            raise ConfigError(
                f"auth_tokens_file: cannot read {path}: {error.strerror}", key="auth_tokens_file"
            ) from None
        if len(data) > TOKENS_FILE_MAX_BYTES:
            raise _error(path, f"larger than {TOKENS_FILE_MAX_BYTES} bytes")
        try:
            table = tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise _error(path, f"not valid TOML: {error}") from None
        return cls(_parse(path, table))


def _error(path: str, message: str) -> ConfigError:
    return ConfigError(f"auth_tokens_file: {path}: {message}", key="auth_tokens_file")


def _digest(path: str, where: str, value: object) -> bytes:
    if not isinstance(value, str) or not _HEX_SHA256.fullmatch(value.lower()):
        raise _error(path, f"{where}: expected 64 hex digits (sha256 of the token)")
    return bytes.fromhex(value)


def _parse(path: str, table: dict[str, Any]) -> list[_Entry]:
    unknown = set(table) - {"admin_sha256", "tokens"}
    if unknown:
        raise _error(path, f"unknown key(s) {', '.join(sorted(unknown))}")
    admins = table.get("admin_sha256", [])
    if isinstance(admins, str):
        admins = [admins]
    if not isinstance(admins, list):
        raise _error(path, "admin_sha256: expected a list of digests")
    entries = [
        _Entry(_digest(path, f"admin_sha256[{i}]", value), Principal(f"admin{i}", admin=True))
        for i, value in enumerate(admins)
    ]
    tokens = table.get("tokens", [])
    if not isinstance(tokens, list):
        raise _error(path, "tokens: expected [[tokens]] tables")
    for i, item in enumerate(tokens):
        where = f"tokens[{i}]"
        if not isinstance(item, dict):
            raise _error(path, f"{where}: expected a table")
        unknown = set(item) - {"name", "sha256", "namespaces"}
        if unknown:
            raise _error(path, f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        name = item.get("name", f"token{i}")
        patterns = item.get("namespaces")
        if not isinstance(name, str):
            raise _error(path, f"{where}.name: expected a string")
        if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
            raise _error(path, f"{where}.namespaces: expected a list of namespace names")
        if len(patterns) > PATTERNS_PER_TOKEN_MAX:
            raise _error(path, f"{where}.namespaces: more than {PATTERNS_PER_TOKEN_MAX}")
        digest = _digest(path, f"{where}.sha256", item.get("sha256"))
        entries.append(_Entry(digest, Principal(name, admin=False, patterns=tuple(patterns))))
    if len(entries) > TOKENS_MAX:
        raise _error(path, f"{len(entries)} tokens, at most {TOKENS_MAX}")
    if len({entry.digest for entry in entries}) != len(entries):
        raise _error(path, "the same digest appears twice")
    return entries


class Authenticator:
    """The daemon's current token table; ``reload()`` swaps in a re-read file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.table = TokenTable.load(path)

    @property
    def token_count(self) -> int:
        return len(self.table.entries)

    def reload(self) -> None:
        """Re-read the file; on any error the old table stays and ConfigError says why."""
        self.table = TokenTable.load(self.path)

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthenticated("no bearer token: send 'authorization: Bearer <token>'")
        if len(token) > TOKEN_BYTES_MAX:
            raise Unauthenticated(f"token longer than {TOKEN_BYTES_MAX} bytes")
        principal = self.table.identify(token)
        if principal is None:
            raise Unauthenticated("unknown token")
        return principal

    def authorize(self, principal: Principal, namespace: str | None, *, admin: bool) -> None:
        """PermissionDenied unless ``principal`` may make a call on ``namespace``.

        ``namespace`` None: the call names none (region calls); any known token
        may, and ``kvd.paths.shm.regions`` then gives a region only to the principal that
        attached it.
        """
        if admin and not principal.admin:
            raise PermissionDenied(f"token {principal.name!r} is not an admin token")
        if namespace is not None and not principal.allows(namespace):
            raise PermissionDenied(f"token {principal.name!r} may not use namespace {namespace!r}")

    def is_admin(self, token: str | None) -> bool:
        principal = self.table.identify(token) if token else None
        return principal is not None and principal.admin

    def check(self, token: str | None, namespace: str | None, *, admin: bool = False) -> None:
        self.authorize(self.authenticate(token), namespace, admin=admin)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` gRPC metadata entry."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            if value[: len(_BEARER)].lower() == _BEARER:
                return value[len(_BEARER) :].strip()
            return None
    return None
