"""The thin client library: ``Client`` (blocking; ``AsyncClient``, in ``async_client``,
has the same calls for asyncio code).

A miss is ``None``, never an exception. Every call carries a deadline
(``timeout_s``); a daemon that is down fails the call at once with
``Unavailable`` and one that is slow with ``DeadlineExceeded`` (a subclass),
so connectors can turn both into a miss and let the engine recompute.
Values are checked against their xxh3 checksum on the way out and on the
way back; a mismatch raises ``DataLoss`` and is never returned.

Targets are ``host:port`` or ``unix:///path``.

Fast paths (``Client`` only): on a Unix-socket target the client moves values
through shared-memory regions (``shm=True`` is then the default), and on a
TCP target it sends single puts, all gets and any ``put_many`` holding a
value of ``bulk_threshold_bytes`` or more over the daemon's bulk TCP port.
Both are found with one DescribePaths call on first use; a daemon without
them (or a shm directory this process cannot reach) leaves the client on
gRPC, the universal fallback. A call whose bulk connection is refused or
dropped (the port is full, ``BulkUnavailable``) is made over gRPC instead;
a call whose deadline passed is not tried again. ``buffer(nbytes)`` hands
out memory inside a region: a put from it or a get into it is the daemon's
only copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from kvd.client.bulk import DEFAULT_CONNECTIONS, BulkClient, BulkPut, BulkUnavailable
from kvd.client.calls import (
    BATCH_ITEMS_MAX,
    BATCH_VALUE_BYTES_MAX,
    BULK_THRESHOLD_BYTES,
    DEFAULT_TIMEOUT_S,
    INLINE_GET_BYTES_MAX,
    Buffer,
    GetAssembler,
    PutItemLike,
    Tls,
    batch_get_item,
    batch_put_request,
    batch_put_result,
    batches,
    copy_into,
    grpc_target,
    lookup_result,
    metadata,
    open_channel,
    put_items,
    put_requests,
    raise_for,
    single_get_request,
    small_put_request,
    stats_dict,
)
from kvd.client.keys import chain_keys
from kvd.client.shm import ShmPath
from kvd.client.shm_socket import RegionOps, lookup_answer, released
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    KvdError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvd.wire.grpc import KVStoreStub
from kvd.wire.lookup import LookupResult

__all__ = [
    "AlreadyExists",
    "Client",
    "DataLoss",
    "DeadlineExceeded",
    "InvalidArgument",
    "KvdError",
    "LookupResult",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Tls",
    "Unauthenticated",
    "Unavailable",
    "chain_keys",
]


class Client:
    """Blocking client. Thread-safe: one channel, many concurrent calls."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        shm: bool | None = None,
        bulk: bool | None = None,
        bulk_threshold_bytes: int = BULK_THRESHOLD_BYTES,
        bulk_connections: int = DEFAULT_CONNECTIONS,
        tls: Tls | None = None,
        pool_reads: bool = True,
        verify_pool_reads: bool = True,
        direct_pool_reads: bool = True,
    ) -> None:
        """``tls``: TLS to a TCP target; values go over the bulk TCP port too
        where the daemon's takes TLS (``bulk_tls``), else over gRPC only:
        with ``tls`` they never travel in clear.
        ``pool_reads``: on the shm path, copy gets straight out of the daemon's
        L1 where the daemon lets this client (``kvd.client.pool_reads``);
        ``verify_pool_reads``: check each such copy against its checksum (off:
        a copy through the directory is still checked against the owner tags
        of its pages, before and after; only where kvd.io._uring is built);
        ``direct_pool_reads``: find values in the pool's directory and copy
        them without asking the daemon."""
        self.target = target
        self._tls = tls
        self.timeout_s = timeout_s
        self._metadata = metadata(token)
        self._token = token
        self._channel = open_channel(target, tls)
        self._stub = KVStoreStub(self._channel)
        unix = grpc_target(target).startswith("unix:")
        self._want_shm = unix if shm is None else shm
        self._want_bulk = not unix if bulk is None else bulk
        self.bulk_threshold_bytes = bulk_threshold_bytes
        self._bulk_connections = bulk_connections
        self._pool_reads = pool_reads
        self._verify_pool_reads = verify_pool_reads
        self._direct_pool_reads = direct_pool_reads
        self._paths_lock = threading.Lock()
        self._paths_known = False
        self._shm: ShmPath | None = None
        self._bulk: BulkClient | None = None

    @property
    def timeout_s(self) -> float:
        """Each call's deadline, in seconds; changing it applies to every path."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = value
        bulk = getattr(self, "_bulk", None)
        if bulk is not None:
            bulk.timeout_s = value
        shm = getattr(self, "_shm", None)
        if shm is not None:
            shm.timeout_s = value

    @property
    def paths(self) -> frozenset[str]:
        """The data paths this client uses besides gRPC: ``shm`` (regions),
        ``shm-socket`` (region ops on the daemon's shm socket rather than
        gRPC), ``shm-pool`` (gets copied straight out of the daemon's L1),
        ``shm-pool-direct`` (found there through its directory, without a
        frame) and ``bulk`` (the bulk TCP port)."""
        shm, bulk = self._fast_paths()
        found = {"bulk"} if bulk is not None else set()
        if shm is not None:
            found |= {"shm", "shm-socket"} if shm.over_socket else {"shm"}
            if shm.pool_reads:
                found.add("shm-pool")
            if shm.direct_pool_reads:
                found.add("shm-pool-direct")
        return frozenset(found)

    def _fast_paths(self) -> tuple[ShmPath | None, BulkClient | None]:
        """The daemon's fast paths this client uses, found once (DescribePaths)."""
        if self._paths_known or not (self._want_shm or self._want_bulk):
            return self._shm, self._bulk
        with self._paths_lock:
            if not self._paths_known:
                # A daemon that is down or slow fails this call, within the
                # call's one deadline, and the next call asks again.
                self._open_fast_paths()
                self._paths_known = True
        return self._shm, self._bulk

    def _open_fast_paths(self) -> None:
        try:
            paths = self._call(self._stub.DescribePaths, pb.DescribePathsRequest())
        except Unavailable:
            raise
        except KvdError:
            return  # an older daemon: gRPC only
        if self._want_shm and paths.shm_dir:
            ops = RegionOps.of(paths, self._token, self.timeout_s)
            shm = ShmPath(
                paths.shm_dir,
                paths.max_region_bytes,
                lambda name, request: self._call(getattr(self._stub, name), request),
                ops,
                self._region_ops,
                pool_reads=self._pool_reads,
                verify_pool_reads=self._verify_pool_reads,
                direct_pool_reads=self._direct_pool_reads,
            )
            try:
                shm.open()  # the staging region proves the directory is shared with the daemon
                self._shm = shm
            except (OSError, KvdError):
                shm.close()
        # Over TLS only to a bulk port that takes it; never TLS to one in clear.
        same_tls = paths.bulk_tls == (self._tls is not None)
        unix = grpc_target(self.target).startswith("unix:")
        if self._want_bulk and paths.bulk_port and same_tls and not unix:
            host = grpc_target(self.target).rpartition(":")[0].strip("[]")
            self._bulk = BulkClient(
                host,
                paths.bulk_port,
                token=self._token,
                connections=self._bulk_connections,
                timeout_s=self.timeout_s,
                tls=self._tls.context() if self._tls is not None else None,
            )

    def _region_ops(self) -> RegionOps | None:
        """Region ops as the daemon describes its shm socket now (after a restart)."""
        paths = self._call(self._stub.DescribePaths, pb.DescribePathsRequest())
        return RegionOps.of(paths, self._token, self.timeout_s) if paths.shm_dir else None

    def buffer(self, nbytes: int) -> memoryview:
        """Writable memory for values: inside a shared region when the shm path is on."""
        shm, _ = self._fast_paths()
        return shm.buffer(nbytes) if shm is not None else memoryview(bytearray(nbytes))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
        if self._bulk is not None:
            self._bulk.close()
        self._channel.close()

    def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise_for(exc)

    def put(
        self,
        ns: str,
        key: bytes,
        value: Buffer,
        meta: bytes = b"",
        parent: bytes | None = None,
        *,
        durable: bool = False,
    ) -> bool:
        """Store a value; True when the key already held these bytes."""
        shm, bulk = self._fast_paths()
        view = memoryview(value).cast("B")
        if shm is not None:
            stored = shm.put_many(ns, [(key, view, meta)], parent, chained=True, durable=durable)
            if stored[0] is not None:
                return stored[0]
        if bulk is not None:
            with contextlib.suppress(BulkUnavailable):  # refused: this call goes over gRPC
                return bulk.put(ns, key, view, meta, parent, durable=durable)
        small = small_put_request(ns, key, value, meta, parent, durable)
        if small is not None:
            return batch_put_result(self._call(self._stub.BatchPut, small), 0)[0]
        response = self._call(self._stub.Put, put_requests(ns, key, value, meta, parent, durable))
        return bool(response.existed)

    def _get(self, ns: str, key: bytes, assembler: GetAssembler) -> None:
        call = self._stub.Get(
            pb.GetRequest(namespace=ns, key=key), timeout=self.timeout_s, metadata=self._metadata
        )
        try:
            for response in call:
                if not assembler.feed(response):
                    break
        except grpc.RpcError as exc:
            raise_for(exc)
        except KvdError:
            call.cancel()
            raise

    def get(self, ns: str, key: bytes) -> bytes | None:
        shm, bulk = self._fast_paths()
        if shm is not None:
            return shm.get(ns, key)
        if bulk is not None:
            with contextlib.suppress(BulkUnavailable):
                return bulk.get(ns, key)
        item = self._call(self._stub.BatchGet, single_get_request(ns, key)).items[0]
        value = batch_get_item(item)
        if value is not ResourceExhausted:
            return value  # type: ignore[return-value]
        assembler = GetAssembler()
        self._get(ns, key, assembler)
        return assembler.value()

    def get_into(self, ns: str, key: bytes, buffer: Buffer) -> int | None:
        """Read a value into ``buffer``; its size, or None on a miss."""
        shm, bulk = self._fast_paths()
        view = memoryview(buffer).cast("B")
        if shm is not None:
            return shm.get_into(ns, key, view)
        if bulk is not None:
            with contextlib.suppress(BulkUnavailable):
                return bulk.get_into(ns, key, view)
        item = self._call(self._stub.BatchGet, single_get_request(ns, key)).items[0]
        value = batch_get_item(item)
        if value is not ResourceExhausted:
            return copy_into(value, buffer)  # type: ignore[arg-type]
        assembler = GetAssembler(memoryview(buffer).cast("B"))
        self._get(ns, key, assembler)
        return assembler.size_into()

    def put_many(
        self,
        ns: str,
        items: Iterable[PutItemLike],
        *,
        chained: bool = False,
        parent: bytes | None = None,
    ) -> list[bool]:
        """Store many values; ``chained`` links each to the previous one (one chain in order)."""
        listed = put_items(items)
        shm, bulk = self._fast_paths()
        if shm is not None:
            stored = shm.put_many(ns, listed, parent, chained)
            return [
                self.put(
                    ns, key, value, meta, (listed[i - 1][0] if i else parent) if chained else None
                )
                if done is None
                else done
                for i, ((key, value, meta), done) in enumerate(zip(listed, stored, strict=True))
            ]
        if bulk is not None and any(len(v) >= self.bulk_threshold_bytes for _, v, _ in listed):
            puts = [
                BulkPut(
                    key,
                    value,
                    meta,
                    ((listed[i - 1][0] if i else parent) or b"") if chained else b"",
                )
                for i, (key, value, meta) in enumerate(listed)
            ]
            with contextlib.suppress(BulkUnavailable):
                return bulk.put_many(ns, puts)
        existed: list[bool] = []
        for first, group in batches(listed):
            group_parent = listed[first - 1][0] if first else parent
            if len(group) == 1 and len(group[0][1]) > BATCH_VALUE_BYTES_MAX:
                key, value, meta = group[0]
                existed.append(self.put(ns, key, value, meta, group_parent if chained else None))
                continue
            response = self._call(
                self._stub.BatchPut, batch_put_request(ns, group, group_parent, chained)
            )
            existed.extend(batch_put_result(response, first))
        return existed

    def get_many_into(
        self, ns: str, keys: Sequence[bytes], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        """Read values into ``buffers`` (one per key) in one batch where the path
        has batches; each value's size, or None for a miss."""
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        shm, bulk = self._fast_paths()
        views = [memoryview(buffer).cast("B") for buffer in buffers]
        if shm is not None:
            return shm.get_many_into(ns, keys, views)
        if bulk is not None:
            with contextlib.suppress(BulkUnavailable):
                return bulk.get_many_into(ns, keys, views)
        return [self.get_into(ns, key, view) for key, view in zip(keys, views, strict=True)]

    def get_many(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        shm, bulk = self._fast_paths()
        if shm is not None:
            return shm.get_many(ns, keys)
        if bulk is not None:
            with contextlib.suppress(BulkUnavailable):
                return bulk.get_many(ns, keys)
        out: list[bytes | None] = []
        for start in range(0, len(keys), BATCH_ITEMS_MAX):
            group = list(keys[start : start + BATCH_ITEMS_MAX])
            response = self._call(self._stub.BatchGet, pb.BatchGetRequest(namespace=ns, keys=group))
            for key, item in zip(group, response.items, strict=True):
                value = batch_get_item(item)
                out.append(self.get(ns, key) if value is ResourceExhausted else value)  # type: ignore[arg-type]
        return out

    def get_with_meta(self, ns: str, key: bytes) -> tuple[bytes, bytes] | None:
        """(value, meta) of one key, or None on a miss; checksums checked (gRPC path)."""
        item = self._call(self._stub.BatchGet, single_get_request(ns, key)).items[0]
        value = batch_get_item(item)
        if value is not ResourceExhausted:
            return None if value is None else (value, item.meta)  # type: ignore[return-value]
        assembler = GetAssembler()
        self._get(ns, key, assembler)
        data = assembler.value()
        if data is None or assembler.header is None:
            return None
        return data, assembler.header.meta

    def get_many_with_meta(
        self, ns: str, keys: Sequence[bytes]
    ) -> list[tuple[bytes, bytes] | None]:
        """``get_with_meta`` of several keys; small values come in one BatchGet per 256."""
        out: list[tuple[bytes, bytes] | None] = []
        for start in range(0, len(keys), BATCH_ITEMS_MAX):
            group = list(keys[start : start + BATCH_ITEMS_MAX])
            request = pb.BatchGetRequest(
                namespace=ns, keys=group, inline_bytes_max=INLINE_GET_BYTES_MAX
            )
            response = self._call(self._stub.BatchGet, request)
            for key, item in zip(group, response.items, strict=True):
                value = batch_get_item(item)
                if value is ResourceExhausted:
                    out.append(self.get_with_meta(ns, key))
                else:
                    out.append(None if value is None else (value, item.meta))  # type: ignore[arg-type]
        return out

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        response = self._call(self._stub.Exists, pb.ExistsRequest(namespace=ns, keys=list(keys)))
        return list(response.exists)

    def lookup(self, ns: str, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        """Length of the longest stored prefix of the chain ``keys``."""
        return self.lookup_ex(ns, keys, lease_ms).prefix_len

    def lookup_ex(self, ns: str, keys: Sequence[bytes], lease_ms: int = 0) -> LookupResult:
        """``lookup`` with its hits by tier and its lease. On the daemon's node
        it is one frame each way on the shm socket, not a gRPC call."""
        shm, _ = self._fast_paths()
        if shm is not None:
            answer = shm.index_op(lambda ops: ops.lookup(ns, keys, lease_ms))
            if answer is not None:
                return lookup_answer(answer)
        request = pb.LookupRequest(namespace=ns, keys=list(keys), lease_ms=lease_ms)
        return lookup_result(self._call(self._stub.Lookup, request))

    def release(self, ns: str, lease_id: int) -> bool:
        shm, _ = self._fast_paths()
        if shm is not None:
            answer = shm.index_op(lambda ops: ops.release(ns, lease_id))
            if answer is not None:
                return released(answer)
        request = pb.ReleaseRequest(namespace=ns, lease_id=lease_id)
        return bool(self._call(self._stub.Release, request).released)

    def delete(self, ns: str, keys: Sequence[bytes]) -> int:
        response = self._call(self._stub.Delete, pb.DeleteRequest(namespace=ns, keys=list(keys)))
        return int(response.deleted)

    def delete_namespace(self, ns: str) -> int:
        response = self._call(self._stub.Delete, pb.DeleteRequest(namespace=ns, all_keys=True))
        return int(response.deleted)

    def stats(self, ns: str = "") -> dict[str, Any]:
        return stats_dict(self._call(self._stub.Stats, pb.StatsRequest(namespace=ns)))
