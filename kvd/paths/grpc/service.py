"""The KVStore gRPC service: request validation, byte movement between
gRPC messages and pool pages, and the region RPCs' conversion between
protobuf and the op layer's plain values (``kvd.paths.ops``).

Each handler runs on the daemon's one event loop, converts its request
into plain values and calls the op layer: ``ValueOps`` for values and the
index, ``RegionOps`` for regions. Limits enforced here: message sizes (by the gRPC server options),
batch sizes, and in-flight value bytes (``InflightBytes``): a request that
would push the total over ``max_inflight_bytes`` is refused with
RESOURCE_EXHAUSTED at once rather than queued. A Put stream counts and
takes pool pages for its chunks as they arrive, never for the size its
header declares, and has ``grpc_put_timeout_ms`` to arrive in full.

Every handler runs inside the op layer's ``Tally`` (timing, counts, the
refusal metric); what is gRPC's alone is here: a typed error that leaves a
handler aborts the call with its code (``kvd.paths.grpc.status``).

``PutFromRegion``/``GetIntoRegion`` are ``RegionOps``' batch put and get
(the shm socket serves the same ops without gRPC); ``AttachRegion`` by file
name is refused: regions are sealed memfds passed on the shm socket
(``kvd.paths.shm.regions``). Region calls over gRPC carry no peer
credentials; they are bound to the token's principal (and the region's
secret token) only. ``DescribePaths`` tells clients which fast paths this
daemon offers, and who serves the shm socket (uid, pid, pid namespace) so
that a client can check its peer before it sends a token there;
``kvd.daemon.fast_paths`` starts and stops what serves them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import wraps
from typing import Any, TypeVar

from google.protobuf.message import Message

from kvd import __version__
from kvd.cluster import scope
from kvd.l1.pool import ViewWriter, chunked
from kvd.paths.auth import Authenticator, bearer_token
from kvd.paths.grpc.auth import check_grpc, grpc_principal, request_scope
from kvd.paths.grpc.status import status_code
from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import ServiceLimits, Tally
from kvd.paths.ops.items import (
    NOT_FOUND,
    FetchedValue,
    ItemResult,
    PutItem,
    RegionBatch,
    RegionItem,
)
from kvd.paths.ops.region_ops import RegionOps
from kvd.paths.ops.values import ValueOps
from kvd.paths.shm.regions import AttachRefused, Caller, RegionRegistry
from kvd.store.index import TIER_L1, TIER_L2, TIER_NAMES, PutResult
from kvd.store.store import Store
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.bulk import BULK_OPS
from kvd.wire.checksum import Hasher
from kvd.wire.errors import DeadlineExceeded, InvalidArgument, KvdError
from kvd.wire.grpc import POOL_VERSION
from kvd.wire.lookup import ChainShare
from kvd.wire.shm import pid_namespace, shm_ops

# 1 MiB messages: server-streamed 1 MiB chunks carry ~0.9 GB/s here, against
# ~0.56 GB/s for one 4 MiB message and ~0.1 GB/s for 64 KiB ones.
CHUNK_BYTES = 1 << 20

# Room left in a BatchGet response for per-item framing and metadata.
_BATCH_OVERHEAD_BYTES = 64 * 1024


BULK_PROTOCOL_VERSION = 1
_PID_NS = pid_namespace()
# The store's tier numbers are the proto's (kvd.store.index); 0: none given.
_PB_TIERS = {0: pb.TIER_UNSPECIFIED, TIER_L1: pb.TIER_L1, TIER_L2: pb.TIER_L2}

Handler = TypeVar("Handler", bound=Callable[..., Any])


def _unary(op: str, pooled: bool = True) -> Callable[[Handler], Handler]:
    """Serves a unary (or client-streaming) handler inside a ``Tally``; a
    typed error aborts the call with its code. ``pooled``: the call runs in
    its pool scope (its deadline, whether a peer sent it)."""

    def wrap(fn: Handler) -> Handler:
        @wraps(fn)
        async def handler(self: KVStoreService, request: Any, context: Any) -> Any:
            pool_scope = self._enter_pool(context) if pooled else None
            try:
                with Tally(self.metrics, op, self.inflight):
                    if isinstance(request, Message):  # Put checks once its header arrived
                        namespace, admin = request_scope(request)
                        check_grpc(self.auth, context, namespace, admin=admin)
                    return await fn(self, request, context)
            except KvdError as exc:
                await context.abort(status_code(exc), str(exc))
            finally:
                if pool_scope is not None:
                    scope.leave(pool_scope)

        return handler  # type: ignore[return-value]

    return wrap


class KVStoreService:
    def __init__(
        self,
        store: Store,
        limits: ServiceLimits,
        metrics: Metrics,
        auth: Authenticator | None = None,
    ) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.auth = auth
        self.values = ValueOps(store, limits, metrics)
        self.inflight = self.values.inflight
        self.region_ops = RegionOps(self.values, auth)

    @property
    def regions(self) -> RegionRegistry | None:
        """The shared-memory regions; None without a shared-memory path."""
        return self.region_ops.regions

    def _enter_pool(self, context: Any) -> Any:
        """The pool scope of this call (its deadline, whether a peer sent it), or None."""
        if self.values.pool is None:  # set when the daemon is part of a pool
            return None
        return scope.enter(context.invocation_metadata(), context.time_remaining())

    # ---- Put -------------------------------------------------------------------
    @_unary("put")
    async def Put(
        self, request_iterator: AsyncIterator[pb.PutRequest], context: Any
    ) -> pb.PutResponse:
        try:
            async with asyncio.timeout(self.limits.put_timeout_s):
                return await self._put_stream(request_iterator, context)
        except TimeoutError:
            raise DeadlineExceeded(
                f"Put stream not complete within grpc_put_timeout_ms="
                f"{self.limits.put_timeout_s * 1000:g}"
            ) from None

    async def _put_stream(
        self, request_iterator: AsyncIterator[pb.PutRequest], context: Any
    ) -> pb.PutResponse:
        """Pages are reserved, and bytes counted in flight, as each chunk
        arrives (``Store.grow_put``): a stream that declares 64 MiB and stalls
        holds what it sent, not what it declared."""
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("a Put stream starts with a header")
        h = first.header
        check_grpc(self.auth, context, h.namespace)
        checksum_sent = h.checksum if h.HasField("checksum") else None
        values = self.values
        ticket = await values.begin_upload(
            h.namespace, h.key, h.size, h.meta, h.parent or None, checksum_sent, h.durable
        )
        if isinstance(ticket, PutResult):
            return pb.PutResponse(existed=True, checksum=ticket.checksum)
        held = 0
        try:
            hasher = Hasher()
            if h.size == 0:
                await values.grow(ticket, 0)  # an empty value's one page
            async for message in _prepend(first, request_iterator):
                if message is not first and message.HasField("header"):
                    raise InvalidArgument("a Put stream has one header")
                data = message.data
                if ticket.covered_bytes + len(data) > h.size:
                    raise InvalidArgument(
                        f"Put chunks add up to more than the declared {h.size} bytes"
                    )
                if not data:
                    continue
                values.inflight.acquire(len(data))
                held += len(data)
                ViewWriter(await values.grow(ticket, len(data))).write(data)
                hasher.update(data)
            if ticket.covered_bytes != h.size:
                raise InvalidArgument(
                    f"Put chunks add up to {ticket.covered_bytes} bytes, the header declared "
                    f"{h.size}"
                )
            result = await values.publish("put", ticket, hasher.value(), h.durable)
        finally:
            values.abort(ticket)
            values.inflight.release(held)
        return pb.PutResponse(existed=result.existed, checksum=result.checksum)

    # ---- Get -------------------------------------------------------------------
    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetResponse]:
        held = 0
        pool_scope = self._enter_pool(context)
        try:
            with Tally(self.metrics, "get", self.inflight):
                check_grpc(self.auth, context, request.namespace)
                values = self.values
                reader = await values.fetch("get", request.namespace, request.key)
                if reader is None:
                    yield pb.GetResponse(header=pb.GetHeader(found=False))
                    return
                try:
                    values.inflight.acquire(reader.size)
                    held = reader.size
                    values.hit("get", TIER_NAMES[reader.tier])
                    header = pb.GetHeader(
                        found=True,
                        size=reader.size,
                        checksum=reader.checksum,
                        meta=reader.meta,
                        tier=pb.Tier.Name(reader.tier),
                    )
                    pieces = chunked(reader.views, CHUNK_BYTES)
                    if not pieces:
                        yield pb.GetResponse(header=header)
                    for i, piece in enumerate(pieces):
                        data = bytes(piece[0]) if len(piece) == 1 else b"".join(piece)
                        yield pb.GetResponse(header=header if i == 0 else None, data=data)
                    values.sent("get", reader.size)
                finally:
                    reader.close()
        except KvdError as exc:
            await context.abort(status_code(exc), str(exc))
        finally:
            if pool_scope is not None:
                scope.leave(pool_scope)
            if held:
                self.inflight.release(held)

    # ---- batches ---------------------------------------------------------------
    @_unary("batch_put")
    async def BatchPut(self, request: pb.BatchPutRequest, context: Any) -> pb.BatchPutResponse:
        items = [
            PutItem(
                item.key,
                item.value,
                item.meta,
                item.parent,
                item.checksum if item.HasField("checksum") else None,
            )
            for item in request.items
        ]
        results = await self.values.put_many(
            "batch_put", request.namespace, items, request.chained, request.durable
        )
        return pb.BatchPutResponse(
            statuses=[
                pb.ItemStatus(
                    code=r.code, message=r.message, existed=r.existed, checksum=r.checksum
                )
                for r in results
            ]
        )

    @_unary("batch_get")
    async def BatchGet(self, request: pb.BatchGetRequest, context: Any) -> pb.BatchGetResponse:
        budget = self.limits.max_message_bytes - _BATCH_OVERHEAD_BYTES
        fetched = await self.values.get_many(
            "batch_get", request.namespace, request.keys, budget, request.inline_bytes_max or budget
        )
        return pb.BatchGetResponse(items=[_get_item(value) for value in fetched])

    # ---- index -----------------------------------------------------------------
    @_unary("exists")
    async def Exists(self, request: pb.ExistsRequest, context: Any) -> pb.ExistsResponse:
        chain = None
        if request.chain_length:
            chain = ChainShare(
                request.chain_length, list(request.chain_positions), request.chain_untold
            )
        found = await self.values.exists(request.namespace, request.keys, chain=chain)
        return pb.ExistsResponse(exists=found)

    @_unary("lookup")
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        result = await self.values.lookup(
            "lookup", request.namespace, request.keys, request.lease_ms
        )
        return pb.LookupResponse(
            prefix_len=result.prefix_len,
            l1_hits=result.l1_hits,
            l2_hits=result.l2_hits,
            lease_id=result.lease_id,
            lease_expires_ms=result.lease_ms,
        )

    @_unary("release")
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        released = self.values.release(request.lease_id, request.namespace)
        return pb.ReleaseResponse(released=released)

    @_unary("delete")
    async def Delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        deleted = await self.values.delete(request.namespace, request.keys, request.all_keys)
        return pb.DeleteResponse(deleted=deleted)

    @_unary("stats")
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        # Daemon-wide numbers sum over every tenant: admin only, with auth on.
        admin = self.auth is None or self.auth.is_admin(bearer_token(context.invocation_metadata()))
        values, found = self.values.stats(admin, request.namespace)
        namespaces = [
            pb.NamespaceStats(
                name=ns.name,
                entries=len(ns.entries),
                bytes=ns.bytes_stored,
                hits=ns.hits,
                misses=ns.misses,
            )
            for ns in found
        ]
        return pb.StatsResponse(values=values, namespaces=namespaces, version=__version__)

    # ---- regions ---------------------------------------------------------------------
    def _grpc_caller(self, context: Any) -> Caller:
        """A gRPC caller has no peer credentials: its token's principal only."""
        return Caller(None, principal=grpc_principal(self.auth, context))

    @_unary("attach_region", pooled=False)
    async def AttachRegion(
        self, request: pb.AttachRegionRequest, context: Any
    ) -> pb.AttachRegionResponse:
        raise AttachRefused(
            "regions are attached on the shm socket, as a sealed memfd passed with "
            "SCM_RIGHTS; the daemon does not open region files by name"
        )

    @_unary("detach_region", pooled=False)
    async def DetachRegion(
        self, request: pb.DetachRegionRequest, context: Any
    ) -> pb.DetachRegionResponse:
        caller = self._grpc_caller(context)
        self.region_ops.detach_region(request.region_id, request.token, caller)
        return pb.DetachRegionResponse()

    @_unary("describe_paths", pooled=False)
    async def DescribePaths(
        self, request: pb.DescribePathsRequest, context: Any
    ) -> pb.DescribePathsResponse:
        ops = self.region_ops
        regions = ops.regions
        max_value_bytes = self.values.store.limits.max_value_bytes
        if regions is None or not ops.shm_socket:
            return pb.DescribePathsResponse(
                bulk_port=ops.bulk_port,
                bulk_version=BULK_PROTOCOL_VERSION if ops.bulk_port else 0,
                bulk_ops=BULK_OPS if ops.bulk_port else (),
                max_value_bytes=max_value_bytes,
                pool_version=POOL_VERSION,
                bulk_tls=ops.bulk_tls,
            )
        return pb.DescribePathsResponse(
            shm_dir=os.path.dirname(ops.shm_socket),
            max_region_bytes=regions.limits.max_region_bytes,
            max_regions_per_client=regions.limits.max_regions_per_client,
            bulk_port=ops.bulk_port,
            regions_attached=regions.count,
            bulk_version=BULK_PROTOCOL_VERSION if ops.bulk_port else 0,
            shm_socket=ops.shm_socket,
            daemon_uid=os.geteuid(),
            daemon_pid=os.getpid(),
            daemon_pid_ns=_PID_NS,
            daemon_clock_ns=time.monotonic_ns(),
            shm_ops=shm_ops(ops.pool_reads),
            bulk_ops=BULK_OPS if ops.bulk_port else (),
            max_value_bytes=max_value_bytes,
            pool_version=POOL_VERSION,
            bulk_tls=ops.bulk_tls,
        )

    @_unary("shm_put", pooled=False)
    async def PutFromRegion(
        self, request: pb.PutFromRegionRequest, context: Any
    ) -> pb.RegionBatchResponse:
        batch = RegionBatch(
            request.region_id,
            request.token,
            request.namespace,
            _region_items(request.items),
            request.deadline_ns,
            chained=request.chained,
            durable=request.durable,
        )
        results = await self.region_ops.put_from_region(batch, self._grpc_caller(context))
        return _region_response(results)

    @_unary("shm_get", pooled=False)
    async def GetIntoRegion(
        self, request: pb.GetIntoRegionRequest, context: Any
    ) -> pb.RegionBatchResponse:
        batch = RegionBatch(
            request.region_id,
            request.token,
            request.namespace,
            _region_items(request.items),
            request.deadline_ns,
        )
        results = await self.region_ops.get_into_region(batch, self._grpc_caller(context))
        return _region_response(results)


def _get_item(value: FetchedValue) -> pb.GetItem:
    if value.code == NOT_FOUND:
        return pb.GetItem(found=False)
    if value.code:
        return pb.GetItem(found=True, code=value.code)
    return pb.GetItem(
        found=True,
        value=value.value,
        meta=value.meta,
        checksum=value.checksum,
        tier=_PB_TIERS[value.tier],
    )


def _region_items(items: Sequence[pb.RegionItem]) -> list[RegionItem]:
    return [
        RegionItem(
            item.key,
            item.offset,
            item.length,
            item.checksum if item.HasField("checksum") else None,
            item.meta,
            item.parent,
        )
        for item in items
    ]


def _region_response(results: list[ItemResult]) -> pb.RegionBatchResponse:
    return pb.RegionBatchResponse(
        results=[
            pb.RegionItemResult(
                code=r.code,
                message=r.message,
                size=r.size,
                checksum=r.checksum,
                meta=r.meta,
                tier=_PB_TIERS[r.tier],
                existed=r.existed,
            )
            for r in results
        ]
    )


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
