"""The shared pool's directory: where each value in L1 lies, for clients
that map the pool and copy a value out of it without asking the daemon.

A pool get over the socket costs a round trip: on a 2-CPU VM a bare asyncio
echo of 64 bytes over a Unix socket already takes 100-240 µs, a copy of a
64 KiB value 3-5 µs. The directory lets a trusted client (one that may map
the pool, ``kvd.paths.shm.pool_reads``) skip the round trip: it finds the
value's slot by its key's digest, copies the value and checks it, and tells
the daemon afterwards, in batches, what it read (POOL_TOUCH).

It lies in the pool's memfd after the pool's bytes (``kvd.wire.shm`` has
the layout a client reads): an owner tag per page, and buckets of slots.
Only the daemon's loop writes it, in this order, which is what makes a
reader's copy either the value or nothing:

- a value entering L1 (``publish``) gets a new id, never used before; the
  tag of its run's first page is set to that id, then its slot is written
  under the slot's sequence number (odd while it is rewritten);
- a value leaving L1 (``withdraw``) has its slot emptied at once, even
  while readers still pin its pages;
- pages being freed (``clear``, from ``Pool.free``) have their tags zeroed
  first, so a tag never again holds the id of a value whose pages were
  reused, and a reader that read the same id before and after its copy
  copied pages that were that value's all along.

Only a value in one run of pages has a slot (a value over several runs, or
one whose bucket is full, is read with a POOL_GET, as before); a bucket
holds ``WAYS`` slots and there are half as many buckets as pages, so a full
pool of one-page values fills a bucket rarely (``overflows`` counts them).
Imports nothing from the server.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence

from kvd.wire.shm import DIRECTORY_FIELDS, DIRECTORY_SLOT, TAG, bucket_offset, directory_digest

WAYS = 4
_ALIGN = mmap.PAGESIZE
_EMPTY = DIRECTORY_FIELDS.pack(0, bytes(16), 0, 0, 0)
_HEAD = struct.Struct("<Q16s")  # a slot's id and digest


def _layout(page_count: int) -> tuple[int, int, int]:
    """The slots' offset in the directory, its bucket count and its bytes."""
    slots_offset = -(-page_count * TAG.size // 64) * 64
    buckets = 1 << max(0, (page_count // 2 - 1).bit_length())
    nbytes = slots_offset + buckets * WAYS * DIRECTORY_SLOT.size
    return slots_offset, buckets, -(-nbytes // _ALIGN) * _ALIGN


def directory_bytes(page_count: int) -> int:
    """Bytes the directory of a pool of ``page_count`` pages takes (1/512 of the pool)."""
    return _layout(page_count)[2]


class Directory:
    """The directory over ``view`` (the memfd's bytes after the pool's), for
    ``page_count`` pages; ``base`` is its offset in the memfd."""

    def __init__(self, view: memoryview, page_count: int, base: int) -> None:
        self.slots_offset, self.bucket_count, nbytes = _layout(page_count)
        assert len(view) >= nbytes, "directory view too small"
        self._view = view
        self._mask = self.bucket_count - 1
        self.base = base
        self.overflows = 0  # values left out: their bucket was full
        self.published = 0  # slots holding a value now

    @property
    def ways(self) -> int:
        return WAYS

    def publish(
        self, ns: str, key: bytes, uid: int, first_page: int, size: int, checksum: int, offset: int
    ) -> int:
        """Give a value that entered L1 a slot: its offset in the directory,
        or -1 when its bucket is full. ``uid`` is new (never published before)."""
        digest = directory_digest(ns, key)
        view = self._view
        base = self.slots_offset + bucket_offset(digest, self._mask, WAYS)
        slot, kept = -1, False
        for way in range(WAYS):
            at = base + way * DIRECTORY_SLOT.size
            held, named = _HEAD.unpack_from(view, at + 8)
            if held and named == digest:
                slot, kept = at, True  # a slot the key kept (not withdrawn): rewritten
                break
            if not held and slot < 0:
                slot = at
        if slot < 0:
            self.overflows += 1
            return -1
        TAG.pack_into(view, first_page * TAG.size, uid)  # the tag before the slot
        self._write(slot, DIRECTORY_FIELDS.pack(uid, digest, size, checksum, offset))
        self.published += 0 if kept else 1
        return slot

    def withdraw(self, slot: int, uid: int) -> None:
        """Empty the slot ``publish`` gave value ``uid`` (it left L1)."""
        (held,) = TAG.unpack_from(self._view, slot + 8)
        if held == uid:
            self._write(slot, _EMPTY)
            self.published -= 1

    def clear(self, runs: Sequence[tuple[int, int]]) -> None:
        """Zero the tags of runs about to be freed (before any reuse)."""
        view = self._view
        for first, _ in runs:
            TAG.pack_into(view, first * TAG.size, 0)

    def close(self) -> None:
        self._view.release()

    def _write(self, slot: int, fields: bytes) -> None:
        view = self._view
        (seq,) = TAG.unpack_from(view, slot)
        TAG.pack_into(view, slot, seq + 1)  # odd: being rewritten
        view[slot + 8 : slot + DIRECTORY_SLOT.size - 8] = fields
        TAG.pack_into(view, slot, seq + 2)
