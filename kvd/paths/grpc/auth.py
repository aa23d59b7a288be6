"""The gRPC face of auth (``kvd.paths.auth``): a call's token from its
metadata, and the namespace (and whether it is an admin call) a request
message names."""

from __future__ import annotations

from typing import Any

from kvd.paths.auth import Authenticator, Principal, bearer_token
from kvd.v1 import kvd_pb2 as pb


def check_grpc(
    auth: Authenticator | None, context: Any, namespace: str | None, *, admin: bool = False
) -> None:
    """Unauthenticated or PermissionDenied unless the call's token may do this."""
    if auth is not None:
        auth.check(bearer_token(context.invocation_metadata()), namespace, admin=admin)


def grpc_principal(auth: Authenticator | None, context: Any) -> Principal | None:
    """The principal a gRPC call's token belongs to; None with auth off."""
    if auth is None:
        return None
    return auth.authenticate(bearer_token(context.invocation_metadata()))


def request_scope(request: object) -> tuple[str | None, bool]:
    """(namespace, admin) a gRPC request needs; None: the call names no namespace.

    A Delete of a whole namespace and a Stats of the whole daemon are admin calls.
    """
    if isinstance(request, pb.DeleteRequest):
        return request.namespace, request.all_keys
    if isinstance(request, pb.StatsRequest):
        return (request.namespace or None), not request.namespace
    namespace = getattr(request, "namespace", None)
    return (namespace if isinstance(namespace, str) else None), False
