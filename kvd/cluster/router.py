"""The local daemon answering for the pool: a lookup of a chain across the
owners of its keys, a get of a key this daemon lacks from its owner, and a
put handed on to its owner.

- **Lookup**: the chain's local prefix first (``Store.lookup``, leases
  included). For the rest, up to the first key this daemon owns itself (it
  would hold that one), each owner gets one Exists of its keys, all owners
  at once; the answer's prefix runs on through the keys found. Remote keys
  count as ``l2_hits`` (held, not in local memory) and are not leased.
- **Get**: a local miss asks the key's owner (``Store.on_miss``); the value
  is read into local L1 pages over the owner's bulk TCP port (or gRPC:
  ``kvd.cluster.peer_reads``), checked against the checksum the owner sent
  before it becomes visible (a second get is local), and returned from
  there. Concurrent gets of one key share one peer read.
- **Put**: lands here first and is answered from here (an engine's get after
  its own put stays on its node, and the put waits on no network); if
  another member owns the key the value is then handed to it in the
  background, so a lookup from any node finds it (a bounded queue:
  ``FORWARD_QUEUE_MAX``; past it the owner does not get the value, counted).

A dead, slow or partitioned peer is a miss within the caller's deadline
(kvd.cluster.scope): a peer error, a timeout or a checksum mismatch is
counted and answered as "not found", never as an error or as its bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, fields

from kvd.cluster import scope
from kvd.cluster.membership import Membership
from kvd.cluster.peer_reads import HIT, MISS, PeerReads
from kvd.cluster.peers import PeerError, Peers
from kvd.store.index import Entry, Reader
from kvd.store.store import Store
from kvd.wire.errors import KvdError
from kvd.wire.lookup import LookupResult

log = logging.getLogger("kvd.cluster")

# Puts waiting to reach their owner; a burst past it is dropped (the put is
# still here), since queuing without end would hold up to this many values'
# worth of L1 pages pinned by readers later.
FORWARD_QUEUE_MAX = 4096
# Forwards in flight at once: each holds one value copy (<= max_value_bytes).
FORWARD_WORKERS = 4
# A forward is background work: it may take longer than a caller's lookup
# (64 MiB over loopback gRPC takes ~70 ms), but not for ever.
FORWARD_TIMEOUT_S = 10.0
# A member whose call just failed is skipped (a miss at once) for this long,
# then tried again: a batch of 100 gets owned by a stopped peer costs one
# timeout, not 100 (each would spend pool_peer_timeout_ms).
PEER_DOWN_S = 1.0
# Peer reads one batch may have in flight (each holds one value in transit).
FETCH_PARALLEL_MAX = 32
# Peer errors logged per member before the rest are only counted.
ERRORS_LOGGED_MAX = 10


@dataclass
class PoolCounters:
    """Plain integers the metrics collector reads at scrape time."""

    remote_lookups: int = 0  # lookups and exists that asked at least one peer
    remote_lookup_hits: int = 0  # chain keys found on a peer
    remote_gets: int = 0
    remote_hits: int = 0
    remote_misses: int = 0
    peer_errors: int = 0  # failed or timed-out peer calls (each a miss)
    peer_skips: int = 0  # calls not made: the member failed within PEER_DOWN_S
    checksum_mismatches: int = 0  # peer values whose bytes failed their checksum
    forwards: int = 0
    forward_errors: int = 0
    forwards_dropped: int = 0


class PoolRouter:
    """Pool lookups, remote gets and put forwarding over ``membership``."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        peers: Peers,
        reads: PeerReads,
        peer_timeout_s: float,
    ) -> None:
        self.store = store
        self.membership = membership
        self.peers = peers
        self.reads = reads
        self.peer_timeout_s = peer_timeout_s
        self.counters = PoolCounters()
        self._fetching: dict[tuple[str, bytes], asyncio.Task[bool]] = {}
        self._forward_queue: asyncio.Queue[tuple[str, bytes, str]] = asyncio.Queue(
            FORWARD_QUEUE_MAX
        )
        self._workers: list[asyncio.Task[None]] = []
        self._errors_logged: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        membership.on_change(self._members_changed)

    def start(self) -> None:
        """Take the store's miss and put hooks; start the forwarders (on the loop)."""
        self.store.on_miss = self.fetch_remote
        self.store.on_put = self._put_done
        self._workers = [
            asyncio.create_task(self._forward_loop(), name=f"kvd-pool-forward-{i}")
            for i in range(FORWARD_WORKERS)
        ]

    async def close(self) -> None:
        self.store.on_miss = None
        self.store.on_put = None
        tasks = [*self._workers, *self._fetching.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.reads.close()
        await self.peers.close()

    def stats(self) -> dict[str, int]:
        values = {f.name: getattr(self.counters, f.name) for f in fields(self.counters)}
        values["members"] = len(self.membership.members)
        values["membership_stale"] = int(self.membership.stale)
        values["membership_changes"] = self.membership.changes
        values["membership_refused"] = self.membership.refused
        values["forward_queue"] = self._forward_queue.qsize()
        return values

    def _members_changed(self, members: tuple[str, ...]) -> None:
        self.reads.retain(members)
        task = asyncio.get_running_loop().create_task(self.peers.retain(members))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _remote_owner(self, namespace: str, key: bytes) -> str | None:
        """The key's owner when it is another member, else None."""
        if len(self.membership.members) == 1:
            return None
        owner = self.membership.placement.owner(namespace, key)
        return None if owner == self.membership.advertise else owner

    def _is_down(self, member: str) -> bool:
        until = self._down_until.get(member)
        if until is None:
            return False
        if time.monotonic() < until:
            self.counters.peer_skips += 1
            return True
        del self._down_until[member]  # time to try it again
        return False

    def _peer_failed(self, error: PeerError, member: str) -> None:
        self.counters.peer_errors += 1
        self.reads.traffic.failed(member, error.kind)
        self._down_until[member] = time.monotonic() + PEER_DOWN_S
        logged = self._errors_logged.get(member, 0)
        if logged < ERRORS_LOGGED_MAX:
            self._errors_logged[member] = logged + 1
            log.warning(
                "peer call failed; answered as a miss",
                extra={"peer": member, "kind": error.kind, "error": str(error)},
            )

    # ---- lookup and exists ------------------------------------------------------
    async def lookup(self, namespace: str, keys: list[bytes], lease_ms: int) -> LookupResult:
        """The chain's longest prefix held anywhere in the pool (one Exists per owner)."""
        local = self.store.lookup(namespace, keys, lease_ms)
        if local.prefix_len == len(keys) or scope.current().hop:
            return local
        # Past the local prefix a key may still be here (this daemon owns it, or
        # kept a copy); the others go to their owners.
        start = local.prefix_len
        found = [False] * start + self.store.exists(namespace, keys[start:])
        asks: dict[str, list[int]] = {}
        for i in range(start, len(keys)):
            if found[i]:
                continue
            owner = self._remote_owner(namespace, keys[i])
            if owner is None:
                break  # this daemon owns it and does not hold it: the chain ends here
            asks.setdefault(owner, []).append(i)
        await self._ask_owners(namespace, keys, asks, found)
        extra = 0
        for i in range(start, len(keys)):
            if not found[i]:
                break
            extra += 1
        if not extra:
            return local
        self.counters.remote_lookup_hits += extra
        return LookupResult(
            local.prefix_len + extra,
            local.l1_hits,
            local.l2_hits + extra,
            local.lease_id,
            local.lease_ms,
        )

    async def exists(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys the pool holds: here, else asked of their owners (one call each)."""
        found = self.store.exists(namespace, keys)
        if all(found) or scope.current().hop:
            return found
        asks: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            owner = None if found[i] else self._remote_owner(namespace, key)
            if owner is not None:
                asks.setdefault(owner, []).append(i)
        await self._ask_owners(namespace, keys, asks, found)
        return found

    async def _ask_owners(
        self, namespace: str, keys: list[bytes], asks: dict[str, list[int]], found: list[bool]
    ) -> None:
        """Ask each owner, all at once, about its keys (indices into ``keys``);
        set ``found`` for those it holds. An owner that fails holds none."""
        for owner in [owner for owner in asks if self._is_down(owner)]:
            del asks[owner]
        budget_s = scope.budget_s(self.peer_timeout_s)
        if not asks or budget_s <= 0:
            return  # no time left is a miss, and no fault of the owners
        self.counters.remote_lookups += 1
        answers = await asyncio.gather(
            *(self._exists(owner, namespace, [keys[i] for i in idx], budget_s)
              for owner, idx in asks.items())
        )  # fmt: skip
        for idx, answer in zip(asks.values(), answers, strict=True):
            for i, held in zip(idx, answer, strict=True):
                found[i] = found[i] or held

    async def _exists(
        self, member: str, namespace: str, keys: list[bytes], budget_s: float
    ) -> list[bool]:
        try:
            return await self.peers.exists(member, namespace, keys, budget_s)
        except PeerError as error:
            self._peer_failed(error, member)
            return [False] * len(keys)

    # ---- get -------------------------------------------------------------------
    async def fetch_remote(self, namespace: str, key: bytes) -> Reader | None:
        """The store's miss hook: the value from its owner, now in local L1, or None."""
        if await self._fetch(namespace, key):
            return self.store.open(namespace, key)
        return None

    async def _fetch(self, namespace: str, key: bytes) -> bool:
        """Bring a value from its owner into local L1; False when it could not."""
        if scope.current().hop:
            return False
        owner = self._remote_owner(namespace, key)
        if owner is None or self._is_down(owner):
            return False
        budget_s = scope.budget_s(self.peer_timeout_s)
        if budget_s <= 0:
            return False  # no time left is a miss, and no fault of the owner
        task = self._fetching.get((namespace, key))
        if task is None:
            self.counters.remote_gets += 1
            task = asyncio.get_running_loop().create_task(
                self._fetch_into_l1(owner, namespace, key, budget_s)
            )
            self._fetching[(namespace, key)] = task
            task.add_done_callback(lambda _: self._fetching.pop((namespace, key), None))
        try:
            # A later caller with less time than the first waits only its own.
            async with asyncio.timeout(budget_s):
                return await asyncio.shield(task)
        except TimeoutError:
            return False

    async def fetch_many(self, namespace: str, keys: list[bytes]) -> None:
        """Fetch into L1, at once, the keys of a batch held nowhere here, so a
        BatchGet that then reads them in order waits one peer round trip, not
        one per key (at most ``FETCH_PARALLEL_MAX`` reads in flight)."""
        if scope.current().hop or len(self.membership.members) == 1:
            return
        try:
            held = self.store.exists(namespace, keys)
        except KvdError:
            return  # the batch's own reads word the error
        missing = list(dict.fromkeys(k for k, h in zip(keys, held, strict=True) if not h))
        if len(missing) < 2:
            return
        room = asyncio.Semaphore(FETCH_PARALLEL_MAX)

        async def fetch(key: bytes) -> None:
            async with room:
                await self._fetch(namespace, key)  # the batch's own read counts the hit

        await asyncio.gather(*(fetch(key) for key in missing))

    async def _fetch_into_l1(self, owner: str, namespace: str, key: bytes, budget_s: float) -> bool:
        try:
            outcome = await self.reads.read(owner, namespace, key, budget_s)
        except PeerError as error:
            if error.kind == "checksum":  # the peer answered: it is not down
                self.counters.checksum_mismatches += 1
                self.reads.traffic.failed(owner, error.kind)
                log.error(
                    "peer value failed its checksum; answered as a miss",
                    extra={"peer": owner, "namespace": namespace, "error": str(error)},
                )
            else:
                self._peer_failed(error, owner)
            return False
        if outcome == MISS:
            self.counters.remote_misses += 1
        elif outcome == HIT:
            self.counters.remote_hits += 1
        return outcome == HIT

    # ---- put -------------------------------------------------------------------
    def _put_done(self, entry: Entry) -> None:
        """The store's put hook: queue the value for its owner if that is another member."""
        if scope.current().hop:
            return
        owner = self._remote_owner(entry.ns.name, entry.key)
        if owner is None:
            return
        try:
            self._forward_queue.put_nowait((entry.ns.name, entry.key, owner))
        except asyncio.QueueFull:
            self.counters.forwards_dropped += 1

    async def _forward_loop(self) -> None:
        while True:
            namespace, key, owner = await self._forward_queue.get()
            reader = self.store.peek(namespace, key)
            if reader is None or self._is_down(owner):
                if reader is not None:
                    reader.close()
                self.counters.forward_errors += reader is not None
                continue  # evicted or deleted before its turn, or the owner is down
            try:
                value = b"".join(reader.views)
                sum_, meta, parent = reader.checksum, reader.meta, reader.entry.parent
            finally:
                reader.close()
            try:
                await self.peers.put(
                    owner, namespace, key, value, meta, parent, sum_, FORWARD_TIMEOUT_S
                )
            except PeerError as error:
                self.counters.forward_errors += 1
                self._peer_failed(error, owner)
                continue
            self.counters.forwards += 1
