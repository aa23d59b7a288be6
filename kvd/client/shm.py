"""Client side of the shared-memory path: regions, their allocator, the batch calls.

A region is a memfd the client creates, sizes, seals (``F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_SEAL``: its size is final, so the daemon's copies
cannot fault), allocates in full as it maps it (``MADV_POPULATE_WRITE``, on
huge pages where the kernel gives them: a node short of memory fails here,
in the client, and the pages are the client's; kvd.util.hugepages), and
passes to the daemon on the shm socket (``RegionOps.attach``). A shared
``flock`` on a second open file description of it, which never leaves this
process, tells the daemon the client lives (it frees the region once that
lock is gone, i.e. once this process exits). Nothing is ever created in the
daemon's shm directory. ``buffer(nbytes)`` hands out a region of its own, so
a put from it or a get into it is the daemon's single copy. Other buffers
go through a staging region: one more copy, by numpy.

The daemon checks each value it copies into a region against the stored
checksum while the bytes are in cache, and stores the checksum of what it
copied out of one; bytes never cross a socket, so the client does not hash.

Every region op carries the moment its client stops waiting, on the
daemon's clock (``RegionOps.deadline``): the daemon starts no copy past it,
and stores no copy that ended past it. So a put that timed out can never
store bytes the caller wrote there afterwards (the client returns only once
the deadline has passed), and a get that timed out starts no copy later.
A get whose copy had begun may still land after it: its region is retired
(``_retire``), never used for another op; staging is made anew, and a
``buffer()`` in it is no longer the daemon's single copy (take a new one).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvd.client.bulk import Answer
from kvd.client.pool_path import PoolPath
from kvd.client.regions import Call, ClientRegion, address_of, close_region, create_region
from kvd.client.shm_socket import BatchAnswer, RegionOps, RegionResult
from kvd.client.spans import ALIGN_BYTES, Spans
from kvd.util.logs import Throttle
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import (
    CODE_NUMBERS,
    DeadlineExceeded,
    InvalidArgument,
    KvdError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    error_for,
)

log = logging.getLogger("kvd.client")

# A shm path whose daemon is gone and none answers says so at most this often.
UNANSWERED_LOG_S = 60.0

# Staging for buffers outside any region: 64 MiB holds a batch of sixteen
# 4 MiB chunks. It is allocated at creation (~10 ms for 64 MiB here), like
# every region: pages allocated later could be missing when the daemon writes.
STAGING_BYTES = 64 << 20
# Room first offered for a value of unknown size; a larger one comes back
# with its size and is fetched again with exact room.
GET_ROOM_BYTES = 4 << 20
BATCH_ITEMS_MAX = 256

_NOT_FOUND = CODE_NUMBERS["NOT_FOUND"]
_RESOURCE_EXHAUSTED = CODE_NUMBERS["RESOURCE_EXHAUSTED"]


def _error(result: RegionResult) -> KvdError:
    return error_for(result.code, result.message)


def _item_error(result: RegionResult, room: int) -> KvdError:
    """The error of a failed get into ``room`` bytes (a value larger than its room
    is the caller's mistake: InvalidArgument)."""
    if result.code == _RESOURCE_EXHAUSTED and result.size > room:
        return InvalidArgument(f"buffer of {room} bytes is too small for {result.size}")
    return _error(result)


class ShmPath:
    """Puts and gets through regions; ``call(method_name, request)`` is the client's RPC."""

    def __init__(
        self,
        shm_dir: str,
        max_region_bytes: int,
        call: Callable[[str, Any], Any],
        ops: RegionOps | None = None,
        rediscover: Callable[[], RegionOps | None] | None = None,
        pool_reads: bool = True,
        verify_pool_reads: bool = True,
        direct_pool_reads: bool = True,
    ):
        """``rediscover()``: region ops on the daemon's shm socket as the daemon
        now describes it (DescribePaths again), for ``renew``. ``pool_reads``:
        copy gets straight out of the daemon's L1 where it lets this client
        (``kvd.client.pool_reads``); ``verify_pool_reads``: check each such
        copy against its checksum; ``direct_pool_reads``: read values found
        in the pool's directory without a frame."""
        self.shm_dir = shm_dir
        self.max_region_bytes = max_region_bytes
        self._call = call
        self._ops = ops
        self._rediscover = rediscover
        self._renew_lock = threading.Lock()
        self._renamed: dict[int, ClientRegion] = {}  # the last renew's regions, by old id
        self._unanswered = Throttle(UNANSWERED_LOG_S)
        self._regions: list[ClientRegion] = []
        self._lock = threading.Lock()
        self._staging: ClientRegion | None = None
        self._spans: Spans | None = None
        self.pools = PoolPath(
            pool_reads, verify_pool_reads, direct_pool_reads, BATCH_ITEMS_MAX,
            self._region_get_many_into, self.renew,
        )  # fmt: skip

    def _rpc(self, name: str) -> Call:
        return lambda request, _: self._call(name, request)

    def _attach(self, fd: int, size: int) -> tuple[int, bytes]:
        if self._ops is None:
            raise Unavailable("shm path closed")
        return self._ops.attach(fd, size)

    def open(self) -> None:
        """Create the staging region now: it fails here (and the client keeps
        to its other paths) when the daemon has no shm socket, when its peer
        is not the daemon, or when the daemon is on another node."""
        if self._ops is None:
            raise Unavailable("the daemon offers no shm socket: regions cannot be attached")
        self._staging_spans()
        self._ops.client.with_connection(lambda conn: None)
        self.pools.attach(self._ops)

    @property
    def pool_reads(self) -> bool:
        """Whether gets copy straight out of the daemon's L1 (``kvd.client.pool_reads``)."""
        return self.pools.map is not None

    @property
    def direct_pool_reads(self) -> bool:
        """Whether gets find values in the pool's directory and copy them
        without a frame (``kvd.client.pool_reads``)."""
        return self.pools.map is not None and self.pools.map.directory is not None

    @property
    def over_socket(self) -> bool:
        """Whether region ops go over the daemon's shm socket (else gRPC)."""
        return self._ops is not None

    @property
    def timeout_s(self) -> float | None:
        return self._ops.client.timeout_s if self._ops is not None else None

    @timeout_s.setter
    def timeout_s(self, value: float | None) -> None:
        if self._ops is not None and value is not None:
            self._ops.client.timeout_s = value  # the client's changed deadline, as for bulk

    def _batch(self, name: str, request: Any, region: ClientRegion) -> BatchAnswer:
        ops = self._ops
        if ops is None:
            return self._call(name, request)  # type: ignore[no-any-return]  # closed
        try:
            return self._region_batch(ops, name, request, region)
        except DeadlineExceeded:
            raise  # a slow daemon, not a new one: nothing to attach again
        except (Unavailable, PermissionDenied) as exc:
            renamed = self.renew(ops, exc)
            again = renamed.get(request.region_id) if renamed is not None else None
            if again is None or self._ops is None:
                raise
        # The daemon restarted: the same batch once more, in the region's new attachment.
        request.region_id, request.token = again.region_id, again.token
        return self._region_batch(self._ops, name, request, again)

    def index_op(self, send: Callable[[RegionOps], Answer | None]) -> Answer | None:
        """An index op (``RegionOps.lookup``, ``release``) over the shm socket,
        one frame each way: its answer, or None when it cannot go there (no
        socket, keys of different widths, a daemon that restarted: the
        regions then attach to the new one) and the caller asks over gRPC."""
        ops = self._ops
        if ops is None:
            return None
        try:
            return send(ops)
        except DeadlineExceeded:
            raise
        except (Unavailable, PermissionDenied) as exc:
            self.renew(ops, exc)
            return None

    def _region_batch(
        self, ops: RegionOps, name: str, request: Any, region: ClientRegion
    ) -> BatchAnswer:
        mine, request.deadline_ns = ops.deadline()
        try:
            if name == "GetIntoRegion":
                return ops.get_into_region(request)
            return ops.put_from_region(request)
        except DeadlineExceeded:
            self._timed_out(mine, region if name == "GetIntoRegion" else None)
            raise

    def _timed_out(self, mine: int, written: ClientRegion | None) -> None:
        """After a region op that timed out, and before its caller may reuse the
        bytes: wait until its deadline has passed (it normally has), and retire
        the region a get may still write into."""
        wait_ns = mine - time.monotonic_ns()
        if wait_ns > 0:
            time.sleep(wait_ns / 1e9)
        if written is not None:
            self._retire(written)

    def _retire(self, region: ClientRegion) -> None:
        """Never use ``region`` for an op again. Its descriptors close now (the
        daemon frees its side once its copies end: the region's lock is gone);
        its mapping goes once nothing here holds it."""
        with self._lock:
            if region not in self._regions:
                return
            self._regions.remove(region)
            if region is self._staging:
                self._staging = self._spans = None
        os.close(region.fd)
        os.close(region.lock_fd)

    def renew(self, failed: RegionOps, why: Exception) -> dict[int, ClientRegion] | None:
        """After ``failed`` lost the daemon (its socket closed, or a new peer
        that is not the daemon it knew: a restart; ``why``), attach every
        region to the daemon that serves now, in place, so the buffers handed
        out stay valid: the regions by their old ids, or None while no daemon
        answers. The caller may try its call once more, in the new attachment."""
        reason = {"socket": failed.path, "reason": f"{type(why).__name__}: {why}"}
        with self._renew_lock:
            if self._ops is not failed:
                return self._renamed  # another thread renewed already
            try:
                ops = self._rediscover() if self._rediscover is not None else None
                if ops is None:
                    raise Unavailable("no daemon describes a shm socket")
                with self._lock:
                    regions = list(self._regions)
                renamed = {}
                for region in regions:
                    renamed[region.region_id] = region
                    region.region_id, region.token = ops.attach(region.fd, region.size)
            except (KvdError, OSError) as exc:
                # Every call meets this while the daemon is down: a line a minute.
                held = self._unanswered.allow(failed.path)
                if held is not None:
                    log.warning(
                        "shm path lost its daemon, and none answers",
                        extra={**reason, "error": str(exc), "held_back": held},
                    )
                return None
            self._ops, self._renamed = ops, renamed
            self.pools.attach(ops)
        log.warning("shm path lost its daemon; its regions are attached again", extra=reason)
        failed.close()
        return renamed

    def close(self) -> None:
        with self._lock:
            regions, self._regions = self._regions, []
            self._staging = None
        self.pools.close(self._ops)
        if self._ops is not None:
            self._ops.close()
        for region in regions:
            close_region(region, self._rpc("DetachRegion"))

    def _new_region(self, size: int) -> ClientRegion:
        """A region attached to the daemon; after a restart (the attach meets
        a closed socket or a new peer), to the daemon that serves now."""
        ops = self._ops
        try:
            return create_region(size, self._attach)
        except DeadlineExceeded:
            raise
        except (Unavailable, PermissionDenied) as exc:
            if ops is None or self.renew(ops, exc) is None:
                raise
        return create_region(size, self._attach)

    def buffer(self, nbytes: int) -> memoryview:
        if not 0 < nbytes <= self.max_region_bytes:
            raise InvalidArgument(f"buffer of {nbytes} bytes; 1..{self.max_region_bytes}")
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        region = self._new_region(size)
        with self._lock:
            self._regions.append(region)
        return region.view[:nbytes]

    def locate(self, view: memoryview) -> tuple[ClientRegion, int] | None:
        address = address_of(view)
        with self._lock:
            for region in self._regions:
                if region.contains(address, len(view)):
                    return region, address - region.address
        return None

    def _staging_spans(self) -> tuple[ClientRegion, Spans]:
        with self._lock:
            if self._staging is not None and self._spans is not None:
                return self._staging, self._spans
        size = min(STAGING_BYTES, self.max_region_bytes)
        region = self._new_region(size)
        with self._lock:
            if self._staging is None:
                self._staging, self._spans = region, Spans(size)
                self._regions.append(region)
                region = None  # type: ignore[assignment]
            staged = self._staging, self._spans
        if region is not None:  # another thread won the race
            close_region(region, self._rpc("DetachRegion"))
        assert staged[1] is not None
        return staged[0], staged[1]

    # ---- puts ------------------------------------------------------------------------
    def put_many(
        self,
        ns: str,
        items: Sequence[tuple[bytes, memoryview, bytes]],
        parent: bytes | None,
        chained: bool,
        durable: bool = False,
    ) -> list[bool | None]:
        """Store values; None for an item that found no room (the caller uses another path)."""
        existed: list[bool | None] = []
        values = [value for _, value, _ in items]
        start = 0
        while start < len(items):
            end, region, offsets, staged = self._place(values, start, fill=True)
            if end == start:
                existed.append(None)
                start += 1
                continue
            try:
                first_parent = (items[start - 1][0] if start else parent) if chained else None
                request = pb.PutFromRegionRequest(
                    region_id=region.region_id,
                    token=region.token,
                    namespace=ns,
                    chained=chained,
                    durable=durable,
                    items=[
                        pb.RegionItem(
                            key=key,
                            offset=offset,
                            length=len(value),
                            meta=meta,
                            parent=(first_parent or b"") if i == 0 else b"",
                        )
                        for i, ((key, value, meta), offset) in enumerate(
                            zip(items[start:end], offsets, strict=True)
                        )
                    ],
                )
                response = self._batch("PutFromRegion", request, region)
            finally:
                self._unstage(staged)
            results: Sequence[RegionResult] = response.results
            for i, result in enumerate(results):
                if result.code:
                    error = _error(result)
                    raise type(error)(f"item {start + i}: {error}")
                existed.append(result.existed)
            start = end
        return existed

    def _place(
        self, views: Sequence[memoryview], start: int, fill: bool
    ) -> tuple[int, ClientRegion, list[int], list[tuple[Spans, int, int]]]:
        """Views from ``start`` sharing one region: in a buffer(), or given room
        in staging (``fill``: the view's bytes copied there, for a put)."""
        first = self.locate(views[start])
        offsets: list[int] = []
        staged: list[tuple[Spans, int, int]] = []
        if first is not None:
            region = first[0]
            offsets.append(first[1])
            for view in views[start + 1 : start + BATCH_ITEMS_MAX]:
                where = self.locate(view)
                if where is None or where[0] is not region:
                    break
                offsets.append(where[1])
            return start + len(offsets), region, offsets, staged
        region, spans = self._staging_spans()
        for view in views[start : start + BATCH_ITEMS_MAX]:
            if self.locate(view) is not None:
                break
            offset = spans.alloc(len(view))
            if offset is None:
                break
            staged.append((spans, offset, len(view)))
            if fill:
                dst = np.frombuffer(region.view, dtype=np.uint8)[offset : offset + len(view)]
                np.copyto(dst, np.frombuffer(view, dtype=np.uint8))
            offsets.append(offset)
        return start + len(offsets), region, offsets, staged

    @staticmethod
    def _unstage(staged: list[tuple[Spans, int, int]]) -> None:
        for spans, offset, nbytes in staged:
            spans.free(offset, nbytes)

    # ---- gets ------------------------------------------------------------------------
    def get_into(self, ns: str, key: bytes, buffer: memoryview) -> int | None:
        got = self.pools.get(self._ops, ns, [key], [buffer])
        if got is not None:
            return got[0]
        where = self.locate(buffer) if self._ops is not None else None
        if where is None:  # staging, or gRPC region calls: the batch's way
            return self.get_many_into(ns, [key], [buffer])[0]
        ops = self._ops
        assert ops is not None
        region, offset = where
        try:
            result = self._get_one_fenced(ops, ns, key, region, offset, len(buffer))
        except DeadlineExceeded:
            raise
        except (Unavailable, PermissionDenied) as exc:
            if self.renew(ops, exc) is None or self._ops is None:
                raise
            # The daemon restarted: once more, in the region's new attachment.
            result = self._get_one_fenced(self._ops, ns, key, region, offset, len(buffer))
        if result.code == _NOT_FOUND:
            return None
        if result.code:
            raise _item_error(result, len(buffer))
        return int(result.size)

    def _get_one_fenced(
        self, ops: RegionOps, ns: str, key: bytes, region: ClientRegion, offset: int, room: int
    ) -> RegionResult:
        mine, deadline_ns = ops.deadline()
        try:
            return ops.get_one(region.region_id, region.token, ns, key, offset, room, deadline_ns)
        except DeadlineExceeded:
            self._timed_out(mine, region)
            raise

    def get(self, ns: str, key: bytes) -> bytes | None:
        region, spans = self._staging_spans()
        room = GET_ROOM_BYTES
        for _ in range(2):  # once with a guess, once with the exact size
            offset = spans.alloc(room)
            if offset is None:
                raise ResourceExhausted(f"staging region has no {room} bytes free")
            try:
                result = self._get_one(ns, key, region, offset, room, want_size=True)
                if result is None:
                    return None
                if result.code == 0:
                    return bytes(region.view[offset : offset + result.size])
            finally:
                spans.free(offset, room)
            room = result.size
        raise ResourceExhausted("value changed size between two reads")  # pragma: no cover

    def get_many_into(
        self, ns: str, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        """Values into ``buffers``: one batch per run of buffers in one region
        (others get room in staging and one more copy); sizes, None for a miss.
        With pool reads, straight out of the daemon's L1 into ``buffers``."""
        got = self.pools.get(self._ops, ns, keys, buffers)
        if got is not None:
            return got
        return self._region_get_many_into(ns, keys, buffers)

    def _region_get_many_into(
        self, ns: str, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        sizes: list[int | None] = []
        start = 0
        while start < len(keys):
            end, region, offsets, staged = self._place(buffers, start, fill=False)
            if end == start:
                raise ResourceExhausted(f"staging region has no {len(buffers[start])} bytes free")
            try:
                rooms = [len(buffer) for buffer in buffers[start:end]]
                results = self._get_batch(ns, region, keys[start:end], offsets, rooms)
                for i, result in enumerate(results):
                    if result.code == _NOT_FOUND:
                        sizes.append(None)
                        continue
                    if result.code:
                        error = _item_error(result, len(buffers[start + i]))
                        if len(keys) == 1:
                            raise error
                        raise type(error)(f"item {start + i}: {error}")
                    if staged:
                        src = np.frombuffer(region.view, dtype=np.uint8)
                        there = src[offsets[i] : offsets[i] + result.size]
                        np.copyto(np.frombuffer(buffers[start + i], np.uint8)[: result.size], there)
                    sizes.append(int(result.size))
            finally:
                self._unstage(staged)
            start = end
        return sizes

    def get_many(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of unknown size: batches with ``GET_ROOM_BYTES`` of staging
        each; a larger value is fetched again alone with its exact size."""
        region, spans = self._staging_spans()
        values: list[bytes | None] = []
        start = 0
        while start < len(keys):
            room: list[int] = []
            for _ in keys[start : start + BATCH_ITEMS_MAX]:
                offset = spans.alloc(GET_ROOM_BYTES)
                if offset is None:
                    break
                room.append(offset)
            if not room:
                raise ResourceExhausted(f"staging region has no {GET_ROOM_BYTES} bytes free")
            end = start + len(room)
            try:
                rooms = [GET_ROOM_BYTES] * len(room)
                results = self._get_batch(ns, region, keys[start:end], room, rooms)
                got: list[bytes | RegionResult | None] = []
                for offset, result in zip(room, results, strict=True):
                    if result.code == _NOT_FOUND:
                        got.append(None)
                    elif result.code == 0:
                        got.append(bytes(region.view[offset : offset + result.size]))
                    elif result.code == _RESOURCE_EXHAUSTED and result.size > GET_ROOM_BYTES:
                        got.append(result)  # larger than its room: fetched alone below
                    else:
                        raise _error(result)
            finally:
                for offset in room:
                    spans.free(offset, GET_ROOM_BYTES)
            for key, value in zip(keys[start:end], got, strict=True):
                values.append(
                    value if value is None or isinstance(value, bytes) else self.get(ns, key)
                )
            start = end
        return values

    def _get_batch(
        self,
        ns: str,
        region: ClientRegion,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        rooms: Sequence[int],
    ) -> Sequence[RegionResult]:
        """One GetIntoRegion: ``keys[i]`` into ``rooms[i]`` bytes at ``offsets[i]``."""
        request = pb.GetIntoRegionRequest(
            region_id=region.region_id,
            token=region.token,
            namespace=ns,
            items=[
                pb.RegionItem(key=key, offset=offset, length=room)
                for key, offset, room in zip(keys, offsets, rooms, strict=True)
            ],
        )
        return self._batch("GetIntoRegion", request, region).results

    def _get_one(
        self,
        ns: str,
        key: bytes,
        region: ClientRegion,
        offset: int,
        room: int,
        want_size: bool = False,
    ) -> RegionResult | None:
        result = self._get_batch(ns, region, [key], [offset], [room])[0]
        if result.code == _NOT_FOUND:
            return None
        if result.code == _RESOURCE_EXHAUSTED and want_size and result.size > room:
            return result
        if result.code:
            raise _item_error(result, room)
        return result
