"""Pool reads on the shm socket: a trusted client maps L1 read-only and
copies values out of it itself (the ``shm_pool_reads`` setting, off by default).

A region get costs the client's request, the daemon's copy into the region
and its checksum, and the answer; a pool read costs the request and the
answer, and the client copies straight from the pool into its own memory,
any memory (a tensor, not only a region), once. What the daemon does per
value is the index work: find it in L1, pin it, say where its pages are.

**Who may map the pool.** The mapping shows every value in L1, of every
namespace, so the daemon hands it out only to a caller that may read every
namespace anyway: with auth off (any process that can reach the socket may
get any value), or one whose token is an admin token. Any other POOL_ATTACH
is refused (PERMISSION_DENIED) and its client keeps to region gets. The
descriptor passed is opened read-only (``Pool.read_only_fd``): a shared
writable mapping of it fails, a private one writes only the client's own
copy of the pages, and the pool's size is sealed. Frames of a POOL_GET name
their namespace and are authorized like every other op.

**Pins.** A POOL_GET pins its values (a store ``Reader`` each: the pages
are not freed or reused, even when the value is deleted or evicted, until
the reader closes) and answers one pin id for the batch. The pin lasts until
the client's next POOL_GET on the same connection releases it (``POOL_REF``'s
first field), or until the connection ends (a dead client's socket closes,
an idle one is closed after ``bulk_idle_timeout_ms``). A connection holds at
most ``PINS_PER_CONNECTION`` pins, and all connections together pin at most
half of L1 (``PINNED_SHARE``: the other half stays free for puts to evict
in). Pins are not bytes in flight: the daemon holds no memory for them, and
a client's pin waits, idle, for its next get. Past either bound an item is
refused with RESOURCE_EXHAUSTED and nothing is pinned for it; the client
then gets it as a region get.

**What protects the bytes.** A value's checksum is taken when it enters
L1 (computed over the bytes a put copied in, or checked on its way up from
L2), pages are written only by the daemon and only before a value is
published, and a pinned value's pages stay its own. The client checks each
copy against the checksum the answer gave by default (``verify`` in
``kvd.client.pool_reads``), which catches a daemon that handed out the
wrong pages; without it a pool read trusts those three rules.

**The directory.** The memfd also holds the pool's directory
(``kvd.l1.directory``): a client finds a value in L1 there and copies it
without a frame, tags and sequence numbers telling it whether what it
copied was that value; it then tells the daemon in a POOL_TOUCH what it
read. Who may read the directory is who may map the pool.

A value only on L2 is read into L1 first (``ValueOps.fetch_many``), then
pinned like the others; such a POOL_GET waits, the others are answered at
once by the channel's reader (``get_now``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.l1.pool import Pool
from kvd.paths.ops.items import RESOURCE_EXHAUSTED, ItemResult, miss
from kvd.paths.shm.index_ops import namespace_of
from kvd.paths.shm.regions import Caller
from kvd.store.index import TIER_L1, Reader
from kvd.wire.bulk import MESSAGE_BYTES_MAX, ProtocolError, Request, encode_response
from kvd.wire.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvd.wire.limits import KEY_BYTES_MAX
from kvd.wire.shm import (
    FLAG_NO_ANSWER,
    OP_POOL_ATTACH,
    OP_POOL_GET,
    OP_POOL_TOUCH,
    POOL_ANSWER,
    POOL_ATTACHED,
    POOL_DIRECTORY,
    POOL_ITEM,
    POOL_REF,
    POOL_SPAN,
    TIER_SHIFT,
    TOUCH_REF,
    split_keys,
)

if TYPE_CHECKING:
    from kvd.paths.auth import Principal
    from kvd.paths.ops.region_ops import RegionOps

# Pins one connection holds at once: the client library holds one (its last
# batch's, released with its next), so more means a client that does not
# release; four leave room for retries.
PINS_PER_CONNECTION = 4
# The share of L1 all pins together may hold.
PINNED_SHARE = 0.5
OP_NAME = "shm_pool_get"
DIRECT_OP_NAME = "shm_pool_direct"  # gets through the directory, told by POOL_TOUCH
_pin_ids = itertools.count(1)


@dataclass(eq=False)
class Pin:
    readers: list[Reader]
    held_bytes: int


@dataclass(eq=False)
class Pins:
    """The pins of one connection; ``close_all`` when it ends."""

    held: dict[int, Pin] = field(default_factory=dict)

    def release(self, pin_id: int, ops: RegionOps) -> None:
        """Unpin ``pin_id`` (0: nothing); InvalidArgument for one this connection does not hold."""
        if not pin_id:
            return
        pin = self.held.pop(pin_id, None)
        if pin is None:
            raise InvalidArgument(f"pin {pin_id} is not held by this connection")
        _unpin(pin, ops)

    def close_all(self, ops: RegionOps) -> None:
        while self.held:
            _unpin(self.held.popitem()[1], ops)


def _unpin(pin: Pin, ops: RegionOps) -> None:
    for reader in pin.readers:
        reader.close()
    ops.pool_pinned_bytes -= pin.held_bytes
    assert ops.pool_pinned_bytes >= 0


def may_map(ops: RegionOps, principal: Principal | None) -> None:
    """Raise unless this caller may map the pool (``shm_pool_reads`` on; auth
    off, or an admin token)."""
    if not ops.pool_reads or not ops.store.pool.shared:
        raise FailedPrecondition("pool reads are off on this daemon (shm_pool_reads)")
    if ops.auth is not None and (principal is None or not principal.admin):
        raise PermissionDenied(
            "mapping the pool shows every namespace: only an admin token may (shm_pool_reads)"
        )


def attach_answer(request: Request, pool: Pool) -> bytes:
    """The answer of an accepted POOL_ATTACH (the descriptor rides with it),
    with where the directory lies in it."""
    meta = POOL_ATTACHED.pack(pool.capacity_bytes)
    directory = pool.directory
    if directory is not None:
        meta += POOL_DIRECTORY.pack(
            directory.base,
            directory.base + directory.slots_offset,
            directory.bucket_count,
            directory.ways,
        )
    return encode_response(OP_POOL_ATTACH, request.request_id, meta=meta)


def touch_rest_bytes(request: Request, max_keys: int) -> int:
    """Bytes after a POOL_TOUCH's header, bounded by ``max_keys`` of the longest width."""
    return _keys_rest_bytes(request, max_keys, TOUCH_REF.size, "pool touch")


def _keys_rest_bytes(request: Request, max_keys: int, ref_bytes: int, what: str) -> int:
    """Bytes after the header of a frame of keys (``ref_bytes`` of its
    reference first), bounded by ``max_keys`` of the longest width before
    they are read."""
    limit = max_keys * KEY_BYTES_MAX
    if request.length > limit:
        raise ProtocolError(f"{what} of {request.length} key bytes is over {limit}")
    return ref_bytes + request.tail_bytes + request.length


def _keys(request: Request, rest: bytes, ref_bytes: int, count: int, width: int) -> list[bytes]:
    """The ``count`` keys of ``width`` bytes after a frame's reference and names."""
    if not 0 < width <= KEY_BYTES_MAX or request.length != count * width:
        raise InvalidArgument(f"{request.length} key bytes are not {count} keys of {width} bytes")
    return split_keys(rest[ref_bytes + request.tail_bytes :], width)


def touch(ops: RegionOps, request: Request, rest: bytes, caller: Caller) -> bytes:
    """A POOL_TOUCH: values the client read out of the pool through the
    directory, counted as hits (``shm_pool_direct``) and given to the
    eviction policy as a get's are. A value gone from L1 since counts nothing."""
    may_map(ops, caller.principal)
    count, width = TOUCH_REF.unpack_from(rest)
    ns = namespace_of(ops, request, rest, TOUCH_REF.size, caller)
    if count > ops.store.limits.max_lookup_keys:
        raise InvalidArgument(f"{count} keys in one touch, max {ops.store.limits.max_lookup_keys}")
    keys = _keys(request, rest, TOUCH_REF.size, count, width)
    hits, nbytes = ops.store.touched(ns, keys)
    if hits:
        ops.values.served(DIRECT_OP_NAME, "l1", nbytes, hits=hits)
    if request.flags & FLAG_NO_ANSWER:
        return b""
    return encode_response(OP_POOL_TOUCH, request.request_id)


def rest_bytes(request: Request, max_items: int) -> int:
    """Bytes after a POOL_GET's header, its keys bounded by ``max_items`` of
    the longest width before they are read."""
    return _keys_rest_bytes(request, max_items, POOL_REF.size, "pool get")


@dataclass(frozen=True, slots=True)
class PoolBatch:
    release: int
    namespace: str
    keys: list[bytes]


def batch_of(ops: RegionOps, request: Request, rest: bytes, caller: Caller) -> PoolBatch:
    """A POOL_GET's release, namespace (authorized) and keys, from a caller
    that may map the pool: a pin for anyone else would only hold pages."""
    may_map(ops, caller.principal)
    release, count, width = POOL_REF.unpack_from(rest)
    ns = namespace_of(ops, request, rest, POOL_REF.size, caller)
    ops.check_batch(count)
    return PoolBatch(release, ns, _keys(request, rest, POOL_REF.size, count, width))


def get_now(ops: RegionOps, batch: PoolBatch, pins: Pins) -> list[Reader | None] | None:
    """The batch's values pinned from L1 without waiting, by key (None: a
    miss); None when one of them is not in L1 (``get`` then looks on L2,
    and waits for one being read up). Nothing is opened (no hit counted)
    before that is known."""
    store, ns = ops.store, batch.namespace
    for key in batch.keys:
        if store.l1_size(ns, key) is None:
            return None
    pins.release(batch.release, ops)
    return ops.values.pin_now(OP_NAME, ns, batch.keys)


async def get(ops: RegionOps, batch: PoolBatch, pins: Pins) -> list[Reader | None]:
    """The batch's values pinned in L1, those only on L2 read into it first."""
    pins.release(batch.release, ops)
    await ops.values.fetch_remote_many(batch.namespace, batch.keys)
    found = await ops.values.fetch_many(OP_NAME, batch.namespace, batch.keys)
    readers: list[Reader | None] = []
    try:
        for i, key in enumerate(batch.keys):
            if i in found:
                readers.append(found[i])
            else:
                readers.append(await ops.values.fetch(OP_NAME, batch.namespace, key))
    except BaseException:
        for reader in readers + list(found.values()):
            if reader is not None:
                reader.close()
        raise
    return readers


def answer_of(ops: RegionOps, request: Request, readers: list[Reader | None], pins: Pins) -> bytes:
    """Pin what was found (within the connection's pins and the pins' share
    of L1) and answer where each value lies; readers not kept are closed.
    Hits and bytes are counted once for the batch."""
    kept: list[Reader] = []
    held = 0
    parts: list[bytes] = []
    full = len(pins.held) >= PINS_PER_CONNECTION
    room = int(ops.store.pool.capacity_bytes * PINNED_SHARE) - ops.pool_pinned_bytes
    try:
        for reader in readers:
            if reader is None:
                parts.append(_MISS)
                continue
            if full or reader.size > room - held:
                reader.close()
                parts.append(_PINS_FULL if full else _SHARE_FULL)
                continue
            kept.append(reader)
            held += reader.size
            entry = reader.entry
            spans = Pool.spans(entry.runs, entry.size)
            parts.append(
                POOL_ITEM.pack(0, TIER_L1 << TIER_SHIFT, entry.size, entry.checksum,
                               len(entry.meta), 0, len(spans))
            )  # fmt: skip
            if entry.meta:
                parts.append(entry.meta)
            parts += [POOL_SPAN.pack(offset, length) for offset, length in spans]
    except BaseException:
        for reader in kept:
            reader.close()
        raise
    values = ops.values  # a miss was counted by the fetch that found nothing
    pin_id = 0
    if kept:
        values.served(OP_NAME, "l1", held, hits=len(kept))
        pin_id = next(_pin_ids)
        pins.held[pin_id] = Pin(kept, held)
        ops.pool_pinned_bytes += held
    payload = b"".join(parts)
    return (
        encode_response(
            OP_POOL_GET, request.request_id, meta=POOL_ANSWER.pack(pin_id), length=len(payload)
        )
        + payload
    )


def _item(result: ItemResult) -> bytes:
    """An item answered without a value (a miss, a refusal)."""
    text = result.message.encode()[:MESSAGE_BYTES_MAX]
    head = POOL_ITEM.pack(result.code, 0, result.size, 0, 0, len(text), 0)
    return head + text


_MISS = _item(miss())
_PINS_FULL = _item(
    ItemResult(
        code=RESOURCE_EXHAUSTED,
        message=f"this connection holds {PINS_PER_CONNECTION} pins: release one",
    )
)
_SHARE_FULL = _item(
    ItemResult(
        code=RESOURCE_EXHAUSTED, message=f"pins hold {PINNED_SHARE:.0%} of L1: get it into a region"
    )
)
