"""One shm path's pool reads: the mapping of the daemon's L1 (where it lets
this client, ``kvd.client.pool_reads``), gets through its directory and
with POOL_GET frames, and the directory's gets the daemon is still owed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from kvd.client.pool_reads import UNPINNED, PoolMap, map_pool, read_all, tell_touched
from kvd.client.shm_socket import RegionOps
from kvd.wire.errors import DeadlineExceeded, KvdError, PermissionDenied, Unavailable

# Gets read through the pool's directory told to the daemon at once (one
# POOL_TOUCH round trip per this many: the hits and recency lag by at most it).
TOUCH_BATCH_KEYS = 256

RegionGets = Callable[[str, Sequence[bytes], Sequence[memoryview]], list[int | None]]


class PoolPath:
    """``want``: map the pool where the daemon lets this client; ``verify``:
    check each copy against its checksum (a directory copy made in Python
    always is); ``direct``: read through the directory; ``batch_items``: keys of a
    POOL_GET frame at most. ``regions`` gets items as
    region gets (those the daemon would not pin), ``renew`` re-attaches the
    shm path after its daemon restarted (it calls ``attach``)."""

    def __init__(
        self,
        want: bool,
        verify: bool,
        direct: bool,
        batch_items: int,
        regions: RegionGets,
        renew: Callable[[RegionOps, Exception], object],
    ) -> None:
        self._want = want
        self.verify = verify
        self._direct = direct
        self._batch_items = batch_items
        self._regions = regions
        self._renew = renew
        self.map: PoolMap | None = None

    def attach(self, ops: RegionOps) -> None:
        """Map the daemon's pool where it offers pool reads and lets this
        client; else gets keep to regions."""
        self.close(ops)
        self.map = map_pool(ops, self._direct, self.verify) if self._want else None

    def close(self, ops: RegionOps | None) -> None:
        """Tell the daemon what is owed (with ``ops``) and unmap."""
        if self.map is None:
            return
        if ops is not None:
            self._tell_touched(ops, self.map)
        self.map.close()
        self.map = None

    def get(
        self, ops: RegionOps | None, ns: str, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None] | None:
        """Gets straight out of the daemon's pool, first through its directory
        (no frame), the others with a POOL_GET; None when none can go that
        way (no pool mapped, keys of different widths, a daemon that
        restarted): then as region gets. Items the daemon would not pin, or
        that the POOL_GET could not take, are region gets."""
        pool = self.map
        if ops is None or pool is None:
            return None
        if pool.daemon_gone():
            # Its pages and directory are a dead daemon's: map the one there now.
            pool.take_touched()
            self.attach(ops)
            pool = self.map
            if pool is None:
                return None
        if pool.directory is None:
            return self._framed(ops, pool, ns, keys, buffers)
        sizes = pool.read_direct_many(ns, keys, buffers)
        if pool.touched_count >= TOUCH_BATCH_KEYS:
            self._tell_touched(ops, pool)
        rest = [i for i, size in enumerate(sizes) if size is None]
        if not rest:
            return sizes
        rest_keys, rest_buffers = [keys[i] for i in rest], [buffers[i] for i in rest]
        got = self._framed(ops, pool, ns, rest_keys, rest_buffers)
        if got is None:
            if len(rest) == len(keys):
                return None
            got = self._regions(ns, rest_keys, rest_buffers)
        for i, size in zip(rest, got, strict=True):
            sizes[i] = size
        return sizes

    @staticmethod
    def _tell_touched(ops: RegionOps, pool: PoolMap) -> None:
        """Tell the daemon what was read through the directory (hits, and
        the eviction policy's recency); advisory: a failure loses only that."""
        touched = pool.take_touched()
        if touched:
            with contextlib.suppress(KvdError):
                tell_touched(ops.client, touched, TOUCH_BATCH_KEYS)

    def _framed(
        self,
        ops: RegionOps,
        pool: PoolMap,
        ns: str,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
    ) -> list[int | None] | None:
        """Gets with POOL_GET frames; None when they cannot go that way."""
        try:
            sizes = read_all(ops.client, pool, ns, keys, buffers, self._batch_items)
        except DeadlineExceeded:
            raise
        except (Unavailable, PermissionDenied) as exc:
            self._renew(ops, exc)  # maps the new daemon's pool, if it lets us
            return None
        if sizes is None:
            return None
        refused = [i for i, size in enumerate(sizes) if size == UNPINNED]
        if refused:
            again = self._regions(ns, [keys[i] for i in refused], [buffers[i] for i in refused])
            for i, size in zip(refused, again, strict=True):
                sizes[i] = size
        return sizes
