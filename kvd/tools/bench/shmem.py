"""The kernel's shared-memory huge pages for ``kvd bench paths --shmem-huge-pages``.

kvd's L1 pool (with pool reads), the clients' regions and their mappings
are shared memory, which gets huge pages only as
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows
(kvd.util.hugepages). Distributions ship it ``never``; on 4 KiB pages a
copy out of shared memory runs at ~0.8x the memcpy ceiling (numpy's own
memory is on huge pages). ``shmem_huge_pages`` sets the mode for a run and
puts the old one back however the run ends, as an operator would set it
for the daemon (``advise``: kvd asks for them, nothing else gets them).
It needs root; anything it cannot do raises ``ShmemError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from kvd.util.hugepages import SHMEM_ENABLED, SHMEM_MODES, shmem_mode


class ShmemError(RuntimeError):
    """The shmem huge-page mode could not be set here."""


@contextlib.contextmanager
def shmem_huge_pages(mode: str, path: Path = SHMEM_ENABLED) -> Iterator[str]:
    """Set the shmem huge-page mode for the ``with`` block; yields the old one."""
    if mode not in SHMEM_MODES:
        raise ShmemError(f"shmem huge-page mode must be one of {SHMEM_MODES}, got {mode!r}")
    old = shmem_mode(path)
    if old == "unknown":
        raise ShmemError(f"{path} is missing: this kernel has no transparent huge pages")
    try:
        path.write_text(mode)
    except OSError as exc:
        raise ShmemError(f"cannot set {path} to {mode} (root?): {exc}") from exc
    try:
        yield old
    finally:
        path.write_text(old)
