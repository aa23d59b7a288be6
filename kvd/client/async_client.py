"""The thin client for asyncio code: ``AsyncClient``, the blocking
``Client``'s calls (``kvd.client.clients``) over gRPC's asyncio channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc

from kvd.client.calls import (
    BATCH_ITEMS_MAX,
    BATCH_VALUE_BYTES_MAX,
    DEFAULT_TIMEOUT_S,
    Buffer,
    GetAssembler,
    PutItemLike,
    Tls,
    batch_get_item,
    batch_put_request,
    batch_put_result,
    batches,
    copy_into,
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
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import (
    InvalidArgument,
    KvdError,
    ResourceExhausted,
)
from kvd.wire.grpc import KVStoreStub
from kvd.wire.lookup import LookupResult


class AsyncClient:
    """The same calls as ``Client``, for asyncio code."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: Tls | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = metadata(token)
        self._channel = open_channel(target, tls, aio=True)
        self._stub = KVStoreStub(self._channel)

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
            raise_for(exc)

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
        small = small_put_request(ns, key, value, meta, parent, durable)
        if small is not None:
            return batch_put_result(await self._call(self._stub.BatchPut, small), 0)[0]
        requests = _aiter(put_requests(ns, key, value, meta, parent, durable))
        return bool((await self._call(self._stub.Put, requests)).existed)

    async def _get(self, ns: str, key: bytes, assembler: GetAssembler) -> None:
        call = self._stub.Get(
            pb.GetRequest(namespace=ns, key=key), timeout=self.timeout_s, metadata=self._metadata
        )
        try:
            async for response in call:
                if not assembler.feed(response):
                    break
        except grpc.RpcError as exc:
            raise_for(exc)
        except KvdError:
            call.cancel()
            raise

    async def get(self, ns: str, key: bytes) -> bytes | None:
        item = (await self._call(self._stub.BatchGet, single_get_request(ns, key))).items[0]
        value = batch_get_item(item)
        if value is not ResourceExhausted:
            return value  # type: ignore[return-value]
        assembler = GetAssembler()
        await self._get(ns, key, assembler)
        return assembler.value()

    async def get_into(self, ns: str, key: bytes, buffer: Buffer) -> int | None:
        item = (await self._call(self._stub.BatchGet, single_get_request(ns, key))).items[0]
        value = batch_get_item(item)
        if value is not ResourceExhausted:
            return copy_into(value, buffer)  # type: ignore[arg-type]
        assembler = GetAssembler(memoryview(buffer).cast("B"))
        await self._get(ns, key, assembler)
        return assembler.size_into()

    async def get_many_into(
        self, ns: str, keys: Sequence[bytes], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        return [
            await self.get_into(ns, key, buffer) for key, buffer in zip(keys, buffers, strict=True)
        ]

    async def put_many(
        self,
        ns: str,
        items: Iterable[PutItemLike],
        *,
        chained: bool = False,
        parent: bytes | None = None,
    ) -> list[bool]:
        listed = put_items(items)
        existed: list[bool] = []
        for first, group in batches(listed):
            group_parent = listed[first - 1][0] if first else parent
            if len(group) == 1 and len(group[0][1]) > BATCH_VALUE_BYTES_MAX:
                key, value, meta = group[0]
                existed.append(
                    await self.put(ns, key, value, meta, group_parent if chained else None)
                )
                continue
            response = await self._call(
                self._stub.BatchPut, batch_put_request(ns, group, group_parent, chained)
            )
            existed.extend(batch_put_result(response, first))
        return existed

    async def get_many(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for start in range(0, len(keys), BATCH_ITEMS_MAX):
            group = list(keys[start : start + BATCH_ITEMS_MAX])
            response = await self._call(
                self._stub.BatchGet, pb.BatchGetRequest(namespace=ns, keys=group)
            )
            for key, item in zip(group, response.items, strict=True):
                value = batch_get_item(item)
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
        return lookup_result(await self._call(self._stub.Lookup, request))

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
        return stats_dict(await self._call(self._stub.Stats, pb.StatsRequest(namespace=ns)))


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
