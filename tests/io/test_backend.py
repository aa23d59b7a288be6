"""Tests for kvd.io.backend (both backends) and the native ring under it.

Every test runs against the real kernel: O_DIRECT files on a real file
system, pipes where an op must stay in flight on purpose.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import random
import shutil
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from kvd.io import backend as iobackend
from kvd.io.backend import (
    IoBackend,
    IoError,
    IoOp,
    OpKind,
    RecordRead,
    StripeLayout,
    native_available,
    open_backend,
)
from kvd.tools.bench import backends as bench_io

PAGE_BYTES = 64 * 1024
ARENA_PAGES = 64
TEST_TIMEOUT_S = 30.0
REPO_BUILD_DIR = Path(__file__).resolve().parents[2] / "build"
NATIVE_OK, NATIVE_REASON = native_available()
needs_native = pytest.mark.skipif(not NATIVE_OK, reason=NATIVE_REASON)
log = logging.getLogger(__name__)

T = TypeVar("T")


def _accepts_o_direct(directory: Path) -> bool:
    probe = directory / f".odirect-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # tmpfs and friends
            return False
        raise
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose file system takes O_DIRECT (tmp_path, else build/)."""
    if _accepts_o_direct(tmp_path):
        yield tmp_path
        return
    fallback = REPO_BUILD_DIR / "test-iobackend" / uuid.uuid4().hex
    fallback.mkdir(parents=True)
    log.warning("%s refuses O_DIRECT; using %s", tmp_path, fallback)
    try:
        yield fallback
    finally:
        shutil.rmtree(fallback, ignore_errors=True)


@pytest.fixture
def direct_fd(direct_dir: Path) -> Iterator[int]:
    fd = os.open(direct_dir / "segment", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.fixture
def arena() -> Iterator[memoryview]:
    """Page-aligned memory, like the pool's arena."""
    region = mmap.mmap(-1, ARENA_PAGES * PAGE_BYTES)
    view = memoryview(region)
    yield view
    view.release()
    try:
        region.close()
    except BufferError:
        pass  # a failed test's traceback still holds slices; the GC closes it


@pytest.fixture(params=["uring", "threads"])
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name == "uring" and not NATIVE_OK:
        pytest.skip(NATIVE_REASON)
    return name


def run_with(kind: str, body: Callable[[IoBackend], Awaitable[T]], *, depth: int = 16) -> T:
    """Run body(backend) on a fresh debug-mode loop, closing the backend on that loop."""

    async def main() -> T:
        backend = open_backend(kind, depth=depth, threads=4)
        try:
            return await body(backend)
        finally:
            backend.close()

    async def bounded() -> T:
        return await asyncio.wait_for(main(), TEST_TIMEOUT_S)

    return asyncio.run(bounded(), debug=True)


def pages(arena: memoryview, first: int, count: int) -> memoryview:
    return arena[first * PAGE_BYTES : (first + count) * PAGE_BYTES]


def fill_random(view: memoryview, seed: int) -> bytes:
    data = random.Random(seed).randbytes(len(view))
    view[:] = data
    return data


# ---- both backends -------------------------------------------------------


def test_write_then_read_back(kind: str, direct_fd: int, arena: memoryview) -> None:
    src, dst = pages(arena, 0, 8), pages(arena, 8, 8)
    data = fill_random(src, seed=1)

    async def body(backend: IoBackend) -> tuple[int, int]:
        written = await backend.write(direct_fd, 16 * PAGE_BYTES, [src])
        read = await backend.read(direct_fd, 16 * PAGE_BYTES, [dst])
        return written, read

    assert run_with(kind, body) == (len(data), len(data))
    assert bytes(dst) == data


def test_vectored_ops_fill_buffers_in_order(kind: str, direct_fd: int, arena: memoryview) -> None:
    # Scattered source runs, gathered back with a different split.
    src = [pages(arena, 4, 1), pages(arena, 1, 2), pages(arena, 7, 1)]
    data = b"".join(fill_random(view, seed=10 + i) for i, view in enumerate(src))
    dst = [pages(arena, 20, 3), pages(arena, 30, 1)]

    async def body(backend: IoBackend) -> tuple[int, int]:
        return await backend.write(direct_fd, 0, src), await backend.read(direct_fd, 0, dst)

    assert run_with(kind, body) == (4 * PAGE_BYTES, 4 * PAGE_BYTES)
    assert bytes(dst[0]) + bytes(dst[1]) == data


def test_submit_many_runs_more_ops_than_depth(kind: str, direct_fd: int, arena: memoryview) -> None:
    n = 32
    data = [fill_random(pages(arena, i, 1), seed=100 + i) for i in range(n)]
    writes = [IoOp(OpKind.WRITE, direct_fd, i * PAGE_BYTES, [pages(arena, i, 1)]) for i in range(n)]
    # Read back in reverse page order to catch results matched to the wrong op.
    reads = [
        IoOp(OpKind.READ, direct_fd, i * PAGE_BYTES, [pages(arena, 2 * n - 1 - i, 1)])
        for i in range(n)
    ]

    async def body(backend: IoBackend) -> tuple[list[int], list[int]]:
        return await backend.submit_many(writes), await backend.submit_many(reads)

    written, read = run_with(kind, body, depth=4)
    assert written == [PAGE_BYTES] * n
    assert read == [PAGE_BYTES] * n
    for i in range(n):
        assert bytes(pages(arena, 2 * n - 1 - i, 1)) == data[i]


def test_submit_many_reports_each_failure_in_place(
    kind: str, direct_fd: int, arena: memoryview
) -> None:
    fill_random(pages(arena, 0, 2), seed=3)

    async def body(backend: IoBackend) -> list[int]:
        # Closed after the backend opened its own fds, so the number stays free.
        bad_fd = os.open(os.devnull, os.O_RDONLY)
        os.close(bad_fd)
        return await backend.submit_many(
            [
                IoOp(OpKind.WRITE, direct_fd, 0, [pages(arena, 0, 2)]),
                IoOp(OpKind.READ, bad_fd, 0, [pages(arena, 2, 1)]),
                IoOp(OpKind.FSYNC, direct_fd),
            ]
        )

    assert run_with(kind, body) == [2 * PAGE_BYTES, -errno.EBADF, 0]


def test_short_read_at_eof_is_reported_short(kind: str, direct_fd: int, arena: memoryview) -> None:
    data = fill_random(pages(arena, 0, 3), seed=4)

    async def body(backend: IoBackend) -> tuple[int, int, int]:
        await backend.write(direct_fd, 0, [pages(arena, 0, 3)])
        short = await backend.read(direct_fd, 0, [pages(arena, 10, 4)])
        vectored = await backend.read(direct_fd, PAGE_BYTES, [pages(arena, 20, 1)] * 3)
        past_eof = await backend.read(direct_fd, 8 * PAGE_BYTES, [pages(arena, 30, 1)])
        return short, vectored, past_eof

    assert run_with(kind, body) == (3 * PAGE_BYTES, 2 * PAGE_BYTES, 0)
    assert bytes(pages(arena, 10, 3)) == data


def test_closed_fd_raises_ebadf(kind: str, direct_dir: Path, arena: memoryview) -> None:
    async def body(backend: IoBackend) -> list[int | None]:
        fd = os.open(direct_dir / "gone", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
        codes: list[int | None] = []
        for attempt in (
            backend.read(fd, 0, [pages(arena, 0, 1)]),
            backend.write(fd, 0, [pages(arena, 0, 1)]),
            backend.fsync(fd),
        ):
            with pytest.raises(IoError) as caught:
                await attempt
            assert isinstance(caught.value, OSError)
            codes.append(caught.value.errno)
        return codes

    assert run_with(kind, body) == [errno.EBADF] * 3


def test_misaligned_direct_io_surfaces_einval(kind: str, direct_fd: int, arena: memoryview) -> None:
    async def body(backend: IoBackend) -> list[int | None]:
        await backend.write(direct_fd, 0, [pages(arena, 0, 2)])
        codes: list[int | None] = []
        for offset, buf in (
            (0, arena[1 : PAGE_BYTES + 1]),  # buffer address off by one byte
            (1, pages(arena, 2, 1)),  # file offset off by one byte
            (0, arena[: PAGE_BYTES - 1]),  # length off by one byte
        ):
            with pytest.raises(IoError) as caught:
                await backend.read(direct_fd, offset, [buf])
            codes.append(caught.value.errno)
        return codes

    assert run_with(kind, body) == [errno.EINVAL] * 3


def test_fsync_and_fdatasync(kind: str, direct_fd: int, arena: memoryview) -> None:
    data = fill_random(pages(arena, 0, 1), seed=5)

    async def body(backend: IoBackend) -> int:
        await backend.write(direct_fd, 0, [pages(arena, 0, 1)])
        await backend.fsync(direct_fd)
        await backend.fsync(direct_fd, data_only=True)
        return await backend.read(direct_fd, 0, [pages(arena, 1, 1)])

    assert run_with(kind, body) == PAGE_BYTES
    assert bytes(pages(arena, 1, 1)) == data


def test_closed_backend_refuses_ops(kind: str, direct_fd: int, arena: memoryview) -> None:
    async def body(backend: IoBackend) -> int | None:
        backend.close()
        with pytest.raises(IoError) as caught:
            await backend.read(direct_fd, 0, [pages(arena, 0, 1)])
        return caught.value.errno

    assert run_with(kind, body) == errno.ESHUTDOWN


def test_bad_ops_are_rejected_before_submission(kind: str, direct_fd: int) -> None:
    async def body(backend: IoBackend) -> None:
        with pytest.raises(ValueError):
            await backend.read(direct_fd, -PAGE_BYTES, [memoryview(bytearray(8))])
        with pytest.raises(ValueError):
            await backend.read(direct_fd, 0, [])
        with pytest.raises(ValueError):
            await backend.submit_many([IoOp(OpKind.FSYNC, direct_fd, 0, [memoryview(b"x")])])

    run_with(kind, body)


# ---- cancellation: the caller gets control back only after the op ends ----


@needs_native
def test_cancelled_uring_read_waits_for_the_kernel(arena: memoryview) -> None:
    # A read from an empty pipe stays in the kernel until bytes arrive, so
    # the cancel lands while the kernel owns the buffer.
    rfd, wfd = os.pipe()
    buf = pages(arena, 0, 1)

    async def body(backend: IoBackend) -> None:
        task = asyncio.create_task(backend.read(rfd, 0, [buf]))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()  # a second cancel is absorbed the same way
        await asyncio.sleep(0.01)
        assert not task.done()
        os.write(wfd, b"late bytes")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bytes(buf[:10]) == b"late bytes"
        os.write(wfd, b"next")
        assert await backend.read(rfd, 0, [pages(arena, 1, 1)]) == 4  # still usable

    try:
        run_with("uring", body)
    finally:
        os.close(rfd)
        os.close(wfd)


@needs_native
def test_uring_completions_wake_a_sleeping_loop(arena: memoryview) -> None:
    # Completions run as task work on the loop thread (cooperatively where the
    # kernel has COOP_TASKRUN, 5.19+); one that arrives while the loop sleeps
    # in epoll must still wake it through the eventfd.
    ring = iobackend.open_ring(2)
    try:
        release = os.uname().release.split(".")
        kernel = (int(release[0]), int("".join(c for c in release[1] if c.isdigit()) or 0))
        assert ring.cooperative is (kernel >= (5, 19))
    finally:
        ring.close()
    rfd, wfd = os.pipe()
    buf = pages(arena, 0, 1)
    writer = threading.Timer(0.05, os.write, (wfd, b"from another thread"))

    async def body(backend: IoBackend) -> None:
        writer.start()
        got = await asyncio.wait_for(backend.read(rfd, 0, [buf]), TEST_TIMEOUT_S)
        assert bytes(buf[:got]) == b"from another thread"

    try:
        run_with("uring", body)
    finally:
        writer.cancel()
        os.close(rfd)
        os.close(wfd)


@needs_native
def test_uring_admits_first_come_first_in(arena: memoryview) -> None:
    """A record of three ops waiting for room is not overtaken by a single op
    that would fit: the line is first come, first in."""
    held = [os.pipe(), os.pipe()]
    striped, late = os.pipe(), os.pipe()
    layout = StripeLayout((striped[0],) * 3, 1 << 20, 4096)
    record = RecordRead(0, 0, 4096, [pages(arena, 1, 1)[:8192]], 8192, 0, 1, 1, "ns", b"k")
    order: list[str] = []

    async def body(backend: IoBackend) -> None:
        assert isinstance(backend, iobackend.UringBackend)
        ring = backend._ring
        holders = [asyncio.create_task(backend.read(held[i][0], 0, [pages(arena, 2 + i, 1)]))
                   for i in range(2)]  # fmt: skip
        await asyncio.sleep(0.02)
        assert ring.inflight == 2  # one slot left: the record needs three

        def done(index: int, status: int) -> None:
            order.append("record")

        reading = asyncio.create_task(backend.read_records(layout, [record], done))
        await asyncio.sleep(0.02)
        single = asyncio.create_task(backend.read(late[0], 0, [pages(arena, 5, 1)]))
        await asyncio.sleep(0.02)
        assert ring.inflight == 2  # both wait in line: the single op behind the record
        for pipe in held:
            os.write(pipe[1], b"x")
        await asyncio.wait_for(asyncio.gather(*holders), TEST_TIMEOUT_S)
        await asyncio.sleep(0.02)
        assert ring.inflight == 3  # the record's three ops went in; the single op waits
        assert not single.done()
        os.write(striped[1], b"y" * 3 * 4096)
        await asyncio.wait_for(reading, TEST_TIMEOUT_S)
        os.write(late[1], b"z")
        assert await asyncio.wait_for(single, TEST_TIMEOUT_S) == 1
        order.append("single")

    try:
        run_with("uring", body, depth=3)
    finally:
        for pipe in (*held, striped, late):
            os.close(pipe[0])
            os.close(pipe[1])
    assert order == ["record", "single"]


@needs_native
def test_uring_line_survives_cancel_and_close(arena: memoryview) -> None:
    rfd, wfd = os.pipe()

    async def body(backend: IoBackend) -> None:
        assert isinstance(backend, iobackend.UringBackend)
        blocker = asyncio.create_task(backend.read(rfd, 0, [pages(arena, 0, 1)]))
        await asyncio.sleep(0.02)
        waiting = [asyncio.create_task(backend.read(rfd, 0, [pages(arena, 1 + i, 1)]))
                   for i in range(3)]  # fmt: skip
        await asyncio.sleep(0.02)
        assert len(backend._line) == 3
        waiting[0].cancel()  # leaves the line; nothing of it went out
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        assert len(backend._line) == 2
        os.write(wfd, b"a")
        assert await asyncio.wait_for(blocker, TEST_TIMEOUT_S) == 1
        await asyncio.sleep(0.02)
        assert len(backend._line) == 1  # the next one went in; the last waits
        os.write(wfd, b"b")
        assert await asyncio.wait_for(waiting[1], TEST_TIMEOUT_S) == 1
        os.write(wfd, b"c")
        assert await asyncio.wait_for(waiting[2], TEST_TIMEOUT_S) == 1
        # Closed while a caller waits in line: it is told, not stranded.
        blocker = asyncio.create_task(backend.read(rfd, 0, [pages(arena, 0, 1)]))
        late = asyncio.create_task(backend.read(rfd, 0, [pages(arena, 1, 1)]))
        await asyncio.sleep(0.02)
        os.write(wfd, b"d")  # the ring's read completes as close() drains it
        backend.close()
        assert await asyncio.wait_for(blocker, TEST_TIMEOUT_S) == 1
        with pytest.raises(IoError) as info:
            await asyncio.wait_for(late, TEST_TIMEOUT_S)
        assert info.value.errno == errno.ESHUTDOWN

    try:
        run_with("uring", body, depth=1)
    finally:
        os.close(rfd)
        os.close(wfd)


def test_cancelled_threads_read_waits_for_the_worker(direct_fd: int, arena: memoryview) -> None:
    data = fill_random(pages(arena, 0, 2), seed=6)
    os.pwritev(direct_fd, [pages(arena, 0, 2)], 0)
    buf = pages(arena, 4, 2)
    gate = threading.Event()

    async def body() -> None:
        backend = iobackend.ThreadBackend(depth=4, threads=1)
        try:
            # Hold the only worker so the read sits queued when cancelled.
            blocker = backend._pool.submit(gate.wait, TEST_TIMEOUT_S)
            task = asyncio.create_task(backend.read(direct_fd, 0, [buf]))
            await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0.01)
            assert not task.done()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, TEST_TIMEOUT_S)
            assert blocker.result() is True
            assert bytes(buf) == data
        finally:
            gate.set()
            backend.close()

    asyncio.run(body(), debug=True)


# ---- backend choice --------------------------------------------------------


def test_open_backend_picks_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvd.io"):
        backend = open_backend("auto", depth=4)
        backend.close()
    assert backend.name == ("uring" if NATIVE_OK else "threads")
    assert any(backend.name in record.getMessage() for record in caplog.records)
    threads = open_backend("threads")
    assert threads.name == "threads"
    threads.close()
    if not NATIVE_OK:
        with pytest.raises(RuntimeError, match="unavailable"):
            open_backend("uring")


@pytest.mark.parametrize(
    ("kind", "depth", "threads"),
    [("fast", 4, 4), ("auto", 0, 4), ("auto", 5000, 4), ("threads", 4, 0)],
)
def test_open_backend_rejects_bad_settings(kind: str, depth: int, threads: int) -> None:
    with pytest.raises(ValueError):
        open_backend(kind, depth=depth, threads=threads)


def test_native_available_gives_a_reason() -> None:
    ok, reason = native_available()
    assert isinstance(ok, bool)
    assert reason


# ---- the native ring itself ---------------------------------------------------


@pytest.fixture
def buffered_file(tmp_path: Path) -> Iterator[int]:
    path = tmp_path / "buffered"
    path.write_bytes(random.Random(7).randbytes(PAGE_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


@needs_native
def test_ring_accepts_at_most_depth(buffered_file: int, arena: memoryview) -> None:
    ring = iobackend.open_ring(4)
    try:
        ops = [(0, buffered_file, 0, pages(arena, i, 1), i) for i in range(6)]
        assert ring.submit(ops) == 4
        assert ring.inflight == 4
        assert ring.submit(ops[4:]) == 0
        done = ring.reap(8, wait_nr=4, timeout_ms=int(TEST_TIMEOUT_S * 1000))
        assert sorted(done) == [(i, PAGE_BYTES) for i in range(4)]
        assert ring.submit(ops[4:]) == 2
        done = ring.reap(8, wait_nr=2, timeout_ms=int(TEST_TIMEOUT_S * 1000))
        assert sorted(done) == [(4, PAGE_BYTES), (5, PAGE_BYTES)]
    finally:
        ring.close()


@needs_native
def test_ring_rejects_a_bad_batch_whole(buffered_file: int) -> None:
    region = mmap.mmap(-1, PAGE_BYTES)
    good = (0, buffered_file, 0, region, 1)
    ring = iobackend.open_ring(4)
    try:
        bad_batches: list[tuple[type[Exception], list[object]]] = [
            (ValueError, [good, (9, buffered_file, 0, region, 2)]),  # unknown opcode
            (BufferError, [good, (0, buffered_file, 0, b"read-only", 2)]),
            (TypeError, [good, (2, buffered_file, 0, region, 2)]),  # fsync with a buffer
            (ValueError, [good, (0, buffered_file, -1, region, 2)]),
            (ValueError, [good, (0, buffered_file, 0, [region] * 1025, 2)]),
            (TypeError, [good, (0, buffered_file, 0, region)]),
        ]
        for exc_type, batch in bad_batches:
            with pytest.raises(exc_type):
                ring.submit(batch)  # type: ignore[arg-type]
            assert ring.inflight == 0
    finally:
        ring.close()
    region.close()  # raises BufferError if any export leaked


@needs_native
def test_ring_keeps_buffer_exported_until_reaped() -> None:
    ring = iobackend.open_ring(2)
    region = mmap.mmap(-1, PAGE_BYTES)
    rfd, wfd = os.pipe()
    try:
        efd = ring.eventfd()
        assert ring.eventfd() == efd
        assert ring.submit([(0, rfd, 0, region, 42)]) == 1
        assert ring.reap(2, wait_nr=1, timeout_ms=20) == []  # bounded wait, nothing yet
        with pytest.raises(BufferError):
            region.close()
        os.write(wfd, b"abc")
        assert ring.reap(2, wait_nr=1, timeout_ms=int(TEST_TIMEOUT_S * 1000)) == [(42, 3)]
        assert int.from_bytes(os.read(efd, 8), sys.byteorder) >= 1
        assert ring.reap(2, wait_nr=5) == []  # never waits for ops that do not exist
        region.close()
    finally:
        ring.close()
        os.close(rfd)
        os.close(wfd)


@needs_native
def test_ring_close_cancels_idle_ops_and_releases_buffers() -> None:
    ring = iobackend.open_ring(2)
    region = mmap.mmap(-1, PAGE_BYTES)
    rfd, wfd = os.pipe()
    try:
        assert ring.submit([(0, rfd, 0, region, 1)]) == 1
        ring.close()  # the pipe read never got bytes: cancelled, not waited 60 s
        assert ring.closed
        assert ring.inflight == 0
        region.close()
        with pytest.raises(ValueError, match="closed"):
            ring.submit([])
    finally:
        os.close(rfd)
        os.close(wfd)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_native
def test_ring_does_not_leak_over_1e5_ops(buffered_file: int, arena: memoryview) -> None:
    ring = iobackend.open_ring(64)
    single = pages(arena, 0, 1)[:4096]
    pair = [pages(arena, 1, 1)[:4096], pages(arena, 2, 1)[:4096]]
    refs_before = (sys.getrefcount(single), sys.getrefcount(pair[0]))
    total, batch = 100_000, 64
    rss_warm = 0
    try:
        for i in range(total // batch):
            ops = [(0, buffered_file, 0, pair if j % 2 else single, j) for j in range(batch)]
            ops[-1] = (0, -1, 0, single, batch - 1)  # an error completion each batch
            assert ring.submit(ops) == batch
            done = ring.reap(batch, wait_nr=batch, timeout_ms=int(TEST_TIMEOUT_S * 1000))
            assert len(done) == batch
            if i == 100:
                rss_warm = _rss_bytes()
        assert dict(done)[batch - 1] == -errno.EBADF
        assert dict(done)[1] == 8192
        del ops  # the last batch's tuples
    finally:
        ring.close()
    assert (sys.getrefcount(single), sys.getrefcount(pair[0])) == refs_before
    assert _rss_bytes() - rss_warm < 4 * 1024 * 1024


# ---- the throughput probe behind kvd bench ----------------------------------


def test_measure_reports_each_case(direct_dir: Path) -> None:
    kinds = ["uring", "threads"] if NATIVE_OK else ["threads"]
    results = bench_io.measure(
        str(direct_dir / "bench"),
        kinds=kinds,
        block_bytes=(PAGE_BYTES,),
        queue_depths=(1, 4),
        file_bytes=4 * 1024 * 1024,
        seconds_per_case=0.05,
    )
    cases = [(r.backend, r.queue_depth) for r in results]
    assert cases == [(k, qd) for k in kinds for qd in (1, 4)]
    assert all(r.reads > 0 and r.gb_per_s > 0 for r in results)
