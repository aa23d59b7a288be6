"""Pool reads, client side: values copied straight out of the daemon's L1.

Where the daemon runs with ``shm_pool_reads`` and this client may read every
namespace (auth off, or an admin token), the client maps the daemon's L1
pool read-only (the descriptor comes over the shm socket, ``POOL_ATTACH``)
and a get is one ``POOL_GET`` frame each way: the daemon pins the values and
says where their pages are, the client copies them into the caller's
buffers, any buffers, and releases the pin with its next ``POOL_GET`` on
that connection. The daemon copies nothing; the value bytes are copied
once, by the client. ``kvd.paths.shm.pool_reads`` has the daemon's side,
who may map the pool, and what protects the bytes.

Each copy is checked against the checksum the daemon gave (``verify``,
on by default): a wrong page is a ``DataLoss`` for that item, never a
value. A daemon that refuses the attach leaves the client on region gets.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvd.client.bulk import BulkClient, Connection
from kvd.client.shm_socket import RegionOps, exchange_batch
from kvd.wire.bulk import REQUEST, encode_request
from kvd.wire.errors import CODE_NUMBERS, DataLoss, InvalidArgument, KvdError, error_for
from kvd.wire.shm import (
    OP_POOL_GET,
    POOL_ANSWER,
    POOL_ITEM,
    POOL_REF,
    POOL_SPAN,
    TIER_SHIFT,
)


@dataclass(frozen=True, slots=True)
class PoolItem:
    """One item of a POOL_GET answer: ``code`` 0 and where the value lies, or a status."""

    code: int
    message: str
    size: int
    checksum: int
    meta: bytes
    tier: int
    spans: tuple[tuple[int, int], ...]


class PoolMap:
    """The daemon's L1 pool, mapped read-only from the descriptor it passed."""

    def __init__(self, fd: int, size: int) -> None:
        """Takes ``fd`` (closed here once mapped)."""
        try:
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.size = size
        self._view = memoryview(self._mmap)

    def copy(self, item: PoolItem, buffer: memoryview, verify: bool) -> bool:
        """Copy ``item``'s value into ``buffer`` (room checked by the caller);
        False when ``verify`` finds bytes that do not match its checksum, or
        the spans do not make the value."""
        dst = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        pool = self._view
        if len(item.spans) == 1:  # the common case: one run of pages
            ((offset, length),) = item.spans
            if length != item.size or offset + length > self.size:
                return False
            dst[:length] = pool[offset : offset + length]
            return not verify or xxhash.xxh3_64_intdigest(dst[:length]) == item.checksum
        pos = 0
        for offset, length in item.spans:
            if offset + length > self.size or pos + length > item.size:
                return False  # not this pool's value
            dst[pos : pos + length] = pool[offset : offset + length]
            pos += length
        if pos != item.size:
            return False
        return not verify or xxhash.xxh3_64_intdigest(dst[:pos]) == item.checksum

    def close(self) -> None:
        """Unmap, once no copy out of it runs (a buffer still exported keeps it)."""
        self._view.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()


# A pool get's item the daemon would not pin (a size no value has): the
# caller gets it as a region get.
UNPINNED = -1
_NOT_FOUND = CODE_NUMBERS["NOT_FOUND"]
_RESOURCE_EXHAUSTED = CODE_NUMBERS["RESOURCE_EXHAUSTED"]


def map_pool(ops: RegionOps) -> PoolMap | None:
    """The daemon's pool mapped, where it offers pool reads and lets this
    client; None otherwise (refused: not an admin token; or gone)."""
    if "pool_get" not in ops.offered:
        return None
    try:
        fd, size = ops.attach_pool()
    except KvdError:
        return None
    return PoolMap(fd, size)


def read_all(
    client: BulkClient,
    pool: PoolMap,
    ns: str,
    keys: Sequence[bytes],
    buffers: Sequence[memoryview],
    batch_items: int,
    verify: bool,
) -> list[int | None] | None:
    """``read_batch`` over ``keys`` in batches of ``batch_items``, each on a
    connection of ``client``; None as soon as one cannot go this way."""
    sizes: list[int | None] = []
    for start in range(0, len(keys), batch_items):
        end = min(len(keys), start + batch_items)

        def work(conn: Connection, start: int = start, end: int = end) -> list[int | None] | None:
            return read_batch(conn, pool, ns, keys, buffers, start, end, verify)

        got = client.with_connection(work)
        if got is None:
            return None
        sizes += got
    return sizes


def pool_get_frame(ns: str, keys: Sequence[bytes], release: int) -> bytes | None:
    """A POOL_GET of ``keys`` releasing pin ``release`` first; None when the
    keys differ in width (then the batch goes as region gets)."""
    widths = set(map(len, keys))
    if len(widths) != 1:
        return None
    (width,) = widths
    data = b"".join(keys)
    head = encode_request(OP_POOL_GET, 0, ns.encode(), length=len(data))
    ref = POOL_REF.pack(release, len(keys), width)
    return head[: REQUEST.size] + ref + head[REQUEST.size :] + data


def exchange(conn: Connection, frame: bytes, count: int) -> tuple[int, list[PoolItem]]:
    """Send a POOL_GET of ``count`` keys: the pin the answer holds, and its items.
    The pin is the connection's to release (``Connection.pin``)."""
    answer = exchange_batch(conn, frame, OP_POOL_GET)
    if len(answer.meta) != POOL_ANSWER.size:
        raise ConnectionError("a POOL_GET answer without its pin")
    (pin,) = POOL_ANSWER.unpack(answer.meta)
    payload = bytearray(answer.length)
    conn.recv_into(memoryview(payload))
    items = []
    pos = 0
    for _ in range(count):
        code, flags, size, checksum, meta_len, msg_len, span_count = POOL_ITEM.unpack_from(
            payload, pos
        )
        pos += POOL_ITEM.size
        meta = bytes(payload[pos : pos + meta_len])
        message = payload[pos + meta_len : pos + meta_len + msg_len].decode(errors="replace")
        pos += meta_len + msg_len
        spans = tuple(POOL_SPAN.unpack_from(payload, pos + i * POOL_SPAN.size)
                      for i in range(span_count))  # fmt: skip
        pos += span_count * POOL_SPAN.size
        items.append(PoolItem(code, message, size, checksum, meta, flags >> TIER_SHIFT, spans))
    if pos != len(payload):
        raise ConnectionError(f"a pool answer of {len(payload)} bytes for {pos} of items")
    return pin, items


def read_batch(
    conn: Connection,
    pool: PoolMap,
    ns: str,
    keys: Sequence[bytes],
    buffers: Sequence[memoryview],
    start: int,
    end: int,
    verify: bool,
) -> list[int | None] | None:
    """``keys[start:end]`` copied out of ``pool`` into their buffers, over
    ``conn`` (releasing its last pin): sizes, None for a miss, ``UNPINNED``
    for an item the daemon would not pin; None when the keys differ in width."""
    frame = pool_get_frame(ns, keys[start:end], conn.pin)
    if frame is None:
        return None
    conn.pin = 0  # this frame releases it; a failed one closes the connection
    conn.pin, items = exchange(conn, frame, end - start)
    sizes: list[int | None] = []
    for i, item in enumerate(items, start):
        buffer = buffers[i]
        error: KvdError | None = None
        if item.code == _NOT_FOUND:
            sizes.append(None)
            continue
        if item.code == _RESOURCE_EXHAUSTED:
            sizes.append(UNPINNED)  # the daemon's pins are full: a region get
            continue
        if item.code:
            error = error_for(item.code, item.message)
        elif item.size > len(buffer):
            error = InvalidArgument(f"buffer of {len(buffer)} bytes is too small for {item.size}")
        elif not pool.copy(item, buffer, verify):
            error = DataLoss("value copied out of the pool does not match its checksum")
        if error is not None:
            raise error if len(keys) == 1 else type(error)(f"item {i}: {error}")
        sizes.append(item.size)
    return sizes
