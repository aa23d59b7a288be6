"""Same-node shared-memory regions: the registry and the copies.

A client creates a file in the daemon's shm directory (tmpfs, normally
/dev/shm/kvd), takes a shared ``flock`` on it, and attaches it. The daemon
opens and maps the file, and from then on copies values between the region
and its pool pages with numpy (which releases the GIL, so the copies run on
worker threads while the event loop serves other requests).

Ownership and lifetime:

- ``attach`` returns a region id and a random 16-byte token; every call on
  the region presents both (a wrong token reads as an unknown region, so ids
  of other clients' regions reveal nothing).
- Liveness is the client's ``flock``: the kernel drops it when the client
  process exits for any reason (``kill -9`` included), so ``reap()`` — run
  every ``region_check_ms`` — frees every region whose lock it can take. No
  heartbeat traffic, and no reliance on the gRPC connection, which a client
  may re-establish at will.
- The client may unlink the file once attached (the client library does, so
  a crash leaves nothing behind in the shm directory); the mapping keeps the
  memory alive until both sides let go.
- A region file that shrinks under the daemon would turn copies into SIGBUS;
  every batch re-checks the file's size first and retires the region when it
  shrank. The window between that check and the copy remains: only a process
  that can write the shm directory can use it, and the directory has the
  socket's permissions. (memfd regions with F_SEAL_SHRINK close it; they need
  fd passing over the Unix socket.)

Copies hash what they wrote while it is still in cache: 1 MiB pieces
copied then hashed run at 13.8 GB/s here (256 KiB: 13.4, 64 KiB: 11.3; a
plain copy 18-19), where a separate hashing pass would cost a third more. A get checks the
bytes that landed in the region against the stored checksum; a put stores
the checksum of the bytes that landed in the pool, so a client scribbling on
its region during the copy cannot make a value disagree with its checksum.

This module imports neither grpc nor metrics.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvd.errors import InvalidArgument, KvdError, NotFound, ResourceExhausted

log = logging.getLogger("kvd.shm")

Bytes = np.ndarray[Any, np.dtype[np.uint8]]

TOKEN_BYTES = 16
# Copy and hash in pieces that stay in cache between the two passes. Each
# piece gives up and takes back the GIL: with 16 clients, 1 MiB pieces gave
# 5.1 GB/s of 4 MiB gets where 256 KiB pieces gave 3.8-4.1.
PIECE_BYTES = 1 << 20
# A region file name: what the client library makes, and nothing that could
# climb out of the directory or hide (no '/', no leading dot).
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class RegionUnusable(KvdError):
    """The region's file changed under the daemon (shrank); the region is retired."""

    code_name = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class RegionLimits:
    max_regions_per_client: int = 16
    max_regions: int = 256
    max_region_bytes: int = 4 << 30


@dataclass(eq=False)
class Region:
    """One attached region; ``array`` is the daemon's view of the client's memory."""

    region_id: int
    token: bytes
    owner: str
    name: str
    size: int
    fd: int
    mapping: mmap.mmap
    array: Bytes | None
    busy: int = 0  # batches copying right now; unmapping waits for zero
    retired: bool = False
    closed: bool = field(default=False)

    def holds(self, offset: int, length: int) -> bool:
        return offset >= 0 and length >= 0 and offset + length <= self.size

    def span(self, offset: int, length: int) -> Bytes:
        """The bytes ``[offset, offset+length)``; InvalidArgument outside the region."""
        if not self.holds(offset, length):
            raise InvalidArgument(
                f"offset {offset} + length {length} is outside the region of {self.size} bytes"
            )
        assert self.array is not None, "span of an unmapped region"
        return self.array[offset : offset + length]


class RegionRegistry:
    """Every attached region; state changes happen on the event loop thread."""

    def __init__(self, shm_dir: str, limits: RegionLimits) -> None:
        self.shm_dir = shm_dir
        self.limits = limits
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count(1)
        self._dir_fd = -1
        self.reaped = 0
        self.mapped_bytes = 0

    def open(self) -> None:
        """Create the directory (mode 0o770: the socket's users) and hold it open."""
        os.makedirs(self.shm_dir, mode=0o770, exist_ok=True)
        self._dir_fd = os.open(self.shm_dir, os.O_RDONLY | os.O_DIRECTORY)

    @property
    def count(self) -> int:
        return len(self._regions)

    def owned_by(self, owner: str) -> int:
        return sum(1 for region in self._regions.values() if region.owner == owner)

    # ---- attach / detach ---------------------------------------------------------
    def attach(self, owner: str, name: str, size: int) -> Region:
        assert self._dir_fd >= 0, "registry not opened"
        if not _NAME.fullmatch(name):
            raise InvalidArgument(f"region name {name!r} is not a plain file name")
        if size <= 0 or size > self.limits.max_region_bytes:
            raise InvalidArgument(
                f"region of {size} bytes; regions are 1..{self.limits.max_region_bytes} bytes"
            )
        if len(self._regions) >= self.limits.max_regions:
            raise ResourceExhausted(f"max_regions={self.limits.max_regions} regions attached")
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except OSError as exc:
            raise NotFound(f"region file {name}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"region file {name} is not a regular file")
            if info.st_size != size:
                raise InvalidArgument(
                    f"region file {name} holds {info.st_size} bytes, the request said {size}"
                )
            if _owner_gone(fd):
                raise InvalidArgument(
                    f"region file {name}: hold a shared flock on it while it is attached"
                )
            # A client is the process holding the lock: every client of a Unix
            # socket has the same gRPC peer string, so that cannot tell them apart.
            holder = lock_holder(info)
            owner = f"pid:{holder}" if holder is not None else owner
            if self.owned_by(owner) >= self.limits.max_regions_per_client:
                raise ResourceExhausted(
                    f"max_regions_per_client={self.limits.max_regions_per_client} regions attached"
                )
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        region = Region(
            next(self._ids),
            secrets.token_bytes(TOKEN_BYTES),
            owner,
            name,
            size,
            fd,
            mapping,
            np.frombuffer(mapping, dtype=np.uint8),
        )
        self._regions[region.region_id] = region
        self.mapped_bytes += size
        log.debug("region attached", extra={"region_id": region.region_id, "bytes": size})
        return region

    def get(self, region_id: int, token: bytes) -> Region:
        """The caller's region; NotFound for an unknown id or a wrong token alike."""
        region = self._regions.get(region_id)
        if region is None or not hmac.compare_digest(region.token, token):
            raise NotFound(f"no region {region_id} for this client")
        return region

    def checked(self, region_id: int, token: bytes) -> Region:
        """``get`` plus a check that the file did not shrink (a copy would SIGBUS)."""
        region = self.get(region_id, token)
        try:
            size_now = os.fstat(region.fd).st_size
        except OSError:  # pragma: no cover - fstat of an open fd
            size_now = -1
        if size_now < region.size:
            log.warning(
                "region retired: its file shrank",
                extra={"region_id": region_id, "bytes": region.size, "file_bytes": size_now},
            )
            self._drop(region)
            raise RegionUnusable(
                f"region {region_id}: its file shrank to {size_now} of {region.size} bytes"
            )
        return region

    def detach(self, region_id: int, token: bytes) -> None:
        self._drop(self.get(region_id, token))

    def _drop(self, region: Region) -> None:
        """Unlist now; unmap once no batch is copying."""
        if region.retired:
            return
        region.retired = True
        del self._regions[region.region_id]
        self.mapped_bytes -= region.size
        if region.busy == 0:
            _unmap(region)

    def enter(self, region: Region) -> None:
        assert not region.retired
        region.busy += 1

    def leave(self, region: Region) -> None:
        region.busy -= 1
        assert region.busy >= 0, "region left twice"
        if region.busy == 0 and region.retired:
            _unmap(region)

    # ---- liveness ----------------------------------------------------------------
    def reap(self) -> int:
        """Free regions whose owner's flock is gone; how many."""
        dead = [region for region in self._regions.values() if _owner_gone(region.fd)]
        for region in dead:
            log.info(
                "region freed: its owner is gone",
                extra={"region_id": region.region_id, "bytes": region.size},
            )
            self._drop(region)
        self.reaped += len(dead)
        return len(dead)

    def close(self) -> None:
        for region in list(self._regions.values()):
            self._drop(region)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


def lock_holder(info: os.stat_result, locks_path: str = "/proc/locks") -> int | None:
    """The pid holding a flock on the file ``info`` describes, from /proc/locks
    (lines like ``3: FLOCK ADVISORY READ 4242 00:1a:81234 0 EOF``); None where
    there is no such file or no such lock."""
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open(locks_path, encoding="ascii", errors="replace") as locks:
            for line in locks:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
                    return int(fields[4]) if fields[4].isdigit() else None
    except OSError:
        return None
    return None


def _owner_gone(fd: int) -> bool:
    """True when nobody else holds a flock on the file (our own try succeeded)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _unmap(region: Region) -> None:
    if region.closed:
        return
    region.closed = True
    region.array = None  # drop numpy's export of the mapping before closing it
    try:
        region.mapping.close()
    except BufferError:  # pragma: no cover - a slice outlived its batch; GC unmaps it
        log.warning("region mapping still exported", extra={"region_id": region.region_id})
    os.close(region.fd)


# ---- copies (worker threads: no state changes, only bytes) --------------------------
def copy_span(
    views: Sequence[memoryview],
    region: Bytes,
    start: int,
    end: int,
    to_pages: bool,
    hasher: Any = None,
) -> None:
    """Copy bytes ``start..end`` of a value between its pool ``views`` and
    ``region`` (the value's span there), either way; with ``hasher``, hash
    each piece where it landed while it is still in cache."""
    pos = 0
    for view in views:
        size = len(view)
        lo, hi = max(start, pos), min(end, pos + size)
        if lo < hi:
            pages = np.frombuffer(view, dtype=np.uint8)
            for piece in range(lo, hi, PIECE_BYTES):
                top = min(piece + PIECE_BYTES, hi)
                there = region[piece:top]
                here = pages[piece - pos : top - pos]
                if to_pages:
                    np.copyto(here, there)
                else:
                    np.copyto(there, here)
                if hasher is not None:
                    hasher.update(here.data if to_pages else there.data)
        pos += size
        if pos >= end:
            break
    assert pos >= end, "the value's pages end before the span"


def copy_slices(length: int, parts: int) -> list[tuple[int, int]]:
    """At most ``parts`` slices of ``0..length``, cut at ``PIECE_BYTES`` multiples,
    for copying one value on several threads at once."""
    pieces = max(1, -(-length // PIECE_BYTES))
    per = -(-pieces // max(1, parts))
    return [
        (first * PIECE_BYTES, min(length, (first + per) * PIECE_BYTES))
        for first in range(0, pieces, per)
    ]


def xxh3_of(parts: Sequence[memoryview]) -> int:
    """The xxh3 of ``parts`` read in order (a value's pages, or its span)."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def copy_to_pages(src: Bytes, views: Sequence[memoryview]) -> int:
    """Copy ``src`` into pool ``views``; the xxh3 of the bytes as they landed in the pool."""
    hasher = xxhash.xxh3_64()
    copy_span(views, src, 0, len(src), True, hasher)
    assert sum(len(view) for view in views) == len(src), "pages do not match the value's length"
    return hasher.intdigest()


def copy_from_pages(views: Sequence[memoryview], dst: Bytes) -> int:
    """Copy pool ``views`` into ``dst``; the xxh3 of the bytes as they landed in ``dst``."""
    total = sum(len(view) for view in views)
    assert total <= len(dst), "value longer than its room"
    hasher = xxhash.xxh3_64()
    copy_span(views, dst, 0, total, False, hasher)
    return hasher.intdigest()


# Where an L2 read would land straight in a region: a tier that can read into
# arbitrary memory takes ``dst`` (the region span) instead of pool views, and
# hands back the checksum of what it read, as copy_from_pages does.
read_into_region = copy_from_pages
