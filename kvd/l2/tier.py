"""The L2 SSD tier: an index over append-only segments, with appends,
verified reads, tombstones, reclaim and recovery.

Segments go FREE -> OPEN (appending) -> SEALED -> reclaimed (FIFO, oldest
first) -> OPEN again with a fresh random generation. An OPEN segment starts
with a segment record (flags SEGMENT) that carries its generation; it is
written and completed before any other record of that use, so a scan after
a crash never mistakes the previous use's records for live ones.

Reclaim never touches a segment with I/O in flight (a read that may still be
reading a record, or a tombstone being written) or with records pinned by a
lease; it drops the segment's records from the index and tells the owner
(``on_drop``), which re-queues the ones still in L1 (reinsertion of hot
blocks, bounded by L1's size).

Recovery reads each segment's first header; for a used segment it walks the
records, jumping by each record's length, and after an invalid header steps
64 KiB at a time looking for the next record of the same generation (a write
that failed in the middle of a segment leaves such a hole). When a key
appears twice the higher sequence number wins; tombstones hide records.

All state changes happen on the event loop; only the io backend moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import secrets
from collections.abc import Callable, Iterable, Sequence

from kvd.io.backend import IoBackend, IoError, IoOp, OpKind, ReadStatus, RecordRead
from kvd.l2.devices import AlignedBuffer, DeviceSet
from kvd.l2.format import (
    BLOCK_BYTES,
    FLAG_SEGMENT,
    FLAG_TOMBSTONE,
    HEADER_BYTES_MAX,
    RECORD_ALIGN_BYTES,
    RecordHeader,
    align_up,
)
from kvd.l2.group_sync import GroupSync
from kvd.l2.reads import RecordReads
from kvd.l2.records import (
    Append,
    ChecksumMismatch,
    Key,
    L2Counters,
    L2Full,
    L2Record,
    Segment,
    SegmentState,
)
from kvd.l2.scan import scan
from kvd.util import crashpoints

log = logging.getLogger("kvd.l2")

# Segments scanned at once during recovery: enough to keep every device busy.
RECOVERY_PARALLEL_SEGMENTS = 16
# How long an append waits for a reclaimable segment (all busy or pinned).
RECLAIM_WAIT_S = 5.0


class L2Tier:
    def __init__(self, devices: DeviceSet, io: IoBackend, record_checks: str = "auto") -> None:
        self.devices = devices
        self.io = io
        self.reads = RecordReads(io, devices.layout, record_checks)
        self.counters = L2Counters()
        self.index: dict[Key, L2Record] = {}
        self.segments = [Segment(i) for i in range(devices.segment_count)]
        # Every segment is free until recover() finds the ones in use.
        self._free: list[int] = list(range(devices.segment_count))
        self._sealed: list[int] = []  # oldest first
        self._open: Segment | None = None
        self._seq = 0
        self._opening: asyncio.Future[Segment] | None = None
        self._io_done = asyncio.Event()
        self._buffers: list[AlignedBuffer] = []
        self._syncs = GroupSync(self._sync_paths)
        self.on_drop: Callable[[L2Record], None] = lambda record: None
        # Told of each record indexed (True) and forgotten (False): the pool's KV events.
        self.on_record: Callable[[L2Record, bool], None] | None = None
        self.used_bytes = 0
        self.namespace_bytes: dict[str, int] = {}
        self._by_namespace: dict[str, dict[bytes, L2Record]] = {}

    # ---- queries ---------------------------------------------------------------
    def lookup(self, namespace: str, key: bytes) -> L2Record | None:
        return self.index.get((namespace, key))

    def holds(self, namespace: str, keys: Iterable[bytes]) -> list[bool]:
        """Whether each key has a record here."""
        index = self.index
        return [(namespace, key) in index for key in keys]

    @property
    def capacity_bytes(self) -> int:
        return self.devices.capacity_bytes

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "l2_bytes": self.capacity_bytes,
            "l2_used_bytes": self.used_bytes,
            "l2_free_bytes": self.capacity_bytes - self.used_bytes,
            "l2_entries": len(self.index),
            "l2_segments_free": len(self._free),
            "l2_writes": c.writes,
            "l2_write_bytes": c.write_bytes,
            "l2_write_errors": c.write_errors,
            "l2_reads": c.reads,
            "l2_read_bytes": c.read_bytes,
            "l2_read_errors": c.read_errors,
            "checksum_failures": c.checksum_failures,
            "l2_reclaims": c.reclaims,
            "l2_reclaimed_records": c.reclaimed_records,
        }

    # ---- pins (leases on L2-only hits) -----------------------------------------
    def pin(self, record: L2Record) -> None:
        record.pins += 1
        self.segments[record.segment].pinned += 1

    def unpin(self, record: L2Record) -> None:
        record.pins -= 1
        self.segments[record.segment].pinned -= 1
        assert record.pins >= 0
        self._io_done.set()

    # ---- append ----------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _header_buffer(self) -> AlignedBuffer:
        return self._buffers.pop() if self._buffers else AlignedBuffer(HEADER_BYTES_MAX)

    async def append(
        self,
        namespace: str,
        key: bytes,
        parent: bytes,
        meta: bytes,
        size: int,
        payload_checksum: int,
        payload: Sequence[memoryview],
    ) -> L2Record:
        """Write one record (``append_many`` of one); raises IoError (errno
        kept) or L2Full."""
        item = Append(namespace, key, parent, meta, size, payload_checksum, payload)
        (outcome,) = await self.append_many([item])
        if isinstance(outcome, L2Record):
            return outcome
        raise outcome

    async def append_many(self, items: Sequence[Append]) -> list[L2Record | IoError | L2Full]:
        """Write records, all in one submission: for each, its record or the
        IoError (errno kept) or L2Full it met. Records take their room in
        turn; when one finds none (or opening a segment fails), it and the
        records after it fail, and those before are still written. The index
        only ever holds records whose write completed."""
        outcomes: list[L2Record | IoError | L2Full | None] = [None] * len(items)
        placed: list[tuple[int, Segment, int, RecordHeader, AlignedBuffer]] = []
        try:
            for index, item in enumerate(items):
                try:
                    placed.append((index, *await self._place(item)))
                except (IoError, L2Full) as exc:
                    if isinstance(exc, IoError) and exc.errno == errno.EFBIG:
                        outcomes[index] = exc  # this record alone can never be written
                        continue
                    outcomes[index:] = [exc] * (len(items) - index)
                    break
            writes = [
                (segment.index, offset, [buffer.view[: header.header_bytes], *items[i].payload])
                for i, segment, offset, header, buffer in placed
            ]
            failures = await self._write_many(writes)
        finally:
            for _, segment, _, _, buffer in placed:
                segment.io_inflight -= 1
                self._buffers.append(buffer)
            self._io_done.set()
        for (index, segment, offset, header, _), failure in zip(placed, failures, strict=True):
            if failure is not None:
                outcomes[index] = failure
                continue
            crashpoints.hit("after_payload_write")
            item = items[index]
            record = L2Record(
                item.namespace, item.key, item.parent, item.meta, item.size, item.checksum,
                header.seq, segment.index, offset, header.header_bytes,
            )  # fmt: skip
            self.counters.writes += 1
            self.counters.write_bytes += item.size
            if segment.state is not SegmentState.FREE and segment.generation == header.generation:
                self._publish(segment, record, header.record_bytes)
            outcomes[index] = record
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(items)
        return done

    async def _place(self, item: Append) -> tuple[Segment, int, RecordHeader, AlignedBuffer]:
        """Room for ``item``'s record (its segment held busy until the caller's
        write ends), and its header encoded into a buffer."""
        assert sum(len(v) for v in item.payload) == align_up(item.size, BLOCK_BYTES)
        header = RecordHeader(item.namespace, item.key, item.parent, item.meta, 0, 0,
                              item.size, item.checksum)  # fmt: skip
        record_bytes = header.record_bytes
        if record_bytes > self.devices.logical_segment_bytes - RECORD_ALIGN_BYTES:
            raise IoError(errno.EFBIG, f"record of {record_bytes} bytes is larger than a segment")
        segment = await self._room_for(record_bytes)
        offset = segment.write_pos
        segment.write_pos += record_bytes
        segment.io_inflight += 1  # no reclaim of it, even by this batch's next room
        header = RecordHeader(
            item.namespace, item.key, item.parent, item.meta, segment.generation,
            self._next_seq(), item.size, item.checksum,
        )  # fmt: skip
        buffer = self._header_buffer()
        encoded = header.encode()
        buffer.view[: len(encoded)] = encoded
        return segment, offset, header, buffer

    def _publish(self, segment: Segment, record: L2Record, record_bytes: int) -> None:
        key = (record.namespace, record.key)
        old = self.index.get(key)
        if old is not None:
            if old.seq > record.seq:
                return
            self._forget(old)
        self.index[key] = record
        segment.records[key] = record
        self.used_bytes += record_bytes
        self.namespace_bytes[record.namespace] = (
            self.namespace_bytes.get(record.namespace, 0) + record_bytes
        )
        self._by_namespace.setdefault(record.namespace, {})[record.key] = record
        if self.on_record is not None:
            self.on_record(record, True)

    async def _write(self, segment: int, offset: int, views: Sequence[memoryview]) -> None:
        """One L2 write (segment markers, tombstones); raises its IoError."""
        (failure,) = await self._write_many([(segment, offset, views)])
        if failure is not None:
            raise failure

    async def _write_many(
        self, writes: Sequence[tuple[int, int, Sequence[memoryview]]]
    ) -> list[IoError | None]:
        """Every L2 write goes through here: each (segment, offset, views), all
        in one submission; each one's IoError or None. Failures are counted
        here, once per write however many paths failed."""
        if not writes:
            return []
        ops = [self.devices.ops(OpKind.WRITE, *write) for write in writes]
        try:
            results = await self.io.submit_many([op for per_write in ops for op in per_write])
        except IoError as exc:
            self.counters.write_errors += len(writes)
            return [exc] * len(writes)
        failures: list[IoError | None] = []
        at = 0
        for (segment, _, _), per_write in zip(writes, ops, strict=True):
            failures.append(_write_failure(segment, per_write, results[at : at + len(per_write)]))
            at += len(per_write)
        self.counters.write_errors += len(failures) - failures.count(None)
        return failures

    async def _room_for(self, record_bytes: int) -> Segment:
        segment = self._open
        if segment is not None and segment.write_pos + record_bytes <= (
            self.devices.logical_segment_bytes
        ):
            return segment
        if segment is not None:
            segment.state = SegmentState.SEALED
            self._sealed.append(segment.index)
            self._open = None
        # One opener at a time; the others wait for its segment and recheck.
        while self._opening is not None:
            await asyncio.shield(self._opening)
            if self._open is not None and self._open.write_pos + record_bytes <= (
                self.devices.logical_segment_bytes
            ):
                return self._open
        loop = asyncio.get_running_loop()
        self._opening = loop.create_future()
        try:
            segment = await self._open_segment()
        except BaseException as exc:
            self._opening.set_exception(exc)
            self._opening.exception()  # retrieved: waiters re-raise their own
            raise
        finally:
            opening, self._opening = self._opening, None
        if not opening.done():
            opening.set_result(segment)
        self._open = segment
        return segment

    async def _open_segment(self) -> Segment:
        index = self._free.pop(0) if self._free else await self._reclaim()
        segment = self.segments[index]
        segment.generation = secrets.randbits(63) | 1
        segment.first_seq = self._next_seq()
        marker = RecordHeader("", b"", b"", b"", segment.generation, segment.first_seq, 0, 0,
                              FLAG_SEGMENT)  # fmt: skip
        buffer = self._header_buffer()
        encoded = marker.encode()
        buffer.view[: len(encoded)] = encoded
        try:
            await self._write(index, 0, [buffer.view[: len(encoded)]])
        except BaseException:
            segment.state = SegmentState.FREE
            self._free.append(index)
            raise
        finally:
            self._buffers.append(buffer)
        segment.state = SegmentState.OPEN
        segment.write_pos = RECORD_ALIGN_BYTES
        return segment

    async def _reclaim(self) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECLAIM_WAIT_S
        while True:
            if not self._sealed:
                raise L2Full("no sealed L2 segment to reclaim")
            for position, index in enumerate(self._sealed):
                segment = self.segments[index]
                if segment.io_inflight == 0 and segment.pinned == 0:
                    del self._sealed[position]
                    self._drop_segment(segment)
                    return index
            self._io_done.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise L2Full("every L2 segment is pinned by a lease or busy")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._io_done.wait(), left)

    def _drop_segment(self, segment: Segment) -> None:
        records = list(segment.records.values())
        for record in records:
            self._forget(record)
        self.counters.reclaims += 1
        self.counters.reclaimed_records += len(records)
        segment.state = SegmentState.FREE
        segment.records = {}
        for record in records:
            self.on_drop(record)

    def _forget(self, record: L2Record) -> None:
        """Drop a record from the index (not from disk)."""
        key = (record.namespace, record.key)
        if self.index.get(key) is record:
            del self.index[key]
            if self.on_record is not None:
                self.on_record(record, False)
        segment = self.segments[record.segment]
        if segment.records.get(key) is record:
            del segment.records[key]
            header = RecordHeader(record.namespace, record.key, record.parent, record.meta, 0, 0,
                                  record.size, 0)  # fmt: skip
            self.used_bytes -= header.record_bytes
            self.namespace_bytes[record.namespace] -= header.record_bytes
            records = self._by_namespace[record.namespace]
            del records[record.key]
            if not records:
                del self._by_namespace[record.namespace]
                del self.namespace_bytes[record.namespace]
        record.live = False

    def oldest(self, namespace: str) -> L2Record | None:
        """The namespace's oldest live record (quota eviction goes oldest first)."""
        records = self._by_namespace.get(namespace)
        return next(iter(records.values())) if records else None

    def namespaces(self) -> list[str]:
        """The namespaces with a live record here."""
        return list(self._by_namespace)

    def keys_of(self, namespace: str) -> list[bytes]:
        return list(self._by_namespace.get(namespace, ()))

    # ---- read ------------------------------------------------------------------
    async def read(self, record: L2Record, views: Sequence[memoryview]) -> None:
        """Read a payload into ``views`` (``record.read_bytes`` long) and verify it.

        The header comes along in the same op and is checked too: one that
        is not this record's (torn, a later use of the segment, a tombstone)
        or a payload that fails its checksum raises ChecksumMismatch; a
        failed or short read raises IoError (errno kept). Either drops the
        record and is counted. Reads of one loop turn go out as one batch.
        """
        segment = self.segments[record.segment]
        segment.io_inflight += 1
        try:
            status = await self.reads.read(_record_read(record, segment, views))
        finally:
            segment.io_inflight -= 1
            self._io_done.set()
        error = self._outcome(record, status)
        if error is not None:
            raise error

    async def read_many(
        self, items: Sequence[tuple[L2Record, Sequence[memoryview]]]
    ) -> list[Exception | None]:
        """``read`` for many records in one backend call: per item None, or the
        exception ``read`` would have raised (ChecksumMismatch or IoError)."""
        segments = self.segments
        reads: list[RecordRead] = []
        try:
            for record, views in items:
                segment = segments[record.segment]
                reads.append(_record_read(record, segment, views))
                segment.io_inflight += 1
            statuses = await self.reads.read_batch(reads)
        finally:
            for read in reads:
                segments[read.segment].io_inflight -= 1
            self._io_done.set()
        counters = self.counters
        errors: list[Exception | None] = [None] * len(reads)
        if not any(statuses):  # every one ReadStatus.OK: _outcome's first lines, summed
            counters.reads += len(reads)
            counters.read_bytes += sum([record.size for record, _ in items])
            return errors
        for index, status in enumerate(statuses):
            errors[index] = self._outcome(items[index][0], status)
        return errors

    def _outcome(self, record: L2Record, status: int) -> Exception | None:
        """Count a finished read; a failed one drops its record and becomes an error."""
        self.counters.reads += 1
        if status == ReadStatus.OK:
            self.counters.read_bytes += record.size
            return None
        if status >= ReadStatus.BAD_HEADER and not record.live:
            # Deleted while it was read: delete_record writes a tombstone over
            # the header in place (a soak met this once in ~20k ops). A miss.
            return ChecksumMismatch(
                f"L2 record {record.key.hex()} was deleted: its header is a tombstone"
            )
        self.discard(record)
        if status < 0 or status == ReadStatus.SHORT:
            self.counters.read_errors += 1
            return IoError(-status if status < 0 else errno.EIO, "L2 read")
        self.counters.checksum_failures += 1
        what = "header" if status == ReadStatus.BAD_HEADER else "checksum"
        return ChecksumMismatch(f"L2 record {record.key.hex()} failed its {what} check")

    def discard(self, record: L2Record) -> None:
        """Forget a bad record (it stays on disk; its checksum keeps failing)."""
        if record.live:
            self._forget(record)
            self.on_drop(record)

    # ---- delete ----------------------------------------------------------------
    async def delete(self, namespace: str, key: bytes) -> bool:
        """Forget a key and mark its record deleted on disk (no resurrection on restart)."""
        record = self.index.get((namespace, key))
        if record is None:
            return False
        await self.delete_record(record)
        return True

    async def delete_record(self, record: L2Record) -> None:
        """Forget one record (if still indexed) and write its tombstone."""
        self._forget(record)
        segment = self.segments[record.segment]
        generation = segment.generation
        tomb = RecordHeader(record.namespace, record.key, record.parent, record.meta, generation,
                            record.seq, record.size, record.checksum, FLAG_TOMBSTONE)  # fmt: skip
        buffer = self._header_buffer()
        encoded = tomb.encode()
        buffer.view[: len(encoded)] = encoded
        segment.io_inflight += 1
        try:
            if segment.generation == generation:  # reclaim waits for io_inflight == 0
                await self._write(record.segment, record.offset, [buffer.view[: len(encoded)]])
                self.counters.tombstones += 1
        finally:
            segment.io_inflight -= 1
            self._buffers.append(buffer)
            self._io_done.set()

    async def sync(self) -> None:
        """Make every completed write durable (fdatasync on each path); callers
        at about the same time share one (``GroupSync``)."""
        await self._syncs.sync()

    async def _sync_paths(self) -> None:
        await asyncio.gather(*(self.io.fsync(fd, data_only=True) for fd in self.devices.fds()))
        self.counters.syncs += 1

    # ---- recovery --------------------------------------------------------------
    async def recover(self) -> int:
        """Rebuild the index from the segments on disk; the number of records found."""
        found: list[tuple[Segment, list[RecordHeader], list[int]]] = []
        semaphore = asyncio.Semaphore(RECOVERY_PARALLEL_SEGMENTS)

        async def one(segment: Segment) -> None:
            async with semaphore:
                buffer = self._header_buffer()
                try:
                    headers, offsets = await scan(self.devices, self.io, buffer, segment)
                finally:
                    self._buffers.append(buffer)
                found.append((segment, headers, offsets))

        await asyncio.gather(*(one(s) for s in self.segments))
        used = sorted((s for s, _, _ in found if s.state is SegmentState.SEALED),
                      key=lambda s: s.first_seq)  # fmt: skip
        self._sealed = [s.index for s in used]
        self._free = sorted(s.index for s in self.segments if s.state is SegmentState.FREE)
        for segment in used:
            self._seq = max(self._seq, segment.first_seq)
        if used and used[-1].tail + RECORD_ALIGN_BYTES <= self.devices.logical_segment_bytes:
            # Keep appending where the last run stopped, rather than seal a
            # half-empty segment and reclaim an old one for every restart.
            newest = used[-1]
            self._sealed.pop()
            newest.state = SegmentState.OPEN
            newest.write_pos = newest.tail
            self._open = newest
        tombstones: dict[Key, int] = {}
        for segment, headers, offsets in found:
            for header, offset in zip(headers, offsets, strict=True):
                self._seq = max(self._seq, header.seq)
                key = (header.namespace, header.key)
                if header.flags & FLAG_TOMBSTONE:
                    # A tombstone carries the seq of the record it deletes.
                    tombstones[key] = max(tombstones.get(key, 0), header.seq)
                    continue
                record = L2Record(
                    header.namespace, header.key, header.parent, header.meta, header.payload_bytes,
                    header.payload_checksum, header.seq, segment.index, offset, header.header_bytes,
                )  # fmt: skip
                self._publish(segment, record, header.record_bytes)
        for key, seq in tombstones.items():
            stored = self.index.get(key)
            if stored is not None and stored.seq <= seq:
                self._forget(stored)
        self.counters.recovered_records = len(self.index)
        return len(self.index)

    def close(self) -> None:
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []
        self.reads.close()


def _write_failure(segment: int, ops: Sequence[IoOp], results: Sequence[int]) -> IoError | None:
    """The error of a write whose ops returned ``results``; None when each wrote all its bytes."""
    for op, result in zip(ops, results, strict=True):
        want = sum(len(b) for b in op.bufs)
        if result < 0:
            return IoError(-result, f"L2 write of segment {segment}")
        if result != want:
            return IoError(errno.EIO, f"short L2 write: {result} of {want} bytes")
    return None


def _record_read(record: L2Record, segment: Segment, views: Sequence[memoryview]) -> RecordRead:
    """What the io backend needs to read ``record`` into ``views`` (``record.read_bytes``
    long) and check it. Views shorter than the value are refused by the native
    ring and a short read to the Python checks; a read past the segment is
    refused by both."""
    return RecordRead(record.segment, record.offset, record.header_bytes, views, record.size,
                      record.checksum, record.seq, segment.generation, record.namespace,
                      record.key)  # fmt: skip
