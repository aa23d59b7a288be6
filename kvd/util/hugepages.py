"""Shared memory on huge pages where the kernel offers them.

The L1 pool (a memfd when clients may read it), the clients' regions and
each side's mappings of the other's memfd are shared memory (shmem). Copies
between 4 KiB-page mappings miss the TLB every 4 KiB: here a copy out of a
4 KiB-page memfd ran at 18.5-20.5 GB/s against 23-24 GB/s from the same
memfd on 2 MiB pages or from numpy's own (huge-page) memory, so no get on
4 KiB pages reaches 0.9x the memcpy ceiling.

The kernel gives shmem huge pages by its setting
``/sys/kernel/mm/transparent_hugepage/shmem_enabled``: ``always`` and
``within_size`` to every mapping, ``advise`` to mappings that ask for them
with ``madvise(MADV_HUGEPAGE)`` before their pages are allocated, ``never``
and ``deny`` to none. ``map_shared`` asks, then faults the mapping in with
``MADV_POPULATE_WRITE`` (Linux 5.14+) so the pages come as huge ones where
allowed, and a mapping of pages another process allocated huge maps them
whole (one TLB entry per 2 MiB). Everything here is best effort: where the
kernel says no, the memory is the same memory on 4 KiB pages.

This module imports nothing of the daemon or the client: both use it.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path

import numpy as np

# madvise(2) advice Python 3.11's mmap does not name (Linux 5.14+).
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
SHMEM_MODES = ("always", "within_size", "advise", "never", "deny", "force")
# The lines of /proc/self/smaps that count a mapping's huge-page bytes.
_HUGE_FIELDS = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")


def shmem_mode(path: Path = SHMEM_ENABLED) -> str:
    """The kernel's shmem huge-page setting (the bracketed word), or
    ``unknown`` where there is no such file (no THP in this kernel)."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unknown"


def advise_huge(mapping: mmap.mmap) -> None:
    """Ask for huge pages on ``mapping`` before its pages are touched; where
    the kernel refuses (no THP, or a mapping it cannot back so) the pages
    are 4 KiB ones."""
    with contextlib.suppress(AttributeError, OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)


def map_shared(fd: int, size: int, *, populate: bool = True, writable: bool = True) -> mmap.mmap:
    """``mmap(fd)`` shared, huge pages asked for, and (``populate``) every
    page faulted in now: allocated where the file has none yet (as
    ``posix_fallocate`` would, with ENOMEM now rather than SIGBUS on a later
    write) and mapped. Kernels before 5.14 populate through ``MAP_POPULATE``,
    on 4 KiB mappings."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    advise_huge(mapping)
    if not populate:
        return mapping
    try:
        mapping.madvise(MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: the kernel does not know the advice
            mapping.close()
            raise
        mapping.close()
        if writable:
            os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        return mmap.mmap(fd, size, flags=flags, prot=prot)
    return mapping


def mapping_address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts in this process (read-only mappings too:
    ctypes takes only writable buffers, numpy takes both)."""
    return int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)


def huge_page_bytes(mapping: mmap.mmap, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of ``mapping`` that this process maps with huge pages (0 where
    /proc tells nothing)."""
    start = mapping_address(mapping)
    header = f"{start:x}-"
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    total = 0
    inside = False
    for line in lines:
        first = line.split(" ", 1)[0]
        if "-" in first and not first.endswith(":"):
            inside = first.startswith(header)
            continue
        if inside and line.startswith(_HUGE_FIELDS):
            total += int(line.split()[1]) * 1024
    return total
