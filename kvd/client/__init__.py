"""The thin client: ``Client`` (``clients``), which picks the shared-memory
path (``shm``, ``shm_socket``) or the bulk TCP path (``bulk``) for large
values on its own, ``AsyncClient`` (``async_client``, gRPC only), and
chained keys (``keys``). Imports only ``kvd.wire`` and ``kvd.util``: never
daemon code."""

from kvd.client.async_client import AsyncClient
from kvd.client.clients import (
    AlreadyExists,
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
