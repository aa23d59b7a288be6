"""Typed errors shared by the store, the server and the client, and the one
registry from error class to status code.

Expected failures (bad input, a full pool, a conflicting put) are exceptions
of these classes. A class that names a code (``code_name``) registers itself
under it when it is defined; a second class naming the same code raises
TypeError at import (asyncpg's ``exceptions/_base.py`` does so for SQLSTATE
codes). A subclass that names no code of its own shares its parent's.

Codes are the gRPC status numbers (``CODE_NUMBERS``), written here once so
that this module, and every transport and client that maps through it,
needs no grpcio: the gRPC service, the op layer, the shm socket, the bulk
port and the clients all turn an error into a number with ``error_number``
and a number into an error with ``error_for``.
"""

from __future__ import annotations

from typing import ClassVar

# The gRPC status codes (grpc.StatusCode), by name; tests/wire/test_errors.py
# checks them against grpcio's.
CODE_NUMBERS: dict[str, int] = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
CODE_NAMES: dict[int, str] = {number: name for name, number in CODE_NUMBERS.items()}
UNKNOWN = CODE_NUMBERS["UNKNOWN"]

# The error class registered for each code name; KvdError itself for UNKNOWN.
BY_CODE_NAME: dict[str, type[KvdError]] = {}
_BY_NUMBER: dict[int, type[KvdError]] = {}


def _register(cls: type[KvdError]) -> None:
    name = cls.__dict__.get("code_name")
    if name is None:
        return  # shares its parent's code
    if name not in CODE_NUMBERS:
        raise TypeError(f"{cls.__name__} names {name!r}, not a status code")
    existing = BY_CODE_NAME.get(name)
    if existing is not None:
        raise TypeError(
            f"{cls.__name__} has the code {name}, which {existing.__name__} already has"
        )
    BY_CODE_NAME[name] = cls
    _BY_NUMBER[CODE_NUMBERS[name]] = cls


class KvdError(Exception):
    """Base of every error kvd raises on purpose."""

    code_name: ClassVar[str] = "UNKNOWN"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)


_register(KvdError)


def error_number(error: KvdError) -> int:
    """The status number an error is answered with."""
    return CODE_NUMBERS.get(error.code_name, UNKNOWN)


def error_class(number: int) -> type[KvdError]:
    """The class a client raises for a status number (KvdError for codes no class has)."""
    return _BY_NUMBER.get(number, KvdError)


def code_name(number: int) -> str:
    return CODE_NAMES.get(number, "UNKNOWN")


def error_for(number: int, message: str) -> KvdError:
    """The error a client raises for an answer of ``number`` with ``message``."""
    name = code_name(number)
    return BY_CODE_NAME.get(name, KvdError)(f"{name}: {message}")


class InvalidArgument(KvdError):
    code_name = "INVALID_ARGUMENT"


class NotFound(KvdError):
    code_name = "NOT_FOUND"


class AlreadyExists(KvdError):
    """A put of a stored key with different content (keys are write-once)."""

    code_name = "ALREADY_EXISTS"


class ResourceExhausted(KvdError):
    """Full pool, over a quota, too many in flight."""

    code_name = "RESOURCE_EXHAUSTED"


class FailedPrecondition(KvdError):
    """A request the daemon does not take in the state or form it came in."""

    code_name = "FAILED_PRECONDITION"


class DataLoss(KvdError):
    """Bytes that do not match their checksum."""

    code_name = "DATA_LOSS"


class Unauthenticated(KvdError):
    code_name = "UNAUTHENTICATED"


class PermissionDenied(KvdError):
    code_name = "PERMISSION_DENIED"


class Unavailable(KvdError):
    """The daemon is down, draining or unreachable."""

    code_name = "UNAVAILABLE"


class DeadlineExceeded(Unavailable):
    """The daemon did not answer within the call's deadline."""

    code_name = "DEADLINE_EXCEEDED"


class Cancelled(KvdError):
    code_name = "CANCELLED"
