"""The shm socket's REGION_GET_MANY: a batch of region gets in one frame
(``kvd.wire.shm``), parsed into one ``RegionBatch`` for the op layer's
``RegionOps.get_into_region`` (the gRPC ``GetIntoRegion``'s own) and its
results encoded into one answer.

An engine loads a chain's blocks together. As one frame per value, a batch
of 8 values of 64 KiB cost 8 tasks, 8 ``Tally`` rounds and 8 answers on the
daemon's loop; as one frame it costs one of each, and the copies of the
batch are handed out together (``kvd.paths.ops.region_ops``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.paths.ops.items import ItemResult, RegionBatch, RegionItem
from kvd.paths.shm.index_ops import namespace_of
from kvd.paths.shm.regions import Caller
from kvd.wire.bulk import FLAG_EXISTED, MESSAGE_BYTES_MAX, ProtocolError, Request, encode_response
from kvd.wire.errors import InvalidArgument
from kvd.wire.limits import KEY_BYTES_MAX
from kvd.wire.shm import (
    DEADLINE,
    FLAG_DEADLINE,
    MANY_ITEM,
    MANY_REF,
    MANY_RESULT,
    OP_REGION_GET_MANY,
    REGION_REF,
    TIER_SHIFT,
    region_ref_bytes,
)

if TYPE_CHECKING:
    from kvd.paths.ops.region_ops import RegionOps


def _refs_bytes(request: Request) -> int:
    """Bytes between the header and the namespace."""
    return region_ref_bytes(request.flags) + MANY_REF.size


def rest_bytes(request: Request, max_items: int) -> int:
    """Bytes after the header: references, namespace and items, the items
    bounded by ``max_items`` of the longest key before they are read."""
    limit = max_items * (MANY_ITEM.size + KEY_BYTES_MAX)
    if request.length > limit:
        raise ProtocolError(f"batch of {request.length} item bytes is over {limit}")
    return _refs_bytes(request) + request.tail_bytes + request.length


def batch_of(ops: RegionOps, request: Request, rest: bytes, caller: Caller) -> RegionBatch:
    """The frame's batch, its namespace authorized (InvalidArgument for items
    that do not add up)."""
    region_id, _, token = REGION_REF.unpack_from(rest)
    pos = REGION_REF.size
    deadline_ns = 0
    if request.flags & FLAG_DEADLINE:
        (deadline_ns,) = DEADLINE.unpack_from(rest, pos)
        pos += DEADLINE.size
    count, width = MANY_REF.unpack_from(rest, pos)
    pos += MANY_REF.size
    ns = namespace_of(ops, request, rest, pos, caller)
    pos += request.tail_bytes
    ops.check_batch(count)
    if not 0 < width <= KEY_BYTES_MAX or request.length != count * (MANY_ITEM.size + width):
        raise InvalidArgument(
            f"{request.length} item bytes are not {count} items with keys of {width} bytes"
        )
    keys_at = pos + count * MANY_ITEM.size
    items = []
    for i, (offset, room) in enumerate(MANY_ITEM.iter_unpack(rest[pos:keys_at])):
        key = rest[keys_at + i * width : keys_at + (i + 1) * width]
        items.append(RegionItem(key, offset, room))
    return RegionBatch(region_id, token, ns, items, deadline_ns)


def answer_of(request: Request, results: list[ItemResult]) -> bytes:
    """One answer for the batch: its header, then each item's result."""
    parts: list[bytes] = []
    for result in results:
        flags = (FLAG_EXISTED if result.existed else 0) | (result.tier << TIER_SHIFT)
        text = result.message.encode()[:MESSAGE_BYTES_MAX]
        parts += (
            MANY_RESULT.pack(
                result.code, flags, result.size, result.checksum, len(result.meta), len(text)
            ),
            result.meta,
            text,
        )
    payload = b"".join(parts)
    return encode_response(OP_REGION_GET_MANY, request.request_id, length=len(payload)) + payload
