"""Huge pages for fio's buffers, so the benches' fio ceilings read into memory
like kvd's.

kvd reads L2 into its L1 pool, which sits on huge pages where the kernel
gives them (kvd.l1.pool). fio reads into buffers it allocates on 4 KiB
pages. A device whose driver maps every page of a read (a virtio disk: one
descriptor per 4 KiB segment, at most 254 of them a request here, so a
1 MiB read is split in two) then does less for fio than for kvd: on this
VM's disk fio's random reads at depth 32 went from 1.25 to 2.39 GB/s (64
KiB) and from 1.32 to 3.40 GB/s (1 MiB) with buffers on huge pages. A
ceiling that low would flatter every ratio to it.

``fio_huge_buffers(nbytes)`` reserves enough huge pages for fio's buffers
(``/proc/sys/vm/nr_hugepages``), mounts hugetlbfs on a fresh directory, and
yields a path on it for fio's ``--mem=mmaphuge:PATH``; everything is given
back however the block ends. Where that cannot be had (not root, no
hugetlbfs, no free huge pages) it yields None, with the reason in
``HugeBuffers.why_not``, and fio reads into 4 KiB pages.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE_BYTES = 2 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
MEMINFO = Path("/proc/meminfo")
SPARE_PAGES = 4  # fio aligns each buffer, and maps a little more than the sum
COMMAND_TIMEOUT_S = 30


@dataclass
class HugeBuffers:
    """Where fio's buffers go: ``path`` for ``--mem=mmaphuge:``, or None and why."""

    path: str | None
    why_not: str = ""

    def fio_args(self) -> list[str]:
        return [f"--mem=mmaphuge:{self.path}"] if self.path else []


def _free_pages() -> int:
    found = re.search(r"HugePages_Free:\s+(\d+)", MEMINFO.read_text())
    return int(found.group(1)) if found else 0


@contextlib.contextmanager
def fio_huge_buffers(nbytes: int) -> Iterator[HugeBuffers]:
    """Huge pages for ``nbytes`` of fio's buffers (module doc)."""
    if os.geteuid() != 0:
        yield HugeBuffers(None, "not root: fio reads into 4 KiB pages")
        return
    pages = -(-nbytes // HUGE_PAGE_BYTES) + SPARE_PAGES
    try:
        before = int(NR_HUGEPAGES.read_text())
    except (OSError, ValueError) as exc:
        yield HugeBuffers(None, f"no huge page pool: {exc}")
        return
    mount = Path(tempfile.mkdtemp(prefix="kvd-fio-huge-"))
    mounted = False
    try:
        buffers = HugeBuffers(None)
        try:
            NR_HUGEPAGES.write_text(str(before + pages))
            if _free_pages() < pages:
                buffers.why_not = f"the kernel found fewer than {pages} free huge pages"
            else:
                subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mount)], check=True,
                               capture_output=True, timeout=COMMAND_TIMEOUT_S)  # fmt: skip
                mounted = True
                buffers.path = str(mount / "fio-buffers")
        except (OSError, subprocess.SubprocessError) as exc:
            buffers.why_not = f"hugetlbfs not available: {exc}"
        yield buffers
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        with contextlib.suppress(OSError):
            mount.rmdir()
        with contextlib.suppress(OSError):
            NR_HUGEPAGES.write_text(str(before))
