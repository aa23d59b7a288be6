"""The L2 tier's records, segments and counters, and the errors it raises
(``kvd.l2.tier`` keeps the index over them)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.l2.format import BLOCK_BYTES, align_up

Key = tuple[str, bytes]


class L2Full(Exception):
    """No segment can be reclaimed right now (all pinned or busy)."""


class ChecksumMismatch(Exception):
    """A record's payload does not match its checksum, or its header is not
    the one the index expects: a miss, never a hit."""


class SegmentState(enum.Enum):
    FREE = 0
    OPEN = 1
    SEALED = 2


@dataclass(eq=False, slots=True)
class L2Record:
    namespace: str
    key: bytes
    parent: bytes
    meta: bytes
    size: int
    checksum: int
    seq: int
    segment: int
    offset: int
    header_bytes: int
    pins: int = 0
    live: bool = True
    # Payload bytes as read from disk: whole O_DIRECT blocks (set from size).
    read_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.read_bytes = align_up(self.size, BLOCK_BYTES)


@dataclass(frozen=True, slots=True)
class Append:
    """One record for ``L2Tier.append_many``: ``payload`` covers ``size``
    rounded up to 4 KiB (whole O_DIRECT blocks)."""

    namespace: str
    key: bytes
    parent: bytes
    meta: bytes
    size: int
    checksum: int
    payload: Sequence[memoryview]


@dataclass(eq=False, slots=True)
class Segment:
    index: int
    state: SegmentState = SegmentState.FREE
    generation: int = 0
    write_pos: int = 0
    first_seq: int = 0
    records: dict[Key, L2Record] = field(default_factory=dict)
    io_inflight: int = 0
    pinned: int = 0
    tail: int = 0  # end of the last valid record found by recovery


@dataclass
class L2Counters:
    writes: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_errors: int = 0
    checksum_failures: int = 0
    reclaims: int = 0
    reclaimed_records: int = 0
    tombstones: int = 0
    syncs: int = 0
    recovered_records: int = 0
