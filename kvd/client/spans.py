"""Room in a client's staging region: a first-fit allocator of byte ranges
(``kvd.client.shm``)."""

from __future__ import annotations

import threading

ALIGN_BYTES = 4096


class Spans:
    """First-fit allocator of byte ranges in a region; thread-safe."""

    def __init__(self, size: int) -> None:
        self._free: list[tuple[int, int]] = [(0, size)]
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        need = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        with self._lock:
            for i, (start, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, size - need)
                    return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        need = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        with self._lock:
            self._free.append((offset, need))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((start, size))
            self._free = merged
