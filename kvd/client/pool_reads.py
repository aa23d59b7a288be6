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
import logging
import os
import platform
import select
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvd.client.bulk import BulkClient, Connection
from kvd.client.shm_socket import RegionOps, exchange_batch
from kvd.util.hugepages import map_shared
from kvd.wire.bulk import REQUEST, encode_request
from kvd.wire.errors import CODE_NUMBERS, DataLoss, InvalidArgument, KvdError, error_for
from kvd.wire.shm import (
    DIRECTORY_FIELDS,
    DIRECTORY_SLOT,
    FLAG_NO_ANSWER,
    OP_POOL_GET,
    OP_POOL_TOUCH,
    POOL_ANSWER,
    POOL_ITEM,
    POOL_PAGE_BYTES,
    POOL_REF,
    POOL_SPAN,
    TAG,
    TIER_SHIFT,
    TOUCH_REF,
    bucket_offset,
    directory_digest,
)

logger = logging.getLogger("kvd.client")

# Gets through the pool's directory: the pool's mapping, its layout (tags,
# slots, mask, ways, pool bytes), the keys' directory digests, a buffer each,
# and whether to hash each copy; each value's size, or -1 where not read so.
PoolReadMany = Callable[
    [memoryview, tuple[int, int, int, int, int], Sequence[bytes], Sequence[memoryview], bool],
    list[int],
]


def native_pool_reads() -> PoolReadMany | None:
    """The native batch of gets through the pool's directory
    (``kvd.io._uring.pool_read_many``: slot lookups, tag checks, copies and
    their checksums in one call, without the GIL), or None when not built.
    Imported only once a directory is mapped: importing the client loads no
    native code, and the extension holds no daemon code."""
    try:
        import kvd.io._uring as _uring
    except ImportError:
        return None
    return _uring.pool_read_many


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


@dataclass(frozen=True, slots=True)
class DirectoryMap:
    """Where the pool's directory lies in the mapping (``POOL_DIRECTORY``)."""

    tags: int
    slots: int
    mask: int
    ways: int

    @staticmethod
    def of(
        fields: tuple[int, int, int, int] | None, size: int, file_bytes: int
    ) -> DirectoryMap | None:
        """The directory the daemon described, or None when it described
        none, or one that does not fit the pool's memfd."""
        if fields is None:
            return None
        tags, slots, buckets, ways = fields
        pages = size // POOL_PAGE_BYTES
        if (
            tags != size
            or slots < tags + pages * TAG.size
            or slots % 64
            or buckets < 1
            or buckets & (buckets - 1)
            or not 0 < ways <= 64
            or slots + buckets * ways * DIRECTORY_SLOT.size > file_bytes
        ):
            return None
        return DirectoryMap(tags, slots, buckets - 1, ways)

    @property
    def end(self) -> int:
        return self.slots + (self.mask + 1) * self.ways * DIRECTORY_SLOT.size


# Machines whose CPUs keep stores in order (x86's TSO): unchecked directory
# copies are safe only there.
STORE_ORDERED_MACHINES = ("x86_64", "AMD64", "i686", "i386")


class PoolMap:
    """The daemon's L1 pool, mapped read-only from the descriptor it passed,
    with its directory where it has one; and the gets read through the
    directory that the daemon has not been told of yet (``take_touched``)."""

    def __init__(
        self,
        fd: int,
        size: int,
        directory: tuple[int, int, int, int] | None = None,
        watch: socket.socket | None = None,
        *,
        verify: bool = True,
        native: bool = True,
    ) -> None:
        """Takes ``fd`` (closed here once mapped) and ``watch``, the attach's
        connection, which the daemon keeps open while it lives: the directory
        is read only while it is (without it, none is). ``verify``: check
        each copy against its checksum. Gets through the directory run in
        native code where it is built and ``native`` (``native_pool_reads``),
        in Python otherwise, which check the checksum whatever ``verify``."""
        self._watch = watch
        self._poll: select.poll | None = None
        try:
            self.directory = DirectoryMap.of(directory, size, os.fstat(fd).st_size)
            if watch is None:
                self.directory = None
            else:
                self._poll = select.poll()
                self._poll.register(watch, select.POLLIN)  # EOF (or a stray byte) ends it
            nbytes = size if self.directory is None else self.directory.end
            # Huge pages where the daemon's pool has them: copies out of a
            # 4 KiB-page mapping run at ~0.8x (kvd.util.hugepages).
            self._mmap = map_shared(fd, nbytes, populate=False, writable=False)
        except BaseException:
            if watch is not None:
                watch.close()
            raise
        finally:
            os.close(fd)
        self.size = size
        self._view = memoryview(self._mmap)
        self.verify = verify
        # An unchecked copy through the directory trusts that the daemon's
        # stores of a value's pages, its tag and its slot become visible in
        # that order, which x86 guarantees (TSO; a freed page's zeroed tag is
        # visible before the page is rewritten, the GIL's release between
        # them being a full barrier). Elsewhere the checksum stays on.
        self.direct_verify = verify or platform.machine() not in STORE_ORDERED_MACHINES
        self._native = native_pool_reads() if native and self.directory is not None else None
        if self.directory is not None:
            logger.debug(
                "gets through the pool's directory: %s",
                "native" if self._native is not None else "Python (kvd.io._uring not built)",
            )
        self.touched: dict[str, list[bytes]] = {}
        self.touched_count = 0
        self.direct_hits = 0

    def daemon_gone(self) -> bool:
        """Whether the daemon that passed this pool closed the attach's
        connection (one poll, no wait): it exited or was killed, and a new
        one at the same socket has another pool. False when not watched
        (a daemon without a directory)."""
        return self._poll is not None and bool(self._poll.poll(0))

    def read_direct_many(
        self, ns: str, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """Copy each key's value into its buffer through the directory,
        without a frame: its size, or None where it cannot be read so (not in
        the directory, being rewritten, reused while copied, too large for
        its buffer, or not matching its checksum): then ask the daemon."""
        directory = self.directory
        if directory is None:
            return [None] * len(keys)
        digests = [directory_digest(ns, key) for key in keys]
        if self._native is None:
            sizes = [self._read_one(d, buf) for d, buf in zip(digests, buffers, strict=True)]
        else:
            layout = (directory.tags, directory.slots, directory.mask, directory.ways, self.size)
            got = self._native(self._view, layout, digests, buffers, self.direct_verify)
            sizes = [None if size < 0 else size for size in got]
        hits = [key for key, size in zip(keys, sizes, strict=True) if size is not None]
        if hits:
            self.direct_hits += len(hits)
            self.touched.setdefault(ns, []).extend(hits)
            self.touched_count += len(hits)
        return sizes

    def read_direct(self, ns: str, key: bytes, buffer: memoryview) -> int | None:
        """One get through the directory (``read_direct_many``)."""
        return self.read_direct_many(ns, [key], [buffer])[0]

    def _read_one(self, digest: bytes, buffer: memoryview) -> int | None:
        """The Python get through the directory. The copy is always checked:
        the tags make a torn read plain on a CPU that keeps loads in order,
        the checksum on any other."""
        directory = self.directory
        assert directory is not None
        view = self._view
        at = directory.slots + bucket_offset(digest, directory.mask, directory.ways)
        for _ in range(directory.ways):
            (seq,) = TAG.unpack_from(view, at)
            if not seq & 1:
                uid, named, size, checksum, offset = DIRECTORY_FIELDS.unpack_from(view, at + 8)
                if uid and named == digest:
                    if TAG.unpack_from(view, at)[0] != seq:
                        return None  # rewritten while read
                    break
            at += DIRECTORY_SLOT.size
        else:
            return None
        if size > len(buffer) or offset % POOL_PAGE_BYTES or offset + size > self.size:
            return None
        tag = directory.tags + offset // POOL_PAGE_BYTES * TAG.size
        if TAG.unpack_from(view, tag)[0] != uid:
            return None
        dst = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        dst[:size] = view[offset : offset + size]
        if xxhash.xxh3_64_intdigest(dst[:size]) != checksum or TAG.unpack_from(view, tag)[0] != uid:
            return None
        return int(size)

    def take_touched(self) -> dict[str, list[bytes]]:
        """The gets read through the directory since the last call, by namespace."""
        touched, self.touched, self.touched_count = self.touched, {}, 0
        return touched

    def copy(self, item: PoolItem, buffer: memoryview) -> bool:
        """Copy ``item``'s value into ``buffer`` (room checked by the caller);
        False when ``verify`` finds bytes that do not match its checksum, or
        the spans do not make the value."""
        verify = self.verify
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
        if self._watch is not None:
            self._watch.close()
            self._watch = None
            self._poll = None
        self._view.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()


# A pool get's item the daemon would not pin (a size no value has): the
# caller gets it as a region get.
UNPINNED = -1
_NOT_FOUND = CODE_NUMBERS["NOT_FOUND"]
_RESOURCE_EXHAUSTED = CODE_NUMBERS["RESOURCE_EXHAUSTED"]


def map_pool(ops: RegionOps, direct: bool = True, verify: bool = True) -> PoolMap | None:
    """The daemon's pool mapped, where it offers pool reads and lets this
    client; None otherwise (refused: not an admin token; or gone). With
    ``direct``, its directory too, where the daemon takes POOL_TOUCH;
    ``verify``: hash each copy through it (``PoolMap``)."""
    if "pool_get" not in ops.offered:
        return None
    try:
        fd, size, directory, watch = ops.attach_pool()
    except KvdError:
        return None
    if not direct or "pool_touch" not in ops.offered:
        directory = None
    return PoolMap(fd, size, directory, watch, verify=verify)


def touch_frame(ns: str, keys: Sequence[bytes]) -> bytes | None:
    """A POOL_TOUCH of ``keys`` that asks for no answer; None when they differ in width."""
    return _keys_frame(
        OP_POOL_TOUCH, ns, keys, lambda width: TOUCH_REF.pack(len(keys), width), FLAG_NO_ANSWER
    )


def _keys_frame(
    op: int, ns: str, keys: Sequence[bytes], ref: Callable[[int], bytes], flags: int = 0
) -> bytes | None:
    """A frame of ``op`` over ``keys`` of one width, ``ref(width)`` after its
    header; None when the keys differ in width."""
    widths = set(map(len, keys))
    if len(widths) != 1:
        return None
    (width,) = widths
    data = b"".join(keys)
    head = encode_request(op, 0, ns.encode(), length=len(data), flags=flags)
    return head[: REQUEST.size] + ref(width) + head[REQUEST.size :] + data


def tell_touched(client: BulkClient, touched: dict[str, list[bytes]], batch_keys: int) -> None:
    """Tell the daemon the gets read through the directory (POOL_TOUCH
    frames of at most ``batch_keys`` keys of one width each). No answer is
    awaited: the daemon counts them while this client goes on (a round trip
    per 256 gets cost ~4 µs a get here); a full socket buffer holds it back."""
    frames: list[bytes] = []
    for ns, keys in touched.items():
        by_width: dict[int, list[bytes]] = {}
        for key in keys:
            by_width.setdefault(len(key), []).append(key)
        for same in by_width.values():
            for start in range(0, len(same), batch_keys):
                frame = touch_frame(ns, same[start : start + batch_keys])
                assert frame is not None, "keys of one width"
                frames.append(frame)

    def work(conn: Connection) -> None:
        for frame in frames:
            conn.send([memoryview(frame)])

    if frames:
        client.with_connection(work)


def read_all(
    client: BulkClient,
    pool: PoolMap,
    ns: str,
    keys: Sequence[bytes],
    buffers: Sequence[memoryview],
    batch_items: int,
) -> list[int | None] | None:
    """``read_batch`` over ``keys`` in batches of ``batch_items``, each on a
    connection of ``client``; None as soon as one cannot go this way."""
    sizes: list[int | None] = []
    for start in range(0, len(keys), batch_items):
        end = min(len(keys), start + batch_items)

        def work(conn: Connection, start: int = start, end: int = end) -> list[int | None] | None:
            return read_batch(conn, pool, ns, keys, buffers, start, end)

        got = client.with_connection(work)
        if got is None:
            return None
        sizes += got
    return sizes


def pool_get_frame(ns: str, keys: Sequence[bytes], release: int) -> bytes | None:
    """A POOL_GET of ``keys`` releasing pin ``release`` first; None when the
    keys differ in width (then the batch goes as region gets)."""
    return _keys_frame(
        OP_POOL_GET, ns, keys, lambda width: POOL_REF.pack(release, len(keys), width)
    )


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
        elif not pool.copy(item, buffer):
            error = DataLoss("value copied out of the pool does not match its checksum")
        if error is not None:
            raise error if len(keys) == 1 else type(error)(f"item {i}: {error}")
        sizes.append(item.size)
    return sizes
