"""Async block I/O for the L2 SSD tier: io_uring when built, threads otherwise.

The L2 tier reads and writes 64 KiB-aligned O_DIRECT runs between segment
files and pool pages. This is the only module that loads the native helper
``kvd.io._uring``; ``open_backend`` picks it when it imports and the kernel lets
us create a ring, and otherwise falls back to ``os.preadv``/``os.pwritev`` in a
bounded thread pool. The choice and its reason are logged on ``kvd.io``.

Both backends behave the same way:

* ``read``/``write`` return the bytes moved, which may be short (at EOF);
  callers check the count. Failures raise ``IoError`` with the kernel's errno.
* ``submit_many`` runs ops in parallel and returns one result per op, bytes
  moved or ``-errno``, never raising for a failed op.
* The uring backend also reads whole L2 records (``read_records``): a batch
  of records, each one or more read ops plus what its header and checksum
  must be, goes to the ring in one call, and the native code checks each
  record without the GIL when its last op completes, returning one
  ``ReadStatus`` (or ``-errno``) per record. ``native_record_reads`` says
  whether a backend has it; the L2 tier checks records in Python otherwise.
* At most ``depth`` ops are in flight; further ops wait on a semaphore.
* **Buffers are the kernel's until the op completes.** A call returns or
  raises, cancellation included, only after every op it submitted has
  finished: on ``CancelledError`` the call waits for its ops and re-raises.
  So when a caller's ``finally`` gives pool pages back, nothing can still
  write into them. The native ring also keeps each buffer exported
  (``PyObject_GetBuffer``) until completion, so the exporting mmap cannot be
  closed under the kernel either. The wait is bounded by the device's own
  command timeout (30 s per NVMe command by default), not by this module.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvd.util.aio import settle

try:
    from kvd.io import _uring
except ImportError as exc:  # the extension is optional (built only where liburing is)
    _uring_import_error: str | None = f"kvd.io._uring is not built ({exc})"
else:
    _uring_import_error = None

logger = logging.getLogger("kvd.io")

DEPTH_MAX = 4096  # matches the native ring's DEPTH_MAX
THREADS_MAX = 256
BUFS_PER_OP_MAX = 1024  # IOV_MAX on Linux
OPS_PER_CALL_MAX = 65536  # one submit_many call; a 16 GiB segment scan in 256 KiB ops


class ReadStatus(enum.IntEnum):
    """How a record read ended (besides ``-errno``); the native ring's READ_* values."""

    OK = 0
    SHORT = 1  # an op moved fewer bytes than asked for
    BAD_HEADER = 2  # not the header the index expects: torn, misdirected or deleted
    BAD_CHECKSUM = 3  # the payload does not match its checksum


if _uring_import_error is None:
    _NATIVE_STATUS = (_uring.READ_OK, _uring.READ_SHORT, _uring.READ_BAD_HEADER,
                      _uring.READ_BAD_CHECKSUM)  # fmt: skip
    assert tuple(ReadStatus) == _NATIVE_STATUS, "kvd.io._uring is out of date"


class IoError(OSError):
    """An I/O op failed; ``errno`` holds the kernel's code."""

    def __init__(self, code: int, what: str) -> None:
        super().__init__(code, f"{what}: {os.strerror(code)}")


class OpKind(enum.IntEnum):
    """Opcodes shared with the native ring."""

    READ = 0
    WRITE = 1
    FSYNC = 2
    FDATASYNC = 3


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


@dataclass(slots=True)
class RecordRead:
    """One L2 record read: ``ops`` land its header in ``header`` and its payload
    in ``payload`` (in order; at least ``payload_bytes`` long), and the header
    must announce this ``seq``, ``generation``, ``namespace`` and ``key`` and a
    payload of ``payload_bytes`` whose xxh3-64 is ``checksum``."""

    ops: Sequence[IoOp]
    header: memoryview
    payload: Sequence[memoryview]
    payload_bytes: int
    checksum: int
    seq: int
    generation: int
    namespace: bytes
    key: bytes


# on_done(index in the batch, ReadStatus or -errno), called as each record ends
RecordDone = Callable[[int, int], None]
ReadRecordsFn = Callable[[Sequence[RecordRead], RecordDone], Awaitable[None]]


class _RecordBatch:
    """One read_records call: its callback, how many records are still out,
    and a future done when none is (the call returns only then)."""

    __slots__ = ("done", "left", "on_done")

    def __init__(self, on_done: RecordDone, left: int, done: asyncio.Future[None]) -> None:
        self.on_done = on_done
        self.left = left
        self.done = done

    def end(self, count: int = 1) -> None:
        self.left -= count
        if self.left == 0 and not self.done.done():
            self.done.set_result(None)


class IoBackend(Protocol):
    """What the L2 tier needs from a block I/O engine."""

    name: str

    async def read(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int: ...
    async def write(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int: ...
    async def fsync(self, fd: int, *, data_only: bool = False) -> None: ...
    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]: ...
    def close(self) -> None: ...


async def _settle(futs: Sequence[asyncio.Future[int]]) -> list[int]:
    """The ops' results once every one ended, even if cancelled meanwhile: they
    run on caller buffers (kernel or worker thread), so returning early would
    hand those buffers back while they are still being written."""
    await settle(futs)
    return [f.result() for f in futs]


def _checked(result: int, what: str) -> int:
    if result < 0:
        raise IoError(-result, what)
    return result


class _BackendBase:
    """read/write/fsync on top of a backend's ``_run``."""

    name = "base"

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._slots = asyncio.Semaphore(depth)
        self._closed = False

    async def _run(self, ops: Sequence[IoOp]) -> list[int]:
        raise NotImplementedError

    async def read(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        (result,) = await self._run([IoOp(OpKind.READ, fd, offset, bufs)])
        return _checked(result, f"read fd={fd} offset={offset}")

    async def write(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        (result,) = await self._run([IoOp(OpKind.WRITE, fd, offset, bufs)])
        return _checked(result, f"write fd={fd} offset={offset}")

    async def fsync(self, fd: int, *, data_only: bool = False) -> None:
        kind = OpKind.FDATASYNC if data_only else OpKind.FSYNC
        (result,) = await self._run([IoOp(kind, fd)])
        _checked(result, f"fsync fd={fd}")

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        return await self._run(ops)

    def _check_ops(self, ops: Sequence[IoOp]) -> None:
        if self._closed:
            raise IoError(errno.ESHUTDOWN, f"{self.name} io backend is closed")
        if len(ops) > OPS_PER_CALL_MAX:
            raise ValueError(f"at most {OPS_PER_CALL_MAX} ops per call, got {len(ops)}")
        for op in ops:
            op.check()


def _run_blocking(op: IoOp) -> int:
    """One op in a worker thread; the os calls release the GIL."""
    try:
        if op.kind == OpKind.READ:
            return os.preadv(op.fd, op.bufs, op.offset)
        if op.kind == OpKind.WRITE:
            return os.pwritev(op.fd, op.bufs, op.offset)
        if op.kind == OpKind.FSYNC:
            os.fsync(op.fd)
        else:
            os.fdatasync(op.fd)
        return 0
    except OSError as exc:
        return -(exc.errno or errno.EIO)


class ThreadBackend(_BackendBase):
    """os.preadv/os.pwritev/os.fsync in a bounded ThreadPoolExecutor."""

    name = "threads"

    def __init__(self, depth: int, threads: int) -> None:
        super().__init__(depth)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvd-io")

    async def _run(self, ops: Sequence[IoOp]) -> list[int]:
        self._check_ops(ops)
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[int]] = []
        try:
            for op in ops:
                await self._slots.acquire()
                if self._closed:
                    self._slots.release()
                    raise IoError(errno.ESHUTDOWN, "threads io backend is closed")
                fut = loop.run_in_executor(self._pool, _run_blocking, op)
                fut.add_done_callback(lambda _f: self._slots.release())
                futs.append(fut)
        except BaseException:
            await _settle(futs)
            raise
        return await _settle(futs)

    def close(self) -> None:
        """Stop taking ops; wait for the ones already handed to threads."""
        self._closed = True
        self._pool.shutdown(wait=True)


class UringBackend(_BackendBase):
    """kvd.io._uring on the asyncio loop: completions arrive through an eventfd."""

    name = "uring"

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        if _uring_import_error is not None:
            raise RuntimeError(_uring_import_error)
        self._ring = _uring.Ring(depth)
        # Completions as task work run when the loop thread enters the kernel
        # (no IPI per completion): see native/kvd_uring.c.
        self.cooperative = self._ring.cooperative
        self._efd = self._ring.eventfd()
        self._waiting: dict[int, asyncio.Future[int]] = {}
        # user_data -> (batch, index in it, slots held) of each record read in flight
        self._records: dict[int, tuple[_RecordBatch, int, int]] = {}
        self._acquiring = asyncio.Lock()  # one read_records call admits at a time
        self._next_user_data = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self._efd, self._on_completions)
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("uring io backend is bound to another event loop")
        return loop

    def _push(
        self, loop: asyncio.AbstractEventLoop, ops: Sequence[IoOp]
    ) -> list[asyncio.Future[int]]:
        """Hand ops (each already holding a semaphore slot) to the ring."""
        if self._closed:
            raise IoError(errno.ESHUTDOWN, "uring io backend is closed")
        native: list[_uring.Op] = []
        for op in ops:
            bufs = op.bufs[0] if len(op.bufs) == 1 else (tuple(op.bufs) if op.bufs else None)
            user_data = self._next_user_data + len(native)
            native.append((int(op.kind), op.fd, op.offset, bufs, user_data))
        accepted = self._ring.submit(native)
        # The semaphore admits at most `depth` ops and a ring slot is freed
        # before its semaphore slot, so the ring always has room.
        assert accepted == len(native), (accepted, len(native))
        futs: list[asyncio.Future[int]] = []
        for item in native:
            fut: asyncio.Future[int] = loop.create_future()
            self._waiting[item[4]] = fut
            futs.append(fut)
        self._next_user_data += len(native)
        if self._ring.unsubmitted and not self._flush_scheduled:
            # The kernel took part of the batch (EAGAIN under memory
            # pressure); retry in 1 ms rather than spin.
            self._flush_scheduled = True
            loop.call_later(0.001, self._flush)
        return futs

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        self._ring.submit([])
        if self._ring.unsubmitted and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_later(0.001, self._flush)

    def _on_completions(self) -> None:
        try:
            os.read(self._efd, 8)
        except BlockingIOError:
            pass
        # No submits happen in here, so at most `depth` completions can be
        # waiting: two passes drain the ring. (A record's ops give one result
        # between them, so count completions by the slots they freed.)
        for _ in range(2):
            before = self._ring.inflight
            self._deliver(self._ring.reap(self._depth))
            if before - self._ring.inflight < self._depth:
                break

    def _deliver(self, done: list[tuple[int, int]]) -> None:
        for user_data, result in done:
            fut = self._waiting.pop(user_data, None)
            if fut is not None:
                self._slots.release()
                if not fut.done():
                    fut.set_result(result)
                continue
            batch, index, slots = self._records.pop(user_data)
            for _ in range(slots):
                self._slots.release()
            batch.on_done(index, result)
            batch.end()

    async def _run(self, ops: Sequence[IoOp]) -> list[int]:
        self._check_ops(ops)
        loop = self._bind()
        futs: list[asyncio.Future[int]] = []
        pending: list[IoOp] = []  # hold a semaphore slot, not yet in the ring
        try:
            for op in ops:
                if pending and self._slots.locked():
                    futs += self._push(loop, pending)
                    pending = []
                await self._slots.acquire()
                pending.append(op)
            if pending:
                futs += self._push(loop, pending)
                pending = []
        except BaseException:
            for _ in pending:
                self._slots.release()
            await _settle(futs)
            raise
        return await _settle(futs)

    def _push_records(
        self, loop: asyncio.AbstractEventLoop, records: Sequence[RecordRead],
        batch: _RecordBatch, first: int,
    ) -> None:  # fmt: skip
        """Hand records (holding a semaphore slot per op) to the ring in one call;
        ``first`` is the first one's index in ``batch``."""
        if self._closed:
            raise IoError(errno.ESHUTDOWN, "uring io backend is closed")
        native: list[_uring.Record] = []
        user_data = self._next_user_data
        for r in records:
            ops = [(op.fd, op.offset, op.bufs[0] if len(op.bufs) == 1 else tuple(op.bufs))
                   for op in r.ops]  # fmt: skip
            native.append((user_data, ops, r.header, r.payload, r.payload_bytes, r.checksum,
                           r.seq, r.generation, r.namespace, r.key))  # fmt: skip
            user_data += 1
        accepted = self._ring.submit_reads(native)
        assert accepted == len(native), (accepted, len(native))  # room: see _push
        for i, r in enumerate(records):
            self._records[self._next_user_data + i] = (batch, first + i, len(r.ops))
        self._next_user_data = user_data
        if self._ring.unsubmitted and not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_later(0.001, self._flush)

    async def read_records(self, records: Sequence[RecordRead], on_done: RecordDone) -> None:
        """Read and check records; ``on_done(index, status)`` as each one ends
        (a ``ReadStatus`` or ``-errno``). Returns once every record ended."""
        if self._closed:
            raise IoError(errno.ESHUTDOWN, "uring io backend is closed")
        if len(records) > OPS_PER_CALL_MAX:
            raise ValueError(f"at most {OPS_PER_CALL_MAX} records per call, got {len(records)}")
        for record in records:
            if not 1 <= len(record.ops) <= self._depth:
                raise ValueError(f"a record takes 1..{self._depth} ops, got {len(record.ops)}")
            for op in record.ops:
                op.check()
        if not records:
            return
        loop = self._bind()
        batch = _RecordBatch(on_done, len(records), loop.create_future())
        pushed = 0  # records in the ring
        pending: list[RecordRead] = []  # hold their semaphore slots, not yet in the ring
        held = 0  # slots held for the record being admitted
        try:
            # A record's ops go in together, so one call at a time admits
            # records: two taking turns could each hold part of a record's
            # slots and wait for the other's. Inside, admitted records go to
            # the ring before any wait for a slot, so the wait always ends.
            async with self._acquiring:
                for record in records:
                    for _ in record.ops:
                        if pending and self._slots.locked():
                            self._push_records(loop, pending, batch, pushed)
                            pushed += len(pending)
                            pending = []
                        await self._slots.acquire()
                        held += 1
                    pending.append(record)
                    held = 0
                if pending:
                    self._push_records(loop, pending, batch, pushed)
                    pushed += len(pending)
                    pending = []
        except BaseException:
            for _ in range(held + sum(len(r.ops) for r in pending)):
                self._slots.release()
            batch.end(len(records) - pushed)  # those never went out
            await settle([batch.done])
            raise
        await settle([batch.done])

    def close(self) -> None:
        """Stop taking ops, deliver the results of ops in flight, free the ring.

        Call it on the loop thread (or after the loop has stopped).
        """
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._efd)
        # Bounded like the native close: 600 waits of 100 ms.
        for _ in range(600):
            if not self._ring.inflight:
                break
            self._deliver(self._ring.reap(self._depth, self._ring.inflight, 100))
        self._ring.close()


def native_record_reads(io: IoBackend) -> ReadRecordsFn | None:
    """The backend's batched record reads checked in native code, or None."""
    return io.read_records if isinstance(io, UringBackend) else None


def native_record_check() -> Callable[..., int] | None:
    """The native record check on buffers in memory (``kvd.io._uring.check_record``,
    what ``read_records`` runs on each record), or None when not built."""
    return _uring.check_record if _uring_import_error is None else None


def native_xxh3_64() -> Callable[[bytes | bytearray | memoryview], int] | None:
    """The native checks' xxh3-64, or None when not built."""
    return _uring.xxh3_64 if _uring_import_error is None else None


# A batch of region copies: (span, pages) jobs, and which way; each job's xxh3-64.
CopyMany = Callable[[Sequence[tuple[Any, Sequence[Any]]], bool], list[int]]


def native_copy_many() -> CopyMany | None:
    """The native batch of region copies (``kvd.io._uring.copy_many``: the
    copies and their checksums in one call, without the GIL), or None when
    not built."""
    return _uring.copy_many if _uring_import_error is None else None


def open_ring(depth: int) -> _uring.Ring:
    """A bare native ring, for tests and benchmarks of the native layer."""
    if _uring_import_error is not None:
        raise RuntimeError(_uring_import_error)
    return _uring.Ring(depth)


@functools.cache
def native_available() -> tuple[bool, str]:
    """Whether the io_uring backend can run here, and why not when it cannot."""
    if _uring_import_error is not None:
        return False, _uring_import_error
    try:
        ring = _uring.Ring(2)
    except OSError as exc:  # ENOSYS (old kernel), EPERM (seccomp, io_uring_disabled)
        return False, f"io_uring_setup failed: {exc}"
    ring.close()
    return True, "kvd.io._uring loaded and io_uring_setup works"


def open_backend(kind: str = "auto", *, depth: int = 64, threads: int = 8) -> IoBackend:
    """Open a block I/O backend: ``auto`` (uring when possible), ``uring`` or ``threads``."""
    if kind not in ("auto", "uring", "threads"):
        raise ValueError(f"io backend must be auto, uring or threads, got {kind!r}")
    if not 1 <= depth <= DEPTH_MAX:
        raise ValueError(f"depth must be in 1..{DEPTH_MAX}, got {depth}")
    if not 1 <= threads <= THREADS_MAX:
        raise ValueError(f"threads must be in 1..{THREADS_MAX}, got {threads}")
    if kind in ("auto", "uring"):
        ok, reason = native_available()
        if ok:
            backend = UringBackend(depth)
            completions = "cooperative" if backend.cooperative else "interrupting (kernel < 5.19)"
            logger.info("io backend uring (depth=%d, %s completions): %s", depth, completions,
                        reason)  # fmt: skip
            return backend
        if kind == "uring":
            raise RuntimeError(f"io backend uring unavailable: {reason}")
        logger.info("io backend threads (depth=%d threads=%d): %s", depth, threads, reason)
    else:
        logger.info("io backend threads (depth=%d threads=%d): requested", depth, threads)
    return ThreadBackend(depth, threads)
