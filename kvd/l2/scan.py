"""Walking a segment's records on disk, for recovery (``L2Tier.recover``);
``header_at`` also serves ``kvd fsck``.

A segment in use starts with a segment marker that carries its generation;
the walk then jumps from record to record by each one's length, and after a
header that is not valid, or not of this generation (an older use of the
segment, or a torn write), steps 64 KiB at a time looking for the next
valid one, so a failed write in the middle loses only itself
(docs/l2-format.md).
"""

from __future__ import annotations

from kvd.io.backend import IoBackend, OpKind
from kvd.l2.devices import AlignedBuffer, DeviceSet
from kvd.l2.format import (
    BLOCK_BYTES,
    FLAG_SEGMENT,
    MAGIC,
    RECORD_ALIGN_BYTES,
    HeaderError,
    RecordHeader,
    decode,
    header_bytes_at,
)
from kvd.l2.records import Segment, SegmentState


async def header_at(
    devices: DeviceSet, io: IoBackend, buffer: AlignedBuffer, segment: int, offset: int
) -> tuple[RecordHeader | None, bool] | None:
    """The valid record header at ``offset`` of ``segment`` (read into
    ``buffer``, of ``HEADER_BYTES_MAX``) or None, and whether its magic is
    there; None when the read came back short (recovery skips the place,
    fsck reports it)."""
    view = buffer.view[:BLOCK_BYTES]
    ops = devices.ops(OpKind.READ, segment, offset, [view])
    if (await io.submit_many(ops)) != [BLOCK_BYTES] * len(ops):
        return None
    magic = bytes(view[: len(MAGIC)]) == MAGIC
    size = header_bytes_at(view)
    if not size:
        return None, magic
    if size > BLOCK_BYTES:
        rest = buffer.view[BLOCK_BYTES:size]
        ops = devices.ops(OpKind.READ, segment, offset + BLOCK_BYTES, [rest])
        if sum(await io.submit_many(ops)) != size - BLOCK_BYTES:
            return None
    try:
        return decode(buffer.view[:size]), magic
    except HeaderError:
        return None, magic


async def _header(
    devices: DeviceSet, io: IoBackend, buffer: AlignedBuffer, segment: int, offset: int
) -> RecordHeader | None:
    found = await header_at(devices, io, buffer, segment, offset)
    return found[0] if found is not None else None


async def scan(
    devices: DeviceSet, io: IoBackend, buffer: AlignedBuffer, segment: Segment
) -> tuple[list[RecordHeader], list[int]]:
    """The valid records of ``segment`` of its current use, and their offsets;
    sets its state (FREE without a marker, else SEALED), generation, first
    sequence number and tail (the end of its last valid record)."""
    first = await _header(devices, io, buffer, segment.index, 0)
    if first is None or not first.flags & FLAG_SEGMENT:
        segment.state = SegmentState.FREE
        return [], []
    segment.state = SegmentState.SEALED
    segment.generation = first.generation
    segment.first_seq = first.seq
    headers: list[RecordHeader] = []
    offsets: list[int] = []
    offset = tail = RECORD_ALIGN_BYTES
    end = devices.logical_segment_bytes
    while offset + BLOCK_BYTES <= end:
        header = await _header(devices, io, buffer, segment.index, offset)
        if header is None or header.generation != first.generation or header.flags & FLAG_SEGMENT:
            offset += RECORD_ALIGN_BYTES
            continue
        if offset + header.record_bytes > end:
            break
        headers.append(header)
        offsets.append(offset)
        offset += header.record_bytes
        tail = offset
    # Sealed for now; recover() reopens the newest segment at its tail.
    segment.write_pos = end
    segment.tail = tail
    return headers, offsets
