"""What the shm socket's two sides agree on, beyond the bulk protocol's
frames (``kvd.paths.bulk.server``): the region ops' extra fields and the attach frame.

A region op (REGION_GET, REGION_PUT) carries ``REGION_REF`` right after
its 40-byte header, and with ``FLAG_DEADLINE`` a ``DEADLINE`` after it: the
daemon's CLOCK_MONOTONIC past which the client no longer waits and may reuse
the bytes, so no copy into the region starts and no copy out of it is
stored past it. A client sends it only to a daemon that gave its clock
(``DescribePathsResponse.daemon_clock_ns``). A REGION_ATTACH is the first and only frame of a
connection: the header's length is the region's size, its meta the bearer
token, and one descriptor (the region's sealed memfd) rides with it as
SCM_RIGHTS; the answer's meta is ``ATTACHED``.

A LOOKUP carries a chain's keys without gRPC: the engine's scheduler waits
on it (vLLM's ``get_num_new_matched_tokens``), and a gRPC call costs
~0.6 ms before any work on a small machine, a Unix socket frame a few tens
of µs. ``LOOKUP_REF`` follows the header: the lease asked for and the
width of every key of the chain; ``length`` is the bytes of all the keys
(``length / width`` of them), concatenated after the namespace. Chains
whose keys differ in length go over gRPC. The answer's meta is ``LOOKUP_ANSWER``. A
RELEASE names its lease in ``RELEASE_REF``; the answer's ``FLAG_RELEASED``
says whether it was held.

A REGION_GET_MANY is a batch of region gets in one frame (an engine loads a
chain's blocks together; one frame each kept a task, a ``Tally`` and an
answer per value): ``REGION_REF`` (its offset unused) and the deadline as
for a REGION_GET, ``MANY_REF`` (item count, key width), the namespace, then
``length`` bytes: a ``MANY_ITEM`` (offset, room) per item, then the keys,
concatenated. The answer's ``length`` bytes follow its header: per item a
``MANY_RESULT`` and its meta and message. ``DescribePaths`` lists the ops a
daemon takes beyond the region ops (``shm_ops``); a client sends no other.

Pool reads (``shm_pool_reads``): a POOL_ATTACH is, like a REGION_ATTACH,
the first and only frame of a connection, its meta the bearer token; the
answer carries one descriptor (the L1 pool's memfd, opened read-only) and
its meta is ``POOL_ATTACHED``. A POOL_GET pins a batch of values in L1 and
says where they lie in the pool: ``POOL_REF`` (the pin this connection
releases first, 0 for none; item count; key width), the namespace, then
``length`` bytes of keys. The answer's meta is ``POOL_ANSWER`` (the new
pin, 0 when nothing was pinned); its ``length`` bytes hold per item a
``POOL_ITEM``, its meta, its message and its ``POOL_SPAN``s. A pin holds
its values' pages until the connection's next POOL_GET releases it or the
connection ends; the client copies while it holds it.

The directory (pool reads' one-sided gets). The memfd a POOL_ATTACH passes
holds, after the pool's bytes, a directory of the values in L1 that lie in
one run of pages: when the answer's meta goes on with ``POOL_DIRECTORY``,
a client finds a value there and copies it without a frame. The directory
is an owner tag per page (``TAG``: the id of the value whose run starts
there, 0 for none) and ``bucket_count`` buckets of ``ways`` slots of
``DIRECTORY_SLOT``: a sequence number (odd while the daemon rewrites the
slot), the value's id (0: an empty slot), the 16 bytes of
``directory_digest(ns, key)``, its size, checksum and offset in the pool.
A key's bucket is the digest's first 8 bytes, little-endian, modulo
``bucket_count`` (a power of two). The daemon writes a value's tag before
its slot, empties its slot when it leaves L1 and its tag before its pages
are freed; ids are never reused. A reader takes a slot whose sequence
number read the same, even, before and after its fields; copies the value
between two reads of its tag, both the slot's id; and checks the copy
against the slot's checksum. Anything else is not a value: the client then
sends a POOL_GET. Values read so are told to the daemon afterwards, in
batches (POOL_TOUCH: ``TOUCH_REF``, item count and key width, the
namespace, the keys), so their hits count and the eviction policy learns
of them; its answer is a bare acknowledgement.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Sequence

from kvd.wire.limits import KEY_BYTES_MAX

OP_REGION_ATTACH = 6  # after kvd.wire.bulk's HELLO 1, PUT 2, GET 3, REGION_GET 4, REGION_PUT 5
OP_LOOKUP = 7
OP_RELEASE = 8
OP_REGION_GET_MANY = 9
OP_POOL_ATTACH = 10
OP_POOL_GET = 11
OP_POOL_TOUCH = 12
# DescribePathsResponse.shm_ops of a daemon: the ops beyond the region ops.
SHM_OPS = ("lookup", "release", "get_many")
# Compiled formats that cut a chain's keys (``split_keys``), by key width and
# count, kept: ~32 bytes a key, so at most ~5 MB at 16,384 keys a chain.
KEY_FORMATS_CACHED = 8
POOL_OPS = ("pool_get", "pool_touch")
ATTACHED = struct.Struct("<Q16s")  # region id, region token
# After the header of a region op: region id, offset in the region, region token.
REGION_REF = struct.Struct("<QQ16s")
DEADLINE = struct.Struct("<Q")
# After a LOOKUP's header: the lease asked for (ms), and the width of its keys.
LOOKUP_REF = struct.Struct("<II")
# A LOOKUP answer's meta: prefix length, L1 hits, L2 hits, lease ms, lease id.
LOOKUP_ANSWER = struct.Struct("<IIIIQ")
# After a RELEASE's header: the lease id.
RELEASE_REF = struct.Struct("<Q")
FLAG_RELEASED = 1  # answer of a RELEASE: the lease was held and is dropped
# After a REGION_GET_MANY's REGION_REF (and DEADLINE): item count, key width.
MANY_REF = struct.Struct("<II")
MANY_ITEM = struct.Struct("<QQ")  # offset in the region, room
# Per item of a REGION_GET_MANY answer: code, flags (as a REGION_GET
# answer's), size, checksum, meta length, message length; meta and message follow.
MANY_RESULT = struct.Struct("<iIQQHH")
# A POOL_ATTACH answer's meta: the pool's bytes (the size to map).
POOL_ATTACHED = struct.Struct("<Q")
# After a POOL_GET's header: the pin released first, item count, key width.
POOL_REF = struct.Struct("<QII")
# A POOL_GET answer's meta: the pin holding the batch's values (0: none).
POOL_ANSWER = struct.Struct("<Q")
# Per item of a POOL_GET answer: code, flags (the tier), size, checksum,
# meta length, message length, span count; meta, message and spans follow.
POOL_ITEM = struct.Struct("<iIQQHHI")
POOL_SPAN = struct.Struct("<QQ")  # offset in the pool, length
# After POOL_ATTACHED, where the daemon keeps a directory: the tags' offset
# in the memfd, the slots' offset, bucket count and ways per bucket.
POOL_DIRECTORY = struct.Struct("<QQII")
# A directory slot: sequence, value id, digest (16 bytes), size, checksum,
# offset in the pool; 64 bytes, so a slot never spans two cache lines.
DIRECTORY_SLOT = struct.Struct("<QQ16sQQQ8x")
DIRECTORY_FIELDS = struct.Struct("<Q16sQQQ")  # the slot after its sequence number
TAG = struct.Struct("<Q")
POOL_PAGE_BYTES = 64 * 1024  # a tag per page of the pool (kvd.l1.pool's pages)
# After a POOL_TOUCH's header: item count, key width.
TOUCH_REF = struct.Struct("<II")
FLAG_DEADLINE = 4  # request flag, after kvd.wire.bulk's DURABLE 1 and CHECKSUM 2
# Request flag of a POOL_TOUCH only: the daemon sends no answer, not even a
# refusal (it counts one), so the client goes on without a round trip.
FLAG_NO_ANSWER = 16
# struct ucred of SO_PEERCRED: pid, uid, gid.
PEERCRED = struct.Struct("3i")
SOCKET_NAME = "kvd.sock"
# Answer flags above the protocol's: the tier a get was served from.
TIER_SHIFT = 8
# Frames one client sends before reading answers: 16 × (72-byte header and
# ref + ≤ 4.5 KiB of names and meta) stays below a Unix socket's buffer.
PIPELINE_FRAMES = 16


def shm_ops(pool_reads: bool) -> tuple[str, ...]:
    """The ops beyond the region ops a daemon lists in ``DescribePaths``."""
    return SHM_OPS + POOL_OPS if pool_reads else SHM_OPS


def directory_digest(ns: str, key: bytes) -> bytes:
    """The 16 bytes a directory slot names a value by: BLAKE2b of the
    namespace (its length first) and the key. Two keys meet in a slot only
    by a 128-bit collision of a cryptographic hash, which no tenant can craft."""
    name = ns.encode()
    return hashlib.blake2b(len(name).to_bytes(2, "little") + name + key, digest_size=16).digest()


def bucket_offset(digest: bytes, mask: int, ways: int) -> int:
    """Where a digest's bucket lies among the directory's slots: its first 8
    bytes, little-endian, modulo the bucket count (``mask`` + 1, a power of two)."""
    return (int.from_bytes(digest[:8], "little") & mask) * ways * DIRECTORY_SLOT.size


def region_ref_bytes(flags: int) -> int:
    """Bytes of a region op's reference and, with ``FLAG_DEADLINE``, its deadline."""
    return REGION_REF.size + (DEADLINE.size if flags & FLAG_DEADLINE else 0)


def join_keys(keys: Sequence[bytes]) -> tuple[int, bytes] | None:
    """A LOOKUP's keys as (width, bytes); None when they differ in length
    (or there are none): such a chain goes over gRPC."""
    widths = set(map(len, keys))  # in C: ~15 µs for 1,000 keys, a generator ~60 µs
    if len(widths) != 1:
        return None
    (width,) = widths
    if not 0 < width <= KEY_BYTES_MAX:
        return None
    return width, b"".join(keys)


def split_keys(data: bytes, width: int) -> list[bytes]:
    """The keys of a LOOKUP: ``data`` cut every ``width`` bytes (ValueError
    unless it is whole keys). Cut by one ``struct`` unpack in C: 15 µs for
    1,000 keys, 17 µs more the first time a chain of that length is cut,
    against 81 µs for a slice per key."""
    if width <= 0 or len(data) % width:
        raise ValueError(f"{len(data)} bytes are not whole keys of {width} bytes")
    return list(_keys_format(width, len(data) // width).unpack(data))


@functools.lru_cache(maxsize=KEY_FORMATS_CACHED)
def _keys_format(width: int, count: int) -> struct.Struct:
    return struct.Struct(f"{width}s" * count)


def socket_path(shm_dir: str, configured: str) -> str:
    return configured or os.path.join(shm_dir, SOCKET_NAME)


def pid_namespace() -> int:
    """The inode of this process's pid namespace; 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
