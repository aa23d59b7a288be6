"""L2 on-disk record format.

A device is cut into segments; a segment is an append-only log of records.
Each record starts on a 64 KiB boundary and is::

    [header: 4 KiB, or 8 KiB with a large meta][payload][pad to 64 KiB]

The payload starts right after the header, on a 4 KiB boundary (the
O_DIRECT unit), so a read lands straight in pool pages; the tail padding is
never written. Records are 64 KiB-aligned, so a record that ends exactly on
a page costs one extra page for its header: 6 % for a 1 MiB value, under
2 % for the 4-64 MiB chunks engines store.

Header (little endian)::

    0   8  magic  b"KVDL2REC"
    8   2  format version (1)
    10  2  flags (bit 0: tombstone - the record was deleted; bit 1: segment
             marker - the first record of each use of a segment, no payload)
    12  4  header bytes (4096 or 8192)
    16  8  segment generation (random per use of the segment)
    24  8  sequence number (global, increasing)
    32  8  record bytes (header + payload + pad; a multiple of 64 KiB)
    40  8  payload bytes
    48  8  payload checksum (xxh3-64)
    56  2  namespace length   58  1  key length   59  1  parent length
    60  2  meta length        62  2  reserved (0)
    64  .. namespace, key, parent, meta
    header bytes - 8: xxh3-64 of everything before it

A scan reads the segment marker at offset 0, then walks the records,
jumping by ``record bytes``; after a header that is not valid, or whose
generation differs from the marker's (an older use of the segment, or a
torn write), it steps 64 KiB at a time looking for the next valid record of
this generation, so a failed write in the middle loses only itself. Every
read takes the header along with the payload and checks both
(``check_record`` here, or the same checks in C in native/kvd_record.c): a
torn, misdirected or deleted record, or a payload that fails its checksum, is
a miss, never a wrong value.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.io.backend import ReadStatus
from kvd.wire.checksum import checksum, checksum_views

MAGIC = b"KVDL2REC"
VERSION = 1
FLAG_TOMBSTONE = 1  # the record was deleted
FLAG_SEGMENT = 2  # a segment's first record: carries the generation of this use
BLOCK_BYTES = 4096  # O_DIRECT alignment of offsets, lengths and memory
RECORD_ALIGN_BYTES = 64 * 1024
HEADER_BYTES_MAX = 2 * BLOCK_BYTES

_FIXED = struct.Struct("<8sHHIQQQQQHBBHH")
assert _FIXED.size == 64


class HeaderError(ValueError):
    """Bytes that are not a valid record header."""


def align_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass(frozen=True, slots=True)
class RecordHeader:
    namespace: str
    key: bytes
    parent: bytes
    meta: bytes
    generation: int
    seq: int
    payload_bytes: int
    payload_checksum: int
    flags: int = 0
    # Derived from the fields above when the header is made.
    header_bytes: int = field(init=False, compare=False)
    record_bytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        ns = len(self.namespace.encode())
        body = _FIXED.size + ns + len(self.key) + len(self.parent) + len(self.meta) + 8
        header_bytes = align_up(body, BLOCK_BYTES)
        object.__setattr__(self, "header_bytes", header_bytes)
        record_bytes = align_up(header_bytes + self.payload_bytes, RECORD_ALIGN_BYTES)
        object.__setattr__(self, "record_bytes", record_bytes)

    def encode(self) -> bytes:
        ns = self.namespace.encode()
        size = self.header_bytes
        assert size <= HEADER_BYTES_MAX, "header too large"
        fixed = _FIXED.pack(
            MAGIC, VERSION, self.flags, size, self.generation, self.seq, self.record_bytes,
            self.payload_bytes, self.payload_checksum, len(ns), len(self.key), len(self.parent),
            len(self.meta), 0,
        )  # fmt: skip
        body = fixed + ns + self.key + self.parent + self.meta
        body += bytes(size - 8 - len(body))
        return body + struct.pack("<Q", checksum(body))


def header_bytes_at(block: bytes | memoryview) -> int:
    """The header size a record's first block announces (to read the rest), or 0."""
    if len(block) < _FIXED.size or bytes(block[:8]) != MAGIC:
        return 0
    size = int(_FIXED.unpack_from(block)[3])
    return size if size in (BLOCK_BYTES, HEADER_BYTES_MAX) else 0


def decode(data: bytes | memoryview) -> RecordHeader:
    """Parse and verify a header; HeaderError for anything that is not one."""
    size = header_bytes_at(data)
    if not size or len(data) < size:
        raise HeaderError("no record header")
    (_, version, flags, _, generation, seq, record_bytes, payload_bytes, payload_checksum,
     ns_len, key_len, parent_len, meta_len, _) = _FIXED.unpack_from(data)  # fmt: skip
    if version != VERSION:
        raise HeaderError(f"format version {version}, this kvd reads {VERSION}")
    (stored,) = struct.unpack_from("<Q", data, size - 8)
    if checksum(data[: size - 8]) != stored:
        raise HeaderError("header checksum mismatch")
    pos = _FIXED.size
    fields = []
    for length in (ns_len, key_len, parent_len, meta_len):
        fields.append(bytes(data[pos : pos + length]))
        pos += length
    if pos > size - 8:
        raise HeaderError("header fields overflow the header")
    header = RecordHeader(
        fields[0].decode(errors="replace"), fields[1], fields[2], fields[3],
        generation, seq, payload_bytes, payload_checksum, flags,
    )  # fmt: skip
    if header.record_bytes != record_bytes or header.header_bytes != size:
        raise HeaderError("record length does not match its fields")
    return header


def check_record(
    header: memoryview,
    payload: Sequence[memoryview],
    payload_bytes: int,
    payload_checksum: int,
    seq: int,
    generation: int,
    namespace: bytes,
    key: bytes,
) -> ReadStatus:
    """Whether a record read back from disk is the one the index expects.

    The plain-Python twin of native/kvd_record.c: the same checks, in the
    same order, with the same verdicts (tests/l2/test_format.py holds them
    to it): the header must be valid, live (no tombstone, not a segment
    marker), of this generation and sequence number, for this namespace and
    key, and announce this payload, whose xxh3-64 must match.
    """
    size = len(header)
    if size not in (BLOCK_BYTES, HEADER_BYTES_MAX):
        return ReadStatus.BAD_HEADER
    (magic, version, flags, header_bytes, got_generation, got_seq, record_bytes, got_bytes,
     got_checksum, ns_len, key_len, parent_len, meta_len, _) = (
        _FIXED.unpack_from(header))  # fmt: skip
    if magic != MAGIC or version != VERSION or flags != 0 or header_bytes != size:
        return ReadStatus.BAD_HEADER
    (stored,) = struct.unpack_from("<Q", header, size - 8)
    if checksum(header[: size - 8]) != stored:
        return ReadStatus.BAD_HEADER
    if (got_generation, got_seq, got_bytes, got_checksum) != (
        generation,
        seq,
        payload_bytes,
        payload_checksum,
    ):
        return ReadStatus.BAD_HEADER
    body = _FIXED.size + ns_len + key_len + parent_len + meta_len
    if body + 8 > size or align_up(body + 8, BLOCK_BYTES) != size:
        return ReadStatus.BAD_HEADER
    if record_bytes != align_up(size + payload_bytes, RECORD_ALIGN_BYTES):
        return ReadStatus.BAD_HEADER
    pos = _FIXED.size
    if (ns_len, key_len) != (len(namespace), len(key)) or (
        header[pos : pos + ns_len] != namespace
        or header[pos + ns_len : pos + ns_len + key_len] != key
    ):
        return ReadStatus.BAD_HEADER
    views: list[memoryview] = []
    left = payload_bytes
    for view in payload:
        if left <= 0:
            break
        views.append(view[:left])
        left -= len(views[-1])
    if left > 0:
        return ReadStatus.SHORT
    if checksum_views(views) != payload_checksum:
        return ReadStatus.BAD_CHECKSUM
    return ReadStatus.OK
