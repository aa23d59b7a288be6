"""L1 DRAM pool: one pre-allocated arena carved into 64 KiB pages.

The arena is a single anonymous mapping, populated at start-up so the
daemon's memory is claimed up front and ``dram_bytes`` is a hard bound: no
value-sized buffer is ever allocated per put. A value occupies a short list
of page runs, ``(first_page, page_count)``; callers move bytes through
``views()``, memoryview slices of the arena, so copies go straight between a
socket or a shared region and the pool.

Free space is runs rather than a per-page list: a 2 TiB pool has 32 M
pages, and a Python list of that many ints would cost ~1 GiB. The free runs
sit in size classes (class b: runs of 2**b to 2**(b+1) - 1 pages), each a
stack, the most recently freed on top. A value takes one run that holds it
whole where there is one, from the smallest class that has such a run
(a 64 KiB value reuses a freed page, not a piece of the large run), split
on allocation; only when no run is large enough is it gathered from several,
the largest first. Runs are pushed back on free; when there are more than
``_COALESCE_RUNS`` they are sorted and merged (amortised O(log n) per free),
so fragmentation stays bounded. With one stack for every size, a 4 MiB value
put after 2,048 64 KiB values were freed took 64 one-page runs, with a 2 GiB
run free beside them: a copy per run, and no place in the directory.

With ``shared`` (the ``shm_pool_reads`` setting) the arena is a sealed
memfd instead, so trusted same-node clients can map it read-only and copy
values straight out of it (``kvd.paths.shm.pool_reads``); after the arena
the memfd holds the ``directory`` (``kvd.l1.directory``), where such a
client finds a value without asking the daemon. ``read_only_fd``
hands out a descriptor opened read-only, through which no process can write
or resize the pool. Such an arena has huge pages only where the kernel gives
them to shared memory (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``
``advise`` or ``always``; kvd.util.hugepages), and so do the clients'
mappings of it; the daemon logs how much of the arena it got at start.

This module imports nothing from the server, grpc or metrics.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvd.l1.directory import Directory, directory_bytes
from kvd.util.hugepages import MADV_POPULATE_WRITE, advise_huge, huge_page_bytes
from kvd.wire.shm import POOL_PAGE_BYTES

PAGE_BYTES = POOL_PAGE_BYTES  # 64 KiB; a client that maps the pool reads tags per page

# Merge the free runs when there are this many: a sort of 4096 tuples takes
# ~1 ms, paid at most once per 2048 frees.
_COALESCE_RUNS = 4096
# Size classes of free runs (class b: 2**b .. 2**(b+1) - 1 pages): 2**47
# pages of 64 KiB is far past any machine's memory.
_CLASSES = 48
# Runs of a value's own class looked at for one that holds it whole (that
# class's runs may be a little smaller than the value; every run of a class
# above holds it).
_FIT_SCAN = 8

# A value spread over more runs than this triggers a merge of the free stack
# first: each run costs a slice and a copy call (~1 µs) on every access.
_RUNS_PER_VALUE_MAX = 64

Run = tuple[int, int]  # (first page, page count)


class PoolFull(Exception):
    """Not enough free pages; the caller evicts and retries, or gives up."""


def pages_for(nbytes: int) -> int:
    """Pages needed to hold ``nbytes`` (at least one, so empty values have a home)."""
    return max(1, -(-nbytes // PAGE_BYTES))


class Pool:
    """Fixed-size page arena with run allocation."""

    def __init__(self, capacity_bytes: int, shared: bool = False) -> None:
        page_count = capacity_bytes // PAGE_BYTES
        if page_count < 1:
            raise ValueError(f"pool of {capacity_bytes} bytes holds no 64 KiB page")
        self.page_count = page_count
        self.capacity_bytes = page_count * PAGE_BYTES
        self._fd = -1
        self.directory: Directory | None = None
        self._directory_map: mmap.mmap | None = None
        if shared:
            directory_size = directory_bytes(page_count)
            self._fd = _sealed_memfd(self.capacity_bytes + directory_size)
            self._arena = mmap.mmap(self._fd, self.capacity_bytes, flags=mmap.MAP_SHARED)
            self._directory_map = mmap.mmap(
                self._fd, directory_size, flags=mmap.MAP_SHARED, offset=self.capacity_bytes
            )
            self.directory = Directory(
                memoryview(self._directory_map), page_count, self.capacity_bytes
            )
        else:
            self._arena = mmap.mmap(
                -1, self.capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            )
        # Huge pages where the kernel offers them (THP "madvise" mode): copies
        # out of a huge-page arena run at ~20 GB/s here against ~16 GB/s from
        # 4 KiB pages (fewer TLB misses). Asked for before the first touch.
        advise_huge(self._arena)
        self._touch()
        self._view = memoryview(self._arena)
        self._classes: list[list[Run]] = [[] for _ in range(_CLASSES)]
        self._nonempty = 0  # bit b set: class b holds a run
        self._run_count = 0
        self._push((0, page_count))
        self.free_pages = page_count

    def _touch(self) -> None:
        """Fault every page in now: dram_bytes is claimed at start, not on first put."""
        try:
            self._arena.madvise(MADV_POPULATE_WRITE)
        except OSError:  # kernels before 5.14: write one byte per page
            np.frombuffer(self._arena, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def huge_page_bytes(self) -> int:
        """Bytes of the arena on huge pages (read from /proc: call it once, at start)."""
        return huge_page_bytes(self._arena)

    @property
    def shared(self) -> bool:
        """Whether the arena is a memfd that clients may map (``read_only_fd``)."""
        return self._fd >= 0

    def read_only_fd(self) -> int:
        """A new descriptor of the shared arena, opened read-only (the caller
        closes it): a mapping through it cannot be written to the pool
        (``MAP_SHARED`` with ``PROT_WRITE`` fails), nor can it resize it."""
        if self._fd < 0:
            raise ValueError("the pool is not shared")
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    @staticmethod
    def spans(runs: Sequence[Run], nbytes: int) -> list[tuple[int, int]]:
        """The arena's byte ranges ``(offset, length)`` holding the first
        ``nbytes`` of ``runs``: where a client that maps the pool reads a value."""
        out: list[tuple[int, int]] = []
        left = nbytes
        for first, count in runs:
            if left <= 0:
                break
            take = min(left, count * PAGE_BYTES)
            out.append((first * PAGE_BYTES, take))
            left -= take
        return out

    @property
    def used_bytes(self) -> int:
        return (self.page_count - self.free_pages) * PAGE_BYTES

    @property
    def free_bytes(self) -> int:
        return self.free_pages * PAGE_BYTES

    def alloc(self, nbytes: int) -> list[Run]:
        """Runs totalling ``pages_for(nbytes)`` pages, or PoolFull (nothing taken)."""
        need = pages_for(nbytes)
        if need > self.free_pages:
            raise PoolFull(f"need {need} pages, {self.free_pages} free")
        runs = self._take(need)
        if len(runs) > _RUNS_PER_VALUE_MAX:
            # Only small runs are left: merge freed neighbours back into large
            # ones rather than scatter one value over many.
            for run in runs:
                self._push(run)
            self._coalesce()
            runs = self._take(need)
        self.free_pages -= need
        return runs

    def _push(self, run: Run) -> None:
        cls = run[1].bit_length() - 1
        self._classes[cls].append(run)
        self._nonempty |= 1 << cls
        self._run_count += 1

    def _pop(self, cls: int, index: int = -1) -> Run:
        stack = self._classes[cls]
        run = stack[index]
        if index != -1:
            stack[index] = stack[-1]
        stack.pop()
        if not stack:
            self._nonempty &= ~(1 << cls)
        self._run_count -= 1
        return run

    def _split(self, run: Run, need: int) -> Run:
        """``need`` pages off the front of ``run`` (at least that long); the
        rest is free again."""
        first, count = run
        if count > need:
            self._push((first + need, count - need))
        return (first, need)

    def _take(self, need: int) -> list[Run]:
        cls = need.bit_length() - 1
        stack = self._classes[cls]
        if stack and stack[-1][1] == need:
            # The common case, a run of exactly the value's pages on top (a
            # 64 KiB value reusing a freed page).
            return [self._pop(cls)]
        for index in range(len(stack) - 1, max(len(stack) - 1 - _FIT_SCAN, -1), -1):
            if stack[index][1] >= need:
                return [self._split(self._pop(cls, index), need)]
        above = self._nonempty >> (cls + 1)
        if above:
            larger = cls + 1 + (above & -above).bit_length() - 1
            return [self._split(self._pop(larger), need)]
        # No run holds it whole: gather, the largest runs first (every class
        # above ``cls`` is empty here, and the caller checked free_pages).
        runs: list[Run] = []
        for smaller in range(cls, -1, -1):
            stack = self._classes[smaller]
            while stack and need:
                first, count = stack.pop()
                self._run_count -= 1
                if count > need:  # the rest goes to this class or a smaller one
                    self._push((first + need, count - need))
                    count = need
                runs.append((first, count))
                need -= count
            if not stack:
                self._nonempty &= ~(1 << smaller)
            if not need:
                break
        assert not need, "free pages counted but not found"
        return runs

    def free(self, runs: Sequence[Run]) -> None:
        if self.directory is not None:
            self.directory.clear(runs)  # before the pages can be reused
        classes = self._classes
        for run in runs:  # _push, inline: every delete and eviction frees
            first, count = run
            assert first >= 0 and first + count <= self.page_count, f"bad run {run}"
            cls = count.bit_length() - 1
            classes[cls].append(run)
            self._nonempty |= 1 << cls
            self.free_pages += count
        self._run_count += len(runs)
        assert self.free_pages <= self.page_count, "double free"
        if self._run_count > _COALESCE_RUNS:
            self._coalesce()

    def _coalesce(self) -> None:
        merged: list[Run] = []
        for first, count in sorted(run for stack in self._classes for run in stack):
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            else:
                assert not merged or merged[-1][0] + merged[-1][1] < first, "overlapping runs"
                merged.append((first, count))
        self._classes = [[] for _ in range(_CLASSES)]
        self._nonempty = self._run_count = 0
        for run in merged:
            self._push(run)

    def views(self, runs: Sequence[Run], nbytes: int) -> list[memoryview]:
        """Writable slices of the arena covering the first ``nbytes`` of ``runs``."""
        out: list[memoryview] = []
        left = nbytes
        for first, count in runs:
            if left <= 0:
                break
            take = min(left, count * PAGE_BYTES)
            start = first * PAGE_BYTES
            out.append(self._view[start : start + take])
            left -= take
        assert left <= 0, "runs shorter than the value"
        return out

    def views_between(self, runs: Sequence[Run], start: int, end: int) -> list[memoryview]:
        """Writable slices of the arena covering bytes ``start..end`` of ``runs``
        (a value's pages in order): where a put that grows receives next."""
        out: list[memoryview] = []
        offset = 0  # of the current run's first byte, within the value
        for first, count in runs:
            run_end = offset + count * PAGE_BYTES
            lo, hi = max(start, offset), min(end, run_end)
            if lo < hi:
                base = first * PAGE_BYTES - offset
                out.append(self._view[base + lo : base + hi])
            offset = run_end
            if offset >= end:
                break
        assert offset >= end, "runs shorter than the range"
        return out

    def close(self) -> None:
        # Views handed out (to readers, io ops) may outlive the pool object in
        # finished bookkeeping; then the arena is unmapped with the last one.
        with contextlib.suppress(BufferError):
            self._view.release()
            self._arena.close()
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        if self._directory_map is not None:
            with contextlib.suppress(BufferError):
                self._directory_map.close()
            self._directory_map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _sealed_memfd(nbytes: int) -> int:
    """A memfd of ``nbytes``, its size sealed: no holder of a descriptor can
    shrink it under the daemon's mapping (a read would fault) or grow it."""
    fd = os.memfd_create("kvd-l1", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ViewWriter:
    """Sequential writer over a list of page views (one value's pages)."""

    __slots__ = ("_index", "_pos", "_views", "capacity", "written")

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = views
        self._index = 0
        self._pos = 0
        self.written = 0
        self.capacity = sum(len(v) for v in views)

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data``; the caller checks ``capacity`` first (overflow is a bug)."""
        src = memoryview(data)
        n = len(src)
        assert self.written + n <= self.capacity, "write past the value's pages"
        done = 0
        while done < n:
            view = self._views[self._index]
            take = min(n - done, len(view) - self._pos)
            view[self._pos : self._pos + take] = src[done : done + take]
            done += take
            self._pos += take
            if self._pos == len(view):
                self._index += 1
                self._pos = 0
        self.written += n


def chunked(views: Sequence[memoryview], chunk_bytes: int) -> list[list[memoryview]]:
    """Group ``views`` into consecutive pieces of ``chunk_bytes`` (the last may be short)."""
    chunks: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = chunk_bytes
    for view in views:
        pos = 0
        while pos < len(view):
            take = min(room, len(view) - pos)
            current.append(view[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                chunks.append(current)
                current = []
                room = chunk_bytes
    if current:
        chunks.append(current)
    return chunks
