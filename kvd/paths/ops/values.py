"""The value ops under every transport, in plain Python values: fetch a
value for an op (a pinned ``Reader`` or None) and a batch of them, the
steps of a streamed put (begin, grow, publish, abort), a batch put, and
lookup, exists, release, delete and the stats values.

The bookkeeping each transport used to repeat lives here once: the fetch
time by tier (``metrics.fetched``), hits, misses and the bytes in and out,
labelled with the transport's op name (``get``, ``bulk_get``, ``shm_get``,
...). The gRPC service converts protobuf to these values and back, the bulk
port and ``RegionOps`` call them directly; nothing here imports grpc.

The hot gets (a lone 64 KiB get on the shm socket or the bulk port, ~30 µs)
come through here: the helpers take no allocation of their own, and the
synchronous ones (``open_now``, the counters) never await.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

from kvd.paths.metrics import Metrics
from kvd.paths.ops.calls import InflightBytes, ServiceLimits
from kvd.paths.ops.items import (
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    FetchedValue,
    ItemResult,
    PutItem,
    item_status,
)
from kvd.store.index import TIER_NAMES, PutResult, PutTicket, Reader
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from kvd.wire.errors import InvalidArgument, KvdError

if TYPE_CHECKING:
    from kvd.store.index import Namespace
    from kvd.wire.lookup import ChainShare, LookupResult


class PoolQueries(Protocol):
    """What the value ops ask of the node pool (``kvd.cluster.router.PoolRouter``)."""

    async def lookup(self, namespace: str, keys: list[bytes], lease_ms: int) -> LookupResult: ...

    async def exists(
        self, namespace: str, keys: list[bytes], *, chain: ChainShare | None = None
    ) -> list[bool]: ...

    async def fetch_many(
        self, namespace: str, keys: list[bytes], landed: Callable[[bytes], None] | None = None
    ) -> None: ...

    def learn(self, namespace: str, keys: list[bytes], chain: ChainShare) -> None: ...

    def answer_exists(self, namespace: str, keys: list[bytes], found: list[bool]) -> bytes: ...

    def expect(self, namespace: str, key: bytes, history: bytes) -> None: ...


class ValueOps:
    """The value ops of one daemon and what they share: the store, the
    metrics, the service limits and in-flight bytes, and the pool router
    when the daemon is part of a pool (set by the daemon)."""

    def __init__(self, store: Store, limits: ServiceLimits, metrics: Metrics) -> None:
        self.store = store
        self.limits = limits
        self.metrics = metrics
        self.inflight = InflightBytes(limits.max_inflight_bytes)
        self.pool: PoolQueries | None = None

    def check_batch(self, count: int) -> None:
        if count > self.limits.max_batch_items:
            raise InvalidArgument(
                f"{count} items in one batch, max_batch_items={self.limits.max_batch_items}"
            )

    # ---- fetch -----------------------------------------------------------------
    async def fetch(self, op: str, ns: str, key: bytes) -> Reader | None:
        """Pin ``key``'s value wherever it is (``Store.fetch``), counting the
        fetch's time by tier and a miss; the caller counts the hit (``hit``)
        once it serves the value, and closes the reader."""
        start = perf_counter()
        reader = await self.store.fetch(ns, key)
        if reader is None:
            self.metrics.fetched(op, "miss", start)
            self.metrics.misses.labels(op).inc()
            return None
        self.metrics.fetched(op, TIER_NAMES[reader.tier], start)
        return reader

    async def fetch_remote_many(
        self, ns: str, keys: Iterable[bytes], landed: Callable[[bytes], None] | None = None
    ) -> None:
        """In a pool, read the keys of a batch that other members own and
        this daemon lacks into L1 at once (``PoolQueries.fetch_many``), so
        the batch's own reads then find them here: one peer round trip for
        the batch, not one per key; ``landed(key)`` as each one arrives.
        Nothing is counted here (the batch's reads count their hits and
        misses); outside a pool ``keys`` is not even iterated."""
        if self.pool is not None:
            await self.pool.fetch_many(ns, list(keys), landed)

    async def fetch_many(self, op: str, ns: str, keys: Sequence[bytes]) -> dict[int, Reader | None]:
        """``Store.fetch_many``: the values of a batch only on L2, read together,
        by index into ``keys``; their fetch time is counted, a miss is not
        (the caller counts it with ``missed`` when it answers the item)."""
        start = perf_counter()
        found = await self.store.fetch_many(ns, keys)
        for reader in found.values():
            self.fetched(op, "l2" if reader else "miss", start)
        return found

    def open_now(self, op: str, ns: str, key: bytes) -> Reader | None:
        """Pin ``key``'s value if it is in L1, without waiting (``Store.open``)."""
        start = perf_counter()
        reader = self.store.open(ns, key)
        if reader is not None:
            self.metrics.fetched(op, "l1", start)
        return reader

    def fetched(self, op: str, tier: str, start_s: float) -> None:
        """A store read of ``op`` that began at ``start_s`` (perf_counter), by tier."""
        self.metrics.fetched(op, tier, start_s)

    def missed(self, op: str) -> None:
        self.metrics.misses.labels(op).inc()

    def hit(self, op: str, tier: str) -> None:
        self.metrics.hits.labels(op, tier).inc()

    def sent(self, op: str, nbytes: int) -> None:
        """Value bytes ``op`` handed out."""
        self.metrics.bytes.labels(op, "out").inc(nbytes)

    def served(self, op: str, tier: str, nbytes: int, hits: int = 1) -> None:
        """``hits`` hits whose ``nbytes`` (together) were handed out at once."""
        metrics = self.metrics
        metrics.hits.labels(op, tier).inc(hits)
        metrics.bytes.labels(op, "out").inc(nbytes)

    def pin_now(self, op: str, ns: str, keys: Sequence[bytes]) -> list[Reader | None]:
        """Pin the values of ``keys`` that are in L1, without waiting and
        without views of their pages (``Store.open``): for a client that reads
        the pages itself. One fetch time for the batch; hits are counted by
        the caller (``served``) once it hands them out."""
        start = perf_counter()
        store = self.store
        readers = [store.open(ns, key, views=False) for key in keys]
        self.metrics.fetched(op, "l1", start)
        return readers

    def received(self, op: str, nbytes: int) -> None:
        """Value bytes ``op`` stored."""
        self.metrics.bytes.labels(op, "in").inc(nbytes)

    async def get_many(
        self, op: str, ns: str, keys: Sequence[bytes], budget_bytes: int, inline_bytes_max: int
    ) -> list[FetchedValue]:
        """A batch get answered inline: each value copied out while the
        answer's ``budget_bytes`` last; a value over what is left, or over
        ``inline_bytes_max``, is answered RESOURCE_EXHAUSTED (found). In a
        pool, the keys other nodes own are read into L1 first, together."""
        self.check_batch(len(keys))
        await self.fetch_remote_many(ns, keys)
        values = []
        for key in keys:
            reader = await self.fetch(op, ns, key)
            if reader is None:
                values.append(FetchedValue(code=NOT_FOUND))
                continue
            try:
                if reader.size > min(budget_bytes, inline_bytes_max):
                    values.append(FetchedValue(code=RESOURCE_EXHAUSTED))
                    continue
                budget_bytes -= reader.size
                value = b"".join(reader.views)
                self.served(op, TIER_NAMES[reader.tier], reader.size)
                values.append(FetchedValue(0, value, reader.meta, reader.checksum, reader.tier))
            finally:
                reader.close()
        return values

    # ---- put -------------------------------------------------------------------
    async def begin_upload(
        self,
        ns: str,
        key: bytes,
        size: int,
        meta: bytes,
        parent: bytes | None,
        checksum_sent: int | None,
        durable: bool = False,
    ) -> PutTicket | PutResult:
        """A put whose bytes are yet to arrive: no page yet (``grow`` adds
        them as bytes arrive), or the answer when the key holds these bytes
        (``durable``: once they are on L2)."""
        begun = self.store.begin_upload(ns, key, size, meta, parent, checksum_sent)
        return await self._durable(begun, ns, key, durable)

    async def begin_put(
        self,
        ns: str,
        key: bytes,
        size: int,
        meta: bytes,
        parent: bytes | None,
        checksum_sent: int | None,
        durable: bool = False,
    ) -> PutTicket | PutResult:
        """A put whose bytes have all arrived: its pages at once (or the
        answer, as ``begin_upload``)."""
        begun = await self.store.begin_put(ns, key, size, meta, parent, checksum_sent)
        return await self._durable(begun, ns, key, durable)

    async def _durable(
        self, begun: PutTicket | PutResult, ns: str, key: bytes, durable: bool
    ) -> PutTicket | PutResult:
        """A durable put of a key found stored answers once its value is on L2
        too, as one that stores it does (``Store.publish``)."""
        if durable and isinstance(begun, PutResult):
            await self.store.make_durable(ns, key)
        return begun

    async def grow(self, ticket: PutTicket, nbytes: int) -> list[memoryview]:
        """Pages for the ticket's next ``nbytes``, waiting for write-back to make room."""
        return await self.store.grow_put(ticket, nbytes)

    async def publish(
        self, op: str, ticket: PutTicket, checksum_got: int, durable: bool
    ) -> PutResult:
        """Make the ticket's value visible (checked against ``checksum_got``);
        its bytes count as ``op``'s bytes in."""
        result = await self.store.publish(ticket, checksum_got, durable)
        self.received(op, ticket.size)
        return result

    def abort(self, ticket: PutTicket) -> None:
        """Give back an unpublished ticket's pages; nothing once published."""
        self.store.abort_put(ticket)

    async def put_many(
        self, op: str, ns: str, items: Sequence[PutItem], chained: bool, durable: bool
    ) -> list[ItemResult]:
        """A batch of whole values; each fails alone (a status). ``chained``:
        an item without a parent has the previous one's key as its parent."""
        self.check_batch(len(items))
        results = []
        previous: bytes | None = None
        for item in items:
            parent = item.parent or (previous if chained else None)
            previous = item.key
            try:
                result = await self.store.put(
                    ns,
                    item.key,
                    item.value,
                    item.meta,
                    parent,
                    item.checksum,
                    hasher=checksum,
                    durable=durable,
                )
            except KvdError as exc:
                results.append(item_status(exc))
                continue
            self.received(op, len(item.value))
            results.append(ItemResult(checksum=result.checksum, existed=result.existed))
        return results

    # ---- index -----------------------------------------------------------------
    async def lookup(self, op: str, ns: str, keys: Sequence[bytes], lease_ms: int) -> LookupResult:
        """The longest stored prefix of a chain (its owners asked in a pool),
        its hits counted by tier and a miss when it stops short."""
        if self.pool is not None:
            result = await self.pool.lookup(ns, list(keys), lease_ms)
        else:
            result = self.store.lookup(ns, keys, lease_ms)
        return self._counted(op, keys, result)

    def lookup_now(
        self, op: str, ns: str, keys: Sequence[bytes], lease_ms: int
    ) -> LookupResult | None:
        """``lookup`` when it needs no waiting (no pool to ask), else None."""
        if self.pool is not None:
            return None
        return self._counted(op, keys, self.store.lookup(ns, keys, lease_ms))

    def _counted(self, op: str, keys: Sequence[bytes], result: LookupResult) -> LookupResult:
        if result.prefix_len:
            self.metrics.hits.labels(op, "l1").inc(result.l1_hits)
            self.metrics.hits.labels(op, "l2").inc(result.l2_hits)
        if result.prefix_len < len(keys):
            self.metrics.misses.labels(op).inc()
        return result

    async def exists(
        self, ns: str, keys: Sequence[bytes], *, chain: ChainShare | None = None
    ) -> list[bool]:
        """Which keys are held; ``chain`` is a pool peer's lookup (PoolQueries)."""
        if self.pool is not None:
            return await self.pool.exists(ns, list(keys), chain=chain)
        return self.store.exists(ns, keys)

    def release(self, lease_id: int, ns: str) -> bool:
        return self.store.release(lease_id, ns)

    async def delete(self, ns: str, keys: Sequence[bytes], all_keys: bool) -> int:
        """Delete ``keys``, or with ``all_keys`` the whole namespace; the count deleted."""
        if all_keys:
            if keys:
                raise InvalidArgument("Delete takes keys or all_keys, not both")
            return await self.store.delete_namespace(ns)
        return await self.store.delete(ns, keys)

    def stats(self, daemon_wide: bool, ns: str) -> tuple[dict[str, int], list[Namespace]]:
        """The daemon-wide numbers (empty unless ``daemon_wide``: they sum over
        every tenant) and the namespaces, all of them or the one named."""
        self.store.active_leases  # noqa: B018 - expires stale leases before counting
        values: dict[str, int] = {}
        if daemon_wide:
            values = self.store.stats()
            values["inflight_bytes"] = self.inflight.bytes
            values["inflight_requests"] = self.inflight.requests
        namespaces = [n for n in self.store.namespaces() if not ns or n.name == ns]
        return values, namespaces
