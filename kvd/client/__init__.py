"""The thin client: ``Client`` and ``AsyncClient`` (``clients``), which pick
the shared-memory path (``shm``, ``shm_socket``) or the bulk TCP path
(``bulk``) for large values on their own, and chained keys (``keys``).
Imports only ``kvd.wire`` and ``kvd.util``: never daemon code."""

from kvd.client.clients import (
    AlreadyExists,
    AsyncClient,
    Client,
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    KvdError,
    LookupResult,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Tls,
    Unauthenticated,
    Unavailable,
    chain_keys,
)

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "Client",
    "DataLoss",
    "DeadlineExceeded",
    "InvalidArgument",
    "KvdError",
    "LookupResult",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Tls",
    "Unauthenticated",
    "Unavailable",
    "chain_keys",
]
