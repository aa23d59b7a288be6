"""The shm socket's index ops: a chain's LOOKUP and its lease's RELEASE
(frames: ``kvd.wire.shm``), parsed into plain values and answered through
the op layer's ``ValueOps``, as the gRPC ``Lookup`` and ``Release`` are, and
counted under the same op names: one lookup is one lookup whichever way it
came. The channel (``kvd.paths.shm.channel``) reads the frames and calls
these; a lookup that must ask the pool runs as the channel's task
(``lookup``), every other one is answered at once (``index_now``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.paths.ops.calls import Tally
from kvd.paths.shm.regions import Caller
from kvd.wire.bulk import ProtocolError, Request, encode_response
from kvd.wire.errors import InvalidArgument, KvdError, error_number
from kvd.wire.limits import KEY_BYTES_MAX
from kvd.wire.lookup import LookupResult
from kvd.wire.shm import (
    FLAG_NO_ANSWER,
    FLAG_RELEASED,
    LOOKUP_ANSWER,
    LOOKUP_REF,
    OP_LOOKUP,
    OP_RELEASE,
    RELEASE_REF,
    split_keys,
)

if TYPE_CHECKING:
    from kvd.paths.ops.region_ops import RegionOps

INDEX_OPS = frozenset({OP_LOOKUP, OP_RELEASE})
OP_NAMES = {OP_LOOKUP: "lookup", OP_RELEASE: "release"}  # the gRPC calls' names


def index_rest_bytes(request: Request, max_lookup_keys: int) -> int:
    """Bytes after an index op's header: its reference, names and, for a
    LOOKUP, its keys, bounded by ``max_lookup_keys`` keys of the longest
    width before they are read."""
    if request.op == OP_RELEASE:
        return RELEASE_REF.size + request.tail_bytes
    limit = max_lookup_keys * KEY_BYTES_MAX
    if request.length > limit:
        raise ProtocolError(f"lookup of {request.length} key bytes is over {limit}")
    return LOOKUP_REF.size + request.tail_bytes + request.length


def index_now(ops: RegionOps, request: Request, rest: bytes, caller: Caller) -> bytes | None:
    """The answer of a RELEASE, or of a LOOKUP that needs no waiting; None
    for a LOOKUP that must ask the pool (the channel then runs ``lookup``)."""
    tally = Tally(ops.metrics, OP_NAMES[request.op])
    try:
        with tally:
            if request.op == OP_RELEASE:
                ns = namespace_of(ops, request, rest, RELEASE_REF.size, caller)
                (lease_id,) = RELEASE_REF.unpack_from(rest)
                flags = FLAG_RELEASED if ops.values.release(lease_id, ns) else 0
                return encode_response(OP_RELEASE, request.request_id, flags=flags)
            ns, keys, lease_ms = _lookup_of(ops, request, rest, caller)
            found = ops.values.lookup_now("lookup", ns, keys, lease_ms)
            if found is None:
                tally.drop()  # the channel's task counts it
                return None
    except KvdError as exc:
        return refusal(request, exc)
    return _lookup_answer(request, found)


async def lookup(ops: RegionOps, request: Request, rest: bytes, caller: Caller) -> bytes:
    """A LOOKUP's answer, the pool asked (inside the channel's ``Tally``)."""
    ns, keys, lease_ms = _lookup_of(ops, request, rest, caller)
    return _lookup_answer(request, await ops.values.lookup("lookup", ns, keys, lease_ms))


def _lookup_of(
    ops: RegionOps, request: Request, rest: bytes, caller: Caller
) -> tuple[str, list[bytes], int]:
    """A LOOKUP's namespace (authorized), keys and lease."""
    lease_ms, width = LOOKUP_REF.unpack_from(rest)
    ns = namespace_of(ops, request, rest, LOOKUP_REF.size, caller)
    try:
        keys = split_keys(rest[LOOKUP_REF.size + request.tail_bytes :], width)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return ns, keys, lease_ms


def namespace_of(ops: RegionOps, request: Request, rest: bytes, start: int, caller: Caller) -> str:
    """An index op's namespace, once the caller may use it."""
    try:
        ns = rest[start : start + request.ns_len].decode()
    except UnicodeDecodeError:
        raise InvalidArgument("namespace is not UTF-8") from None
    if ops.auth is not None:
        assert caller.principal is not None, "HELLO authenticated the connection"
        ops.auth.authorize(caller.principal, ns, admin=False)
    return ns


def _lookup_answer(request: Request, found: LookupResult) -> bytes:
    meta = LOOKUP_ANSWER.pack(
        found.prefix_len, found.l1_hits, found.l2_hits, found.lease_ms, found.lease_id
    )
    return encode_response(OP_LOOKUP, request.request_id, meta=meta)


def refusal(request: Request, exc: KvdError) -> bytes:
    """The answer of an op refused with ``exc`` (its ``Tally`` counted it):
    nothing for a frame that asked for no answer (``FLAG_NO_ANSWER``)."""
    if request.flags & FLAG_NO_ANSWER:
        return b""
    return encode_response(request.op, request.request_id, error_number(exc), message=str(exc))
