"""What the io backends run: block ops, L2 record reads, and the stripe layout
that maps a logical segment's bytes onto its paths.

Plain data only; ``kvd.io.backend`` runs them (io_uring or threads). The
layout's arithmetic exists twice, here (``StripeLayout.ops``, used for writes,
recovery and the Python record reads) and in native/kvd_reads.c (record
reads on the ring); tests/io/test_layout.py holds the two to the same ops.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

BUFS_PER_OP_MAX = 1024  # IOV_MAX on Linux
# The most bytes ``StripeLayout.ops`` puts in one op (Linux moves at most
# 2 GiB - 4 KiB per call); native/kvd_reads.c cuts record reads the same way.
OP_BYTES_MAX = 1 << 30
PATHS_MAX = 64  # paths one layout stripes over (the ssd_path setting's bound)


class OpKind(enum.IntEnum):
    """Opcodes shared with the native ring."""

    READ = 0
    WRITE = 1
    FSYNC = 2
    FDATASYNC = 3


class ReadStatus(enum.IntEnum):
    """How a record read ended (besides ``-errno``); the native ring's READ_* values."""

    OK = 0
    SHORT = 1  # an op moved fewer bytes than asked for
    BAD_HEADER = 2  # not the header the index expects: torn, misdirected or deleted
    BAD_CHECKSUM = 3  # the payload does not match its checksum


@dataclass(frozen=True, slots=True)
class IoOp:
    """One op: read/write fill or drain ``bufs`` in order from ``offset``."""

    kind: OpKind
    fd: int
    offset: int = 0
    bufs: Sequence[memoryview] = ()

    def check(self) -> None:
        """Raise ValueError for an op no kernel would accept."""
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.kind in (OpKind.READ, OpKind.WRITE):
            if not 1 <= len(self.bufs) <= BUFS_PER_OP_MAX:
                raise ValueError(f"an op takes 1..{BUFS_PER_OP_MAX} buffers, got {len(self.bufs)}")
        elif self.bufs:
            raise ValueError("fsync ops take no buffers")


class RecordRead(NamedTuple):
    """One L2 record read: ``header_bytes`` of header then the payload, at
    logical ``offset`` of ``segment``. The payload lands in ``payload`` (in
    order; at least ``payload_bytes`` long), the header in a buffer of the
    backend's own; the header must announce this ``seq``, ``generation``,
    ``namespace`` and ``key`` and a payload of ``payload_bytes`` whose xxh3-64
    is ``checksum``. A tuple, in the native ring's field order: a batch goes to
    it as it is."""

    segment: int
    offset: int
    header_bytes: int
    payload: Sequence[memoryview]
    payload_bytes: int
    checksum: int
    seq: int
    generation: int
    namespace: str
    key: bytes


# on_done(index in the batch, ReadStatus or -errno), called as each record ends
RecordDone = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class StripeLayout:
    """N paths as one address space of logical segments.

    Segment *i* of the layout is segment *i* of every path, its bytes dealt
    round-robin over the paths in stripes of ``stripe_bytes``: logical
    offset L lands on path ``(L // S) % N`` at ``i * segment_bytes +
    ((L // S) // N) * S + L % S``. A path's stripes of one segment are
    contiguous there, so any logical range is at most one op per path, and a
    large record is read from every path in parallel.
    """

    fds: tuple[int, ...]
    segment_bytes: int  # per path
    stripe_bytes: int

    def __post_init__(self) -> None:
        if not 1 <= len(self.fds) <= PATHS_MAX:
            raise ValueError(f"a layout stripes over 1..{PATHS_MAX} paths, got {len(self.fds)}")
        if self.stripe_bytes <= 0 or self.segment_bytes % self.stripe_bytes:
            raise ValueError("segment_bytes must be a positive multiple of stripe_bytes")

    @property
    def logical_segment_bytes(self) -> int:
        return self.segment_bytes * len(self.fds)

    @property
    def native(self) -> tuple[tuple[int, ...], int, int]:
        """The layout as the native ring takes it."""
        return self.fds, self.segment_bytes, self.stripe_bytes

    def ops(
        self, kind: OpKind, segment: int, offset: int, bufs: Sequence[memoryview]
    ) -> list[IoOp]:
        """The per-path ops that move ``bufs`` to/from logical ``offset`` of ``segment``:
        one per path touched, in path order, or more where a path's pieces
        pass ``BUFS_PER_OP_MAX`` (the native ring cuts them the same way)."""
        length = sum(len(b) for b in bufs)
        assert segment >= 0
        assert offset >= 0 and offset + length <= self.logical_segment_bytes, (offset, length)
        n = len(self.fds)
        if n == 1:  # no striping: the buffers as they are
            return _cut(kind, self.fds[0], segment * self.segment_bytes + offset, bufs)
        stripe = self.stripe_bytes
        per_path: list[list[memoryview]] = [[] for _ in range(n)]
        start: list[int] = [-1] * n
        pieces = _Cursor(bufs)
        pos = offset
        end = offset + length
        while pos < end:
            index = pos // stripe
            path = index % n
            take = min(end, (index + 1) * stripe) - pos
            if start[path] < 0:
                row = index // n
                start[path] = segment * self.segment_bytes + row * stripe + pos % stripe
            per_path[path].extend(pieces.take(take))
            pos += take
        return [op for p in range(n) for op in _cut(kind, self.fds[p], start[p], per_path[p])]


def _cut(kind: OpKind, fd: int, offset: int, bufs: Sequence[memoryview]) -> list[IoOp]:
    """One op for ``bufs`` at ``offset``, or as many as it takes to keep each
    under ``BUFS_PER_OP_MAX`` buffers and ``OP_BYTES_MAX`` bytes."""
    if len(bufs) <= BUFS_PER_OP_MAX and sum(len(b) for b in bufs) <= OP_BYTES_MAX:
        return [IoOp(kind, fd, offset, bufs)] if bufs else []
    ops: list[IoOp] = []
    chunk: list[memoryview] = []
    chunk_bytes = 0
    for buf in bufs:
        while len(buf):
            if len(chunk) == BUFS_PER_OP_MAX or chunk_bytes == OP_BYTES_MAX:
                ops.append(IoOp(kind, fd, offset, chunk))
                offset += chunk_bytes
                chunk, chunk_bytes = [], 0
            take = min(len(buf), OP_BYTES_MAX - chunk_bytes)
            chunk.append(buf[:take])
            chunk_bytes += take
            buf = buf[take:]
    if chunk:
        ops.append(IoOp(kind, fd, offset, chunk))
    return ops


class _Cursor:
    """Takes consecutive byte ranges out of a list of views."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = views
        self._index = 0
        self._pos = 0

    def take(self, nbytes: int) -> list[memoryview]:
        out = []
        while nbytes:
            view = self._views[self._index]
            step = min(nbytes, len(view) - self._pos)
            out.append(view[self._pos : self._pos + step])
            self._pos += step
            nbytes -= step
            if self._pos == len(view):
                self._index += 1
                self._pos = 0
        return out
