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
  of records, each a logical range of a segment plus what its header and
  checksum must be, goes to the ring in one call with the stripe layout;
  the native code cuts each into one op per path, lands the header in a
  buffer of its own and checks each record without the GIL when its last
  op completes, returning one ``ReadStatus`` (or ``-errno``) per record.
  ``native_record_reads`` says whether a backend has it; the L2 tier reads
  and checks records in Python otherwise (``kvd.l2.reads``).
* At most ``depth`` ops are in flight. Further ops wait: on a semaphore in
  the thread backend; in the uring backend in one line (first come, first
  in) for room in the ring, so a record of several ops is never overtaken
  for good by single ops.
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
import collections
import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from kvd.io.ops import (
    BUFS_PER_OP_MAX,
    IoOp,
    OpKind,
    ReadStatus,
    RecordDone,
    RecordRead,
    StripeLayout,
)
from kvd.util.aio import settle

__all__ = [
    "BUFS_PER_OP_MAX", "DEPTH_MAX", "IoBackend", "IoError", "IoOp", "OpKind", "ReadStatus",
    "RecordDone", "RecordRead", "StripeLayout", "ThreadBackend", "UringBackend",
    "native_available", "native_copy_many", "native_record_check", "native_record_reads",
    "native_xxh3_64", "open_backend", "open_ring",
]  # fmt: skip

try:
    from kvd.io import _uring
except ImportError as exc:  # the extension is optional (built only where liburing is)
    _uring_import_error: str | None = f"kvd.io._uring is not built ({exc})"
else:
    _uring_import_error = None

logger = logging.getLogger("kvd.io")

DEPTH_MAX = 4096  # matches the native ring's DEPTH_MAX
THREADS_MAX = 256
OPS_PER_CALL_MAX = 65536  # one submit_many call; a 16 GiB segment scan in 256 KiB ops
# An op's or record read's user_data: this bit, then its batch's number and
# its index in the batch.
_RECORD_BIT = 1 << 62
_RECORD_INDEX_BITS = 20  # > OPS_PER_CALL_MAX records in one batch
_RECORD_INDEX_MASK = (1 << _RECORD_INDEX_BITS) - 1

if _uring_import_error is None:
    _NATIVE_STATUS = (_uring.READ_OK, _uring.READ_SHORT, _uring.READ_BAD_HEADER,
                      _uring.READ_BAD_CHECKSUM)  # fmt: skip
    assert tuple(ReadStatus) == _NATIVE_STATUS, "kvd.io._uring is out of date"
    assert _uring.BUFS_PER_OP_MAX == BUFS_PER_OP_MAX, "kvd.io._uring is out of date"


class IoError(OSError):
    """An I/O op failed; ``errno`` holds the kernel's code."""

    def __init__(self, code: int, what: str) -> None:
        super().__init__(code, f"{what}: {os.strerror(code)}")


ReadRecordsFn = Callable[[StripeLayout, Sequence[RecordRead], RecordDone], Awaitable[None]]


class _RecordBatch:
    """One call's ops or records (``_run``, ``read_records``): its callback,
    how many are still out, and a future done when none is (the call
    returns only then)."""

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
        self._slots = asyncio.Semaphore(depth)
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
    """kvd.io._uring on the asyncio loop: completions arrive through an eventfd.

    Room in the ring is ``depth - ring.inflight``. A call whose ops (or
    records) do not all fit pushes what fits and waits in one line, first
    come first in, until completions free room; the head of the line is
    woken when they do, pushes what fits then, and wakes the next once it
    has pushed everything. A record's ops go in together, so a record needing
    more room than is free holds the head until enough is.
    """

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
        self._batches: dict[int, _RecordBatch] = {}  # batches with ops or records in flight
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()
        self._next_batch = 0
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

    def _room(self) -> int:
        if self._closed:
            raise IoError(errno.ESHUTDOWN, "uring io backend is closed")
        return self._depth - self._ring.inflight

    async def _admit(self, push: Callable[[], bool]) -> None:
        """Call ``push`` (which pushes what fits and says whether all is in)
        until all is in, waiting in line for room between calls."""
        if not self._line and push():
            return
        # Behind those already waiting; at the front after a partial push.
        behind = bool(self._line)
        loop = asyncio.get_running_loop()
        while True:
            turn: asyncio.Future[None] = loop.create_future()
            if behind:
                self._line.append(turn)
            else:
                self._line.appendleft(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn in self._line:
                    self._line.remove(turn)
                elif turn.done() and not turn.cancelled():
                    self._wake()  # woken, then cancelled: the turn passes on
                raise
            if push():
                self._wake()  # room may be left for the next in line
                return
            behind = False

    def _wake(self) -> None:
        """Give the head of the line its turn when the ring has room."""
        while self._line and self._depth > self._ring.inflight:
            turn = self._line.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    def _submit_ops(self, ops: Sequence[IoOp], user_data: int) -> int:
        """Hand ops (that fit in the room) to the ring, numbered from ``user_data``."""
        native = [
            (int(op.kind), op.fd, op.offset,
             op.bufs[0] if len(op.bufs) == 1 else (tuple(op.bufs) if op.bufs else None),
             user_data + i)
            for i, op in enumerate(ops)
        ]  # fmt: skip
        accepted = self._ring.submit(native)
        assert accepted == len(native), (accepted, len(native))  # they fit: see _room
        return accepted

    def _retry_unsubmitted(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._ring.unsubmitted and not self._flush_scheduled:
            # The kernel took part of the batch (EAGAIN under memory
            # pressure); retry in 1 ms rather than spin.
            self._flush_scheduled = True
            loop.call_later(0.001, self._flush)

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
        self._wake()

    def _deliver(self, done: list[tuple[int, int]]) -> None:
        for user_data, result in done:
            number = (user_data - _RECORD_BIT) >> _RECORD_INDEX_BITS
            batch = self._batches[number]
            batch.on_done(user_data & _RECORD_INDEX_MASK, result)
            batch.left -= 1
            if batch.left == 0:
                del self._batches[number]
                if not batch.done.done():
                    batch.done.set_result(None)

    async def _run(self, ops: Sequence[IoOp]) -> list[int]:
        """Plain ops, as one batch: their results in order (no future per op)."""
        self._check_ops(ops)
        results = [0] * len(ops)
        if ops:
            await self._batch(
                len(ops), results.__setitem__,
                lambda first, user_data: self._submit_ops(
                    ops[first : first + self._room()], user_data
                ),
            )  # fmt: skip
        return results

    async def read_records(
        self, layout: StripeLayout, records: Sequence[RecordRead], on_done: RecordDone
    ) -> None:
        """Read and check records; ``on_done(index, status)`` as each one ends
        (a ``ReadStatus`` or ``-errno``). Returns once every record ended.

        Bad input (a field out of range, read-only or too few payload bytes,
        a record of more ops than the ring holds) raises ValueError or
        TypeError: nothing of the ring's call that met it went out, and the
        call returns only after records pushed before it ended."""
        if len(records) > OPS_PER_CALL_MAX:
            raise ValueError(f"at most {OPS_PER_CALL_MAX} records per call, got {len(records)}")
        self._room()  # closed?
        if records:
            native = layout.native
            await self._batch(
                len(records), on_done,
                lambda first, user_data: self._ring.submit_records(
                    native, records, first, user_data
                ),
            )  # fmt: skip

    async def _batch(
        self, count: int, on_done: RecordDone, push_some: Callable[[int, int], int]
    ) -> None:
        """Push ``count`` items, ops or records: ``push_some(first, user_data)``
        pushes what fits from item ``first`` on, numbered from ``user_data``,
        and says how many went; between pushes, wait in line for room.
        ``on_done(index, result)`` as each ends; returns once every one ended."""
        loop = self._bind()
        number = self._next_batch
        self._next_batch += 1
        base = _RECORD_BIT | (number << _RECORD_INDEX_BITS)
        batch = _RecordBatch(on_done, count, loop.create_future())
        pushed = 0

        def push() -> bool:
            nonlocal pushed
            if self._room() > 0:
                accepted = push_some(pushed, base + pushed)
                if accepted and not pushed:
                    self._batches[number] = batch
                pushed += accepted
                self._retry_unsubmitted(loop)
            return pushed == count

        try:
            await self._admit(push)
        except BaseException:
            batch.end(count - pushed)  # those never went out
            if batch.left == 0:
                self._batches.pop(number, None)
            await settle([batch.done])
            raise
        try:
            await batch.done
        except asyncio.CancelledError:
            # That cancelled batch.done; wait for the items still out on a
            # fresh one (settle absorbs further cancels), then re-raise.
            if batch.left:
                batch.done = loop.create_future()
                await settle([batch.done])
            raise

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
        # Callers still in line find the backend closed when woken.
        for turn in self._line:
            if not turn.done():
                turn.set_result(None)
        self._line.clear()


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


def native_density_learn() -> Callable[..., tuple[int, int]] | None:
    """The ``density`` eviction policy's per-key learning in C
    (``kvd.io._uring.density_learn``; kvd/store/eviction/density_learn.py),
    or None when not built."""
    return _uring.density_learn if _uring_import_error is None else None


def native_density_hazards() -> Callable[..., None] | None:
    """The ``density`` eviction policy's reuse hazards in C
    (``kvd.io._uring.density_hazards``; ``proportional_hazards``), or None
    when not built."""
    return _uring.density_hazards if _uring_import_error is None else None


def native_density_choose() -> Callable[..., list[int]] | None:
    """The rest of the ``density`` eviction policy's plan in C
    (``kvd.io._uring.density_choose``; ``choose``), or None when not built."""
    return _uring.density_choose if _uring_import_error is None else None


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
