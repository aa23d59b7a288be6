"""The thin client library: ``Client`` (blocking) and ``AsyncClient``.

A miss is ``None``, never an exception. Every call carries a deadline
(``timeout_s``); a daemon that is down fails the call at once with
``Unavailable`` and one that is slow with ``DeadlineExceeded`` (a subclass),
so connectors can turn both into a miss and let the engine recompute.
Values are checked against their xxh3 checksum on the way out and on the
way back; a mismatch raises ``DataLoss`` and is never returned.

Targets are ``host:port`` or ``unix:///path``.

Fast paths (``Client`` only): on a Unix-socket target the client moves values
through shared-memory regions (``shm=True`` is then the default), and on a
TCP target it sends values of ``bulk_threshold_bytes`` or more, and all gets,
over the daemon's bulk TCP port. Both are found with one DescribePaths call
on first use; a daemon without them (or a shm directory this process cannot
reach) leaves the client on gRPC, the universal fallback. ``buffer(nbytes)``
hands out memory inside a region: a put from it or a get into it is the
daemon's only copy.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from kvd.bulk_client import DEFAULT_CONNECTIONS, BulkClient, BulkPut
from kvd.checksum import checksum
from kvd.errors import (
    BY_CODE_NAME,
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
from kvd.keys import chain_keys
from kvd.shm_client import ShmPath
from kvd.v1 import kvd_pb2 as pb
from kvd.v1 import kvd_pb2_grpc as pb_grpc

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "Client",
    "DataLoss",
    "DeadlineExceeded",
    "InvalidArgument",
    "KvdError",
    "LookupResult",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "chain_keys",
]

DEFAULT_TIMEOUT_S = 5.0
# Streamed puts send 1 MiB messages: gRPC Python's sweet spot here
# (~0.9 GB/s, against ~0.1 GB/s at 64 KiB and ~0.16 GB/s at 32 MiB).
CHUNK_BYTES = 1 << 20
# Values up to this size travel in BatchPut/BatchGet, up to this many per call.
BATCH_VALUE_BYTES_MAX = 1 << 20
# get() asks for values up to this size in one unary call and streams larger
# ones: a unary call costs ~half a stream's fixed overhead (64 KiB: ~0.13 vs
# ~0.08 GB/s here), while above 1 MiB streamed messages win.
INLINE_GET_BYTES_MAX = 1 << 20
BATCH_BYTES_MAX = 8 << 20
# Values this large go over the bulk TCP port when the daemon has one: one
# raw round trip beats a gRPC call from 64 KiB up (see `kvd bench paths`).
BULK_THRESHOLD_BYTES = 64 << 10
BATCH_ITEMS_MAX = 256
_MESSAGE_BYTES_MAX = 1 << 30
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MESSAGE_BYTES_MAX),
    ("grpc.max_send_message_length", _MESSAGE_BYTES_MAX),
]

Buffer = bytes | bytearray | memoryview
PutItemLike = tuple[bytes, Buffer] | tuple[bytes, Buffer, bytes]


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_len: int
    l1_hits: int
    l2_hits: int
    lease_id: int
    lease_ms: int


def grpc_target(target: str) -> str:
    if target.startswith("kvd://"):
        return target[len("kvd://") :]
    return target


def _raise_for(error: grpc.RpcError) -> NoReturn:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    cls = BY_CODE_NAME.get(name, KvdError)
    raise cls(f"{name}: {details}") from None


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def _put_requests(
    ns: str, key: bytes, value: Buffer, meta: bytes, parent: bytes | None, durable: bool
) -> Iterator[pb.PutRequest]:
    view = memoryview(value).cast("B")
    header = pb.PutHeader(
        namespace=ns,
        key=key,
        size=len(view),
        checksum=checksum(view),
        meta=meta,
        parent=parent or b"",
        durable=durable,
    )
    if len(view) <= CHUNK_BYTES:
        data = value if isinstance(value, bytes) else bytes(view)
        yield pb.PutRequest(header=header, data=data)
        return
    yield pb.PutRequest(header=header, data=bytes(view[:CHUNK_BYTES]))
    for offset in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        yield pb.PutRequest(data=bytes(view[offset : offset + CHUNK_BYTES]))


class _GetAssembler:
    """Collects a Get stream into bytes, or into the caller's buffer."""

    def __init__(self, into: memoryview | None = None) -> None:
        self.header: pb.GetHeader | None = None
        self._into = into
        self._parts: list[bytes] = []
        self.received = 0

    def feed(self, response: pb.GetResponse) -> bool:
        """Take one message; False once the header says miss."""
        if self.header is None:
            if not response.HasField("header"):
                raise DataLoss("Get stream without a header")
            self.header = response.header
            if not self.header.found:
                return False
            if self._into is not None and self.header.size > len(self._into):
                raise InvalidArgument(
                    f"buffer of {len(self._into)} bytes is too small for {self.header.size}"
                )
        data = response.data
        if self.received + len(data) > self.header.size:
            raise DataLoss("Get stream longer than its header")
        if self._into is not None:
            self._into[self.received : self.received + len(data)] = data
        else:
            self._parts.append(data)
        self.received += len(data)
        return True

    def _check(self, data: Buffer) -> None:
        assert self.header is not None
        if self.received != self.header.size:
            raise DataLoss(f"Get stream ended at {self.received} of {self.header.size} bytes")
        if checksum(data) != self.header.checksum:
            raise DataLoss("value does not match its checksum")

    def value(self) -> bytes | None:
        if self.header is None or not self.header.found:
            return None
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._check(data)
        return data

    def size_into(self) -> int | None:
        if self.header is None or not self.header.found:
            return None
        assert self._into is not None
        self._check(self._into[: self.received])
        return self.received


def _put_items(items: Iterable[PutItemLike]) -> list[tuple[bytes, memoryview, bytes]]:
    out = []
    for item in items:
        meta = item[2] if len(item) == 3 else b""
        out.append((item[0], memoryview(item[1]).cast("B"), meta))
    return out


def _batches(
    items: list[tuple[bytes, memoryview, bytes]],
) -> Iterator[tuple[int, list[tuple[bytes, memoryview, bytes]]]]:
    """(first index, items) groups for BatchPut; big values come alone, to be streamed."""
    start, group_bytes = 0, 0
    group: list[tuple[bytes, memoryview, bytes]] = []
    for i, item in enumerate(items):
        size = len(item[1])
        if (
            size > BATCH_VALUE_BYTES_MAX
            or len(group) >= BATCH_ITEMS_MAX
            or (group and group_bytes + size > BATCH_BYTES_MAX)
        ):
            if group:
                yield start, group
            start, group, group_bytes = i, [], 0
        group.append(item)
        group_bytes += size
        if size > BATCH_VALUE_BYTES_MAX:
            yield start, group
            start, group, group_bytes = i + 1, [], 0
    if group:
        yield start, group


def _batch_put_request(
    ns: str, group: list[tuple[bytes, memoryview, bytes]], parent: bytes | None, chained: bool
) -> pb.BatchPutRequest:
    items = []
    for i, (key, value, meta) in enumerate(group):
        item_parent = parent if (chained and i == 0 and parent) else b""
        items.append(
            pb.PutItem(
                key=key, value=bytes(value), meta=meta, parent=item_parent, checksum=checksum(value)
            )
        )
    return pb.BatchPutRequest(namespace=ns, items=items, chained=chained)


def _batch_put_result(response: pb.BatchPutResponse, first: int) -> list[bool]:
    existed = []
    for i, status in enumerate(response.statuses):
        if status.code != 0:
            name = grpc.StatusCode(_code_by_value(status.code)).name
            raise BY_CODE_NAME.get(name, KvdError)(f"item {first + i}: {name}: {status.message}")
        existed.append(status.existed)
    return existed


def _code_by_value(value: int) -> tuple[int, str]:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code.value  # type: ignore[no-any-return]
    return grpc.StatusCode.UNKNOWN.value  # type: ignore[no-any-return]


def _batch_get_item(item: pb.GetItem) -> bytes | type[ResourceExhausted] | None:
    if item.code != 0:
        return ResourceExhausted  # too large for one response: fetch it alone
    if not item.found:
        return None
    if checksum(item.value) != item.checksum:
        raise DataLoss("value does not match its checksum")
    return item.value


def _single_get_request(ns: str, key: bytes) -> pb.BatchGetRequest:
    return pb.BatchGetRequest(namespace=ns, keys=[key], inline_bytes_max=INLINE_GET_BYTES_MAX)


def _copy_into(value: bytes | None, buffer: Buffer) -> int | None:
    if value is None:
        return None
    view = memoryview(buffer).cast("B")
    if len(value) > len(view):
        raise InvalidArgument(f"buffer of {len(view)} bytes is too small for {len(value)}")
    view[: len(value)] = value
    return len(value)


def _small_put_request(
    ns: str, key: bytes, value: Buffer, meta: bytes, parent: bytes | None, durable: bool
) -> pb.BatchPutRequest | None:
    """A one-item BatchPut for a small value (one unary call), else None."""
    view = memoryview(value).cast("B")
    if len(view) > BATCH_VALUE_BYTES_MAX:
        return None
    data = value if isinstance(value, bytes) else bytes(view)
    item = pb.PutItem(key=key, value=data, meta=meta, parent=parent or b"", checksum=checksum(view))
    return pb.BatchPutRequest(namespace=ns, items=[item], durable=durable)


def _lookup_result(response: pb.LookupResponse) -> LookupResult:
    return LookupResult(
        response.prefix_len,
        response.l1_hits,
        response.l2_hits,
        response.lease_id,
        response.lease_expires_ms,
    )


def _stats_dict(response: pb.StatsResponse) -> dict[str, Any]:
    out: dict[str, Any] = dict(response.values)
    out["version"] = response.version
    out["namespaces_detail"] = [
        {"name": n.name, "entries": n.entries, "bytes": n.bytes, "hits": n.hits, "misses": n.misses}
        for n in response.namespaces
    ]
    return out


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
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = _metadata(token)
        self._token = token
        self._channel = grpc.insecure_channel(grpc_target(target), options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        unix = grpc_target(target).startswith("unix:")
        self._want_shm = unix if shm is None else shm
        self._want_bulk = (not unix) if bulk is None else bulk
        self.bulk_threshold_bytes = bulk_threshold_bytes
        self._bulk_connections = bulk_connections
        self._paths_lock = threading.Lock()
        self._paths_known = False
        self._shm: ShmPath | None = None
        self._bulk: BulkClient | None = None

    def _fast_paths(self) -> tuple[ShmPath | None, BulkClient | None]:
        """The daemon's fast paths this client uses, found once (DescribePaths)."""
        if self._paths_known or not (self._want_shm or self._want_bulk):
            return self._shm, self._bulk
        with self._paths_lock:
            if not self._paths_known:
                try:
                    self._open_fast_paths()
                finally:
                    self._paths_known = True
        return self._shm, self._bulk

    def _open_fast_paths(self) -> None:
        try:
            paths = self._call(self._stub.DescribePaths, pb.DescribePathsRequest())
        except KvdError:
            return  # an older daemon: gRPC only
        if self._want_shm and paths.shm_dir:
            shm = ShmPath(
                paths.shm_dir,
                paths.max_region_bytes,
                lambda name, request: self._call(getattr(self._stub, name), request),
            )
            try:
                shm.open()  # the staging region proves the directory is shared with the daemon
                self._shm = shm
            except (OSError, KvdError):
                shm.close()
        if self._want_bulk and paths.bulk_port and not grpc_target(self.target).startswith("unix:"):
            host = grpc_target(self.target).rpartition(":")[0].strip("[]")
            self._bulk = BulkClient(
                host,
                paths.bulk_port,
                token=self._token,
                connections=self._bulk_connections,
                timeout_s=self.timeout_s,
            )

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
            _raise_for(exc)

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
        if bulk is not None and len(view) >= self.bulk_threshold_bytes:
            return bulk.put(ns, key, view, meta, parent, durable=durable)
        small = _small_put_request(ns, key, value, meta, parent, durable)
        if small is not None:
            return _batch_put_result(self._call(self._stub.BatchPut, small), 0)[0]
        response = self._call(self._stub.Put, _put_requests(ns, key, value, meta, parent, durable))
        return bool(response.existed)

    def _get(self, ns: str, key: bytes, assembler: _GetAssembler) -> None:
        call = self._stub.Get(
            pb.GetRequest(namespace=ns, key=key), timeout=self.timeout_s, metadata=self._metadata
        )
        try:
            for response in call:
                if not assembler.feed(response):
                    break
        except grpc.RpcError as exc:
            _raise_for(exc)
        except KvdError:
            call.cancel()
            raise

    def get(self, ns: str, key: bytes) -> bytes | None:
        shm, bulk = self._fast_paths()
        if shm is not None:
            return shm.get(ns, key)
        if bulk is not None:
            return bulk.get(ns, key)
        item = self._call(self._stub.BatchGet, _single_get_request(ns, key)).items[0]
        value = _batch_get_item(item)
        if value is not ResourceExhausted:
            return value  # type: ignore[return-value]
        assembler = _GetAssembler()
        self._get(ns, key, assembler)
        return assembler.value()

    def get_into(self, ns: str, key: bytes, buffer: Buffer) -> int | None:
        """Read a value into ``buffer``; its size, or None on a miss."""
        shm, bulk = self._fast_paths()
        view = memoryview(buffer).cast("B")
        if shm is not None:
            return shm.get_into(ns, key, view)
        if bulk is not None and len(view) >= self.bulk_threshold_bytes:
            return bulk.get_into(ns, key, view)
        item = self._call(self._stub.BatchGet, _single_get_request(ns, key)).items[0]
        value = _batch_get_item(item)
        if value is not ResourceExhausted:
            return _copy_into(value, buffer)  # type: ignore[arg-type]
        assembler = _GetAssembler(memoryview(buffer).cast("B"))
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
        listed = _put_items(items)
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
            return bulk.put_many(ns, puts)
        existed: list[bool] = []
        for first, group in _batches(listed):
            group_parent = listed[first - 1][0] if first else parent
            if len(group) == 1 and len(group[0][1]) > BATCH_VALUE_BYTES_MAX:
                key, value, meta = group[0]
                existed.append(self.put(ns, key, value, meta, group_parent if chained else None))
                continue
            response = self._call(
                self._stub.BatchPut, _batch_put_request(ns, group, group_parent, chained)
            )
            existed.extend(_batch_put_result(response, first))
        return existed

    def get_many(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        shm, bulk = self._fast_paths()
        if shm is not None:
            return [shm.get(ns, key) for key in keys]
        if bulk is not None:
            return bulk.get_many(ns, keys)
        out: list[bytes | None] = []
        for start in range(0, len(keys), BATCH_ITEMS_MAX):
            group = list(keys[start : start + BATCH_ITEMS_MAX])
            response = self._call(self._stub.BatchGet, pb.BatchGetRequest(namespace=ns, keys=group))
            for key, item in zip(group, response.items, strict=True):
                value = _batch_get_item(item)
                out.append(self.get(ns, key) if value is ResourceExhausted else value)  # type: ignore[arg-type]
        return out

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        response = self._call(self._stub.Exists, pb.ExistsRequest(namespace=ns, keys=list(keys)))
        return list(response.exists)

    def lookup(self, ns: str, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        """Length of the longest stored prefix of the chain ``keys``."""
        return self.lookup_ex(ns, keys, lease_ms).prefix_len

    def lookup_ex(self, ns: str, keys: Sequence[bytes], lease_ms: int = 0) -> LookupResult:
        request = pb.LookupRequest(namespace=ns, keys=list(keys), lease_ms=lease_ms)
        return _lookup_result(self._call(self._stub.Lookup, request))

    def release(self, ns: str, lease_id: int) -> bool:
        request = pb.ReleaseRequest(namespace=ns, lease_id=lease_id)
        return bool(self._call(self._stub.Release, request).released)

    def delete(self, ns: str, keys: Sequence[bytes]) -> int:
        response = self._call(self._stub.Delete, pb.DeleteRequest(namespace=ns, keys=list(keys)))
        return int(response.deleted)

    def delete_namespace(self, ns: str) -> int:
        response = self._call(self._stub.Delete, pb.DeleteRequest(namespace=ns, all_keys=True))
        return int(response.deleted)

    def stats(self, ns: str = "") -> dict[str, Any]:
        return _stats_dict(self._call(self._stub.Stats, pb.StatsRequest(namespace=ns)))


class AsyncClient:
    """The same calls as ``Client``, for asyncio code."""

    def __init__(
        self, target: str, *, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = _metadata(token)
        self._channel = grpc.aio.insecure_channel(grpc_target(target), options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            _raise_for(exc)

    async def put(
        self,
        ns: str,
        key: bytes,
        value: Buffer,
        meta: bytes = b"",
        parent: bytes | None = None,
        *,
        durable: bool = False,
    ) -> bool:
        small = _small_put_request(ns, key, value, meta, parent, durable)
        if small is not None:
            return _batch_put_result(await self._call(self._stub.BatchPut, small), 0)[0]
        requests = _aiter(_put_requests(ns, key, value, meta, parent, durable))
        return bool((await self._call(self._stub.Put, requests)).existed)

    async def _get(self, ns: str, key: bytes, assembler: _GetAssembler) -> None:
        call = self._stub.Get(
            pb.GetRequest(namespace=ns, key=key), timeout=self.timeout_s, metadata=self._metadata
        )
        try:
            async for response in call:
                if not assembler.feed(response):
                    break
        except grpc.RpcError as exc:
            _raise_for(exc)
        except KvdError:
            call.cancel()
            raise

    async def get(self, ns: str, key: bytes) -> bytes | None:
        item = (await self._call(self._stub.BatchGet, _single_get_request(ns, key))).items[0]
        value = _batch_get_item(item)
        if value is not ResourceExhausted:
            return value  # type: ignore[return-value]
        assembler = _GetAssembler()
        await self._get(ns, key, assembler)
        return assembler.value()

    async def get_into(self, ns: str, key: bytes, buffer: Buffer) -> int | None:
        item = (await self._call(self._stub.BatchGet, _single_get_request(ns, key))).items[0]
        value = _batch_get_item(item)
        if value is not ResourceExhausted:
            return _copy_into(value, buffer)  # type: ignore[arg-type]
        assembler = _GetAssembler(memoryview(buffer).cast("B"))
        await self._get(ns, key, assembler)
        return assembler.size_into()

    async def put_many(
        self,
        ns: str,
        items: Iterable[PutItemLike],
        *,
        chained: bool = False,
        parent: bytes | None = None,
    ) -> list[bool]:
        listed = _put_items(items)
        existed: list[bool] = []
        for first, group in _batches(listed):
            group_parent = listed[first - 1][0] if first else parent
            if len(group) == 1 and len(group[0][1]) > BATCH_VALUE_BYTES_MAX:
                key, value, meta = group[0]
                existed.append(
                    await self.put(ns, key, value, meta, group_parent if chained else None)
                )
                continue
            response = await self._call(
                self._stub.BatchPut, _batch_put_request(ns, group, group_parent, chained)
            )
            existed.extend(_batch_put_result(response, first))
        return existed

    async def get_many(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for start in range(0, len(keys), BATCH_ITEMS_MAX):
            group = list(keys[start : start + BATCH_ITEMS_MAX])
            response = await self._call(
                self._stub.BatchGet, pb.BatchGetRequest(namespace=ns, keys=group)
            )
            for key, item in zip(group, response.items, strict=True):
                value = _batch_get_item(item)
                out.append(await self.get(ns, key) if value is ResourceExhausted else value)  # type: ignore[arg-type]
        return out

    async def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        response = await self._call(
            self._stub.Exists, pb.ExistsRequest(namespace=ns, keys=list(keys))
        )
        return list(response.exists)

    async def lookup(self, ns: str, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        return (await self.lookup_ex(ns, keys, lease_ms)).prefix_len

    async def lookup_ex(self, ns: str, keys: Sequence[bytes], lease_ms: int = 0) -> LookupResult:
        request = pb.LookupRequest(namespace=ns, keys=list(keys), lease_ms=lease_ms)
        return _lookup_result(await self._call(self._stub.Lookup, request))

    async def release(self, ns: str, lease_id: int) -> bool:
        request = pb.ReleaseRequest(namespace=ns, lease_id=lease_id)
        return bool((await self._call(self._stub.Release, request)).released)

    async def delete(self, ns: str, keys: Sequence[bytes]) -> int:
        request = pb.DeleteRequest(namespace=ns, keys=list(keys))
        return int((await self._call(self._stub.Delete, request)).deleted)

    async def delete_namespace(self, ns: str) -> int:
        request = pb.DeleteRequest(namespace=ns, all_keys=True)
        return int((await self._call(self._stub.Delete, request)).deleted)

    async def stats(self, ns: str = "") -> dict[str, Any]:
        return _stats_dict(await self._call(self._stub.Stats, pb.StatsRequest(namespace=ns)))


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
