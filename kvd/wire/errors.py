"""Typed errors shared by the store, the server and the client.

Expected failures (bad input, a full pool, a conflicting put) are exceptions
of these classes. Each names the gRPC status code it maps to, by name, so the
core modules need not import grpc: the server and the client translate in
one place each (``kvd.paths.grpc.service.status_code`` and ``kvd.client.calls.raise_for``).
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every error kvd raises on purpose."""

    code_name = "UNKNOWN"


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


BY_CODE_NAME: dict[str, type[KvdError]] = {
    cls.code_name: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        ResourceExhausted,
        DataLoss,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
    )
}
