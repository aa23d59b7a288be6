"""Same-node shared-memory regions: the registry and the copies.

A region is a memfd the client creates, sizes, allocates (as it maps it),
seals against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then
``F_SEAL_SEAL``) and passes to the daemon with SCM_RIGHTS on the shm socket
(``kvd.paths.shm.channel``). The daemon maps the descriptor it was given and from
then on copies values between the region and its pool pages with numpy
(which releases the GIL, so the copies run on worker threads while the
event loop serves other requests).

Why a region cannot fault the daemon: a mapped page raises SIGBUS when the
file under it shrank or when its file system cannot back it. The seals make
the size final (``ftruncate`` fails with EPERM, for the client too), and a
memfd lives on the kernel's own tmpfs, which has no size limit
(``f_blocks`` 0): a full /dev/shm does not concern it, and a page the client
punched out is allocated again on the daemon's write (memory pressure then
means the OOM killer, as for any allocation, never SIGBUS). Hugetlb memfds,
whose pages can run out, are refused (their blocks are huge pages). The
checks are on the descriptor itself, so no name, path or file of the shm
directory is involved: the daemon never opens a client's memory by name
with its own privileges.

Ownership and lifetime:

- ``attach`` returns a region id and a random 16-byte token; every call on
  the region presents both, and must come from the credential that attached
  it: the same uid on the shm socket (``SO_PEERCRED``) and, when auth is on,
  the same token's principal. Anything else reads as an unknown region, so
  ids of other clients' regions reveal nothing.
- Liveness is the client's shared ``flock``, taken on a second open file
  description of the memfd that the client never passes on: the kernel
  drops it when the client process exits for any reason (``kill -9``
  included), so ``reap()`` — run every ``region_check_ms`` — frees every
  region whose lock it can take on the descriptor it holds. No heartbeat
  traffic, and no reliance on any connection, which a client may
  re-establish at will.

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
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvd.util.hugepages import map_shared
from kvd.wire.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

if TYPE_CHECKING:
    from kvd.config.settings import Config
    from kvd.paths.auth import Principal

log = logging.getLogger("kvd.paths.shm.regions")

Bytes = np.ndarray[Any, np.dtype[np.uint8]]

TOKEN_BYTES = 16
# Copy and hash in pieces that stay in cache between the two passes. Each
# piece gives up and takes back the GIL: with 16 clients, 1 MiB pieces gave
# 5.1 GB/s of 4 MiB gets where 256 KiB pieces gave 3.8-4.1.
PIECE_BYTES = 1 << 20
# The largest region mapped with all its pages at attach: ~32 ms of the event
# loop here for 256 MiB; larger ones fault their pages in as copies touch them.
POPULATE_BYTES_MAX = 256 << 20
# The seals a region must carry, and those it must not: a write seal would
# make the daemon's writable mapping fail (F_SEAL_FUTURE_WRITE is 0x10 in
# linux/fcntl.h; Python 3.11 does not name it).
SEALS_NEEDED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
SEALS_REFUSED = fcntl.F_SEAL_WRITE | 0x10


class AttachRefused(FailedPrecondition):
    """A region offered in a way the daemon does not take (a file by name)."""


@dataclass(frozen=True)
class Caller:
    """Who makes a region call: the peer credentials of a shm socket
    connection (``uid`` None for a gRPC call, which has none) and, when auth
    is on, the principal its token belongs to (compared by value, so a token
    table reloaded with the same entry still matches)."""

    uid: int | None
    pid: int = 0
    principal: Principal | None = None


@dataclass(frozen=True)
class RegionLimits:
    """Region limits; their defaults are the settings' (``from_config``)."""

    max_regions_per_client: int
    max_regions: int
    max_region_bytes: int

    @classmethod
    def from_config(cls, config: Config) -> RegionLimits:
        return cls(
            max_regions_per_client=config.max_regions_per_client,
            max_regions=config.max_regions,
            max_region_bytes=config.max_region_bytes,
        )


@dataclass(eq=False)
class Region:
    """One attached region; ``array`` is the daemon's view of the client's memory."""

    region_id: int
    token: bytes
    owner: str  # the attaching process, for max_regions_per_client
    uid: int
    principal: Principal | None
    size: int
    fd: int
    mapping: mmap.mmap
    array: Bytes | None
    busy: int = 0  # batches copying right now; unmapping waits for zero
    retired: bool = False
    closed: bool = field(default=False)

    def usable_by(self, caller: Caller) -> bool:
        if caller.uid is not None and caller.uid != self.uid:
            return False
        return self.principal is None or caller.principal == self.principal

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

    def __init__(self, limits: RegionLimits) -> None:
        self.limits = limits
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count(1)
        self.reaped = 0
        self.mapped_bytes = 0

    @property
    def count(self) -> int:
        return len(self._regions)

    def owned_by(self, owner: str) -> int:
        return sum(1 for region in self._regions.values() if region.owner == owner)

    # ---- attach / detach ---------------------------------------------------------
    def attach(self, fd: int, size: int, caller: Caller) -> Region:
        """Attach the memfd ``fd`` of ``size`` bytes for ``caller`` (a shm socket
        peer); the registry owns ``fd`` from now on, and closes it on refusal."""
        assert caller.uid is not None, "regions are attached over the shm socket"
        try:
            mapping = self._checked_mapping(fd, size, caller)
        except BaseException:
            os.close(fd)
            raise
        region = Region(
            next(self._ids),
            secrets.token_bytes(TOKEN_BYTES),
            f"pid:{caller.pid}",
            caller.uid,
            caller.principal,
            size,
            fd,
            mapping,
            np.frombuffer(mapping, dtype=np.uint8),
        )
        self._regions[region.region_id] = region
        self.mapped_bytes += size
        log.debug("region attached", extra={"region_id": region.region_id, "bytes": size})
        return region

    def _checked_mapping(self, fd: int, size: int, caller: Caller) -> mmap.mmap:
        if size <= 0 or size > self.limits.max_region_bytes:
            raise InvalidArgument(
                f"region of {size} bytes; regions are 1..{self.limits.max_region_bytes} bytes"
            )
        if len(self._regions) >= self.limits.max_regions:
            raise ResourceExhausted(f"max_regions={self.limits.max_regions} regions attached")
        if self.owned_by(f"pid:{caller.pid}") >= self.limits.max_regions_per_client:
            raise ResourceExhausted(
                f"max_regions_per_client={self.limits.max_regions_per_client} regions attached"
            )
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            raise InvalidArgument("region descriptor is not open for reading and writing")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument("region descriptor is not a memfd")
        if info.st_size != size:
            raise InvalidArgument(
                f"region memfd holds {info.st_size} bytes, the request said {size}"
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise InvalidArgument("region descriptor is not a memfd (it has no seals)") from None
        if seals & SEALS_NEEDED != SEALS_NEEDED or seals & SEALS_REFUSED:
            raise InvalidArgument(
                "region memfd must be sealed with F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL, "
                "and not against writes"
            )
        space = os.fstatvfs(fd)
        if space.f_blocks != 0 or space.f_bsize != mmap.PAGESIZE:
            # Only the kernel's own tmpfs is unbounded with 4 KiB blocks.
            raise InvalidArgument("region memfd is not on the kernel's tmpfs (hugetlb?)")
        if _owner_gone(fd):
            raise InvalidArgument("hold a shared flock on the region while it is attached")
        try:
            return map_shared(fd, size, populate=_populate(info, size))
        except OSError:
            # Populating is a head start here, not an allocation (the client
            # allocated the pages): where it fails, the pages fault in on
            # first use, as they did when MAP_POPULATE failed silently.
            return map_shared(fd, size, populate=False)

    def get(self, region_id: int, token: bytes, caller: Caller) -> Region:
        """The caller's region; NotFound for an unknown id, a wrong token and
        another credential's region alike."""
        region = self._regions.get(region_id)
        if (
            region is None
            or not hmac.compare_digest(region.token, token)
            or not region.usable_by(caller)
        ):
            raise NotFound(f"no region {region_id} for this client")
        return region

    # Sealed regions cannot shrink: a batch needs no size check of its own.
    checked = get

    def detach(self, region_id: int, token: bytes, caller: Caller) -> None:
        self._drop(self.get(region_id, token, caller))

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


def _populate(info: os.stat_result, size: int) -> bool:
    """Whether to map a region in full at attach: one the client allocated in
    full and no larger than ``POPULATE_BYTES_MAX`` (the others' pages fault
    in on first use). Its huge pages, where it has them, map whole.

    Faulting pages in during the first copies cost a restore of 84 MiB into a
    fresh region here 16k faults and ~0.25 s of CPU (copy threads contend on
    the page tables); populating maps 64 MiB in ~8 ms, once per region. A
    region with holes is not populated: the daemon would allocate them."""
    allocated = info.st_blocks * 512 >= size
    return allocated and size <= POPULATE_BYTES_MAX


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
