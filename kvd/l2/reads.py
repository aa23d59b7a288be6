"""L2 record reads, batched: the reads of one event-loop turn go out together.

The store issues one read per value (a get, a promotion, a prefetch), many
of them in the same turn of the loop. ``RecordReads`` collects them and, on
the next turn, hands the whole batch to the io backend in one call: with
kvd.io._uring (``native_record_reads``) the ring cuts each record into one
op per path it is striped over, submits every op in one syscall, and checks
each record's header and checksum in C, without the GIL, as it completes;
otherwise this module cuts the ops (``StripeLayout.ops``), lands headers in
buffers of its own, sends the ops through ``submit_many`` and checks each
record with ``format.check_record``. Which one runs is chosen when the tier
starts and logged on ``kvd.l2``.

At 64 KiB a read's Python work, not the device, set the pace (kvd bench l2:
~12-14k reads/s at any depth, 0.1-0.2x fio on a RAM-backed loop device), so
the per-read work here is one tuple and one future; the rest is per batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvd.io.backend import (
    IoBackend,
    OpKind,
    ReadRecordsFn,
    ReadStatus,
    RecordDone,
    RecordRead,
    StripeLayout,
    native_record_reads,
)
from kvd.l2.devices import AlignedBuffer
from kvd.l2.format import HEADER_BYTES_MAX, check_record
from kvd.util.aio import settle

log = logging.getLogger("kvd.l2")

# Records in one backend call: a batch is also bounded by the io depth (the
# backend admits at most `depth` ops at a time), this only caps its list.
BATCH_RECORDS_MAX = 1024
CHECKS = ("auto", "python")


class _Turn:
    """The reads asked for in one loop turn, and the tasks that run them."""

    __slots__ = ("futs", "records", "tasks")

    def __init__(self) -> None:
        self.records: list[RecordRead] = []
        self.futs: list[asyncio.Future[int]] = []
        self.tasks: list[asyncio.Task[None]] = []


class RecordReads:
    """Batches record reads into one backend call per loop turn."""

    def __init__(self, io: IoBackend, layout: StripeLayout, checks: str = "auto") -> None:
        if checks not in CHECKS:
            raise ValueError(f"record checks must be one of {CHECKS}, got {checks!r}")
        native = native_record_reads(io) if checks == "auto" else None
        self._run: ReadRecordsFn = native if native is not None else self._read_checked
        self.native = native is not None
        self._io = io
        self._layout = layout
        self._turn: _Turn | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._headers: list[AlignedBuffer] = []  # the Python path's header buffers
        if self.native:
            log.info("L2 record reads: batched, checked in C (kvd.io._uring)")
        else:
            why = "requested" if checks == "python" else f"{io.name} io backend"
            log.info("L2 record reads: batched, checked in Python (%s)", why)

    async def read(self, record: RecordRead) -> int:
        """A ``ReadStatus`` or ``-errno``; returns only once the read's ops ended,
        cancelled or not, so the caller's buffers are free again."""
        loop = asyncio.get_running_loop()
        turn = self._turn
        if turn is None:
            turn = self._turn = _Turn()
            loop.call_soon(self._flush)
        fut: asyncio.Future[int] = loop.create_future()
        turn.records.append(record)
        turn.futs.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # Not sent yet: the flush skips it. Sent: wait until its ops ended.
            if turn.tasks:
                await settle(turn.tasks)
            raise

    async def read_batch(self, records: Sequence[RecordRead]) -> list[int]:
        """Many reads in one backend call (no waiting for the loop turn): one
        ``ReadStatus`` or ``-errno`` each, once every op of the batch ended."""
        statuses = [int(ReadStatus.SHORT)] * len(records)
        done: RecordDone = statuses.__setitem__  # a C call per record, no Python frame
        for start in range(0, len(records), BATCH_RECORDS_MAX):
            chunk = records[start : start + BATCH_RECORDS_MAX]
            await self._run(self._layout, chunk, done if start == 0 else _shifted(done, start))
        return statuses

    def _flush(self) -> None:
        turn, self._turn = self._turn, None
        assert turn is not None
        live = [i for i, fut in enumerate(turn.futs) if not fut.done()]
        loop = asyncio.get_running_loop()
        for start in range(0, len(live), BATCH_RECORDS_MAX):
            chunk = live[start : start + BATCH_RECORDS_MAX]
            task = loop.create_task(
                self._one([turn.records[i] for i in chunk], [turn.futs[i] for i in chunk])
            )
            turn.tasks.append(task)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, records: list[RecordRead], futs: list[asyncio.Future[int]]) -> None:
        def done(index: int, status: int) -> None:
            fut = futs[index]
            if not fut.done():
                fut.set_result(status)

        try:
            await self._run(self._layout, records, done)
        except asyncio.CancelledError:
            # Only at shutdown; the backend returned after its ops ended.
            for fut in futs:
                fut.cancel()
            raise
        except Exception as exc:
            for fut in futs:
                if not fut.done():
                    fut.set_exception(exc)

    async def _read_checked(
        self, layout: StripeLayout, records: Sequence[RecordRead], on_done: RecordDone
    ) -> None:
        """The plain-Python path: every op in one ``submit_many``, checks here."""
        headers = [self._headers.pop() if self._headers else AlignedBuffer(HEADER_BYTES_MAX)
                   for _ in records]  # fmt: skip
        try:
            views = [h.view[: r.header_bytes] for h, r in zip(headers, records, strict=True)]
            per_record = [
                layout.ops(OpKind.READ, r.segment, r.offset, [view, *r.payload])
                for r, view in zip(records, views, strict=True)
            ]
            results = iter(await self._io.submit_many([op for ops in per_record for op in ops]))
            for index, (record, ops, view) in enumerate(zip(records, per_record, views,
                                                            strict=True)):  # fmt: skip
                status: int = ReadStatus.OK
                for op in ops:
                    result = next(results)
                    if status == ReadStatus.OK and result < 0:
                        status = result
                    elif status == ReadStatus.OK and result != sum(len(b) for b in op.bufs):
                        status = ReadStatus.SHORT
                if status == ReadStatus.OK:
                    status = check_record(
                        view, record.payload, record.payload_bytes, record.checksum,
                        record.seq, record.generation, record.namespace.encode(), record.key,
                    )  # fmt: skip
                on_done(index, int(status))
            per_record.clear()
            views.clear()
        finally:
            self._headers += headers

    def close(self) -> None:
        for header in self._headers:
            header.close()
        self._headers = []


def _shifted(done: RecordDone, offset: int) -> RecordDone:
    def shifted(index: int, status: int) -> None:
        done(index + offset, status)

    return shifted
