"""The local daemon answering for the pool: a lookup of a chain across the
owners of its keys, a get of a key this daemon lacks from its owner, and a
put handed on to its owner.

- **Lookup**: the chain's local prefix first (``Store.lookup``, leases
  included). For the rest, up to the first key this daemon owns itself (it
  would hold that one), each owner of a key there gets one Exists of its
  share of the chain (its keys, their positions, the chain's length:
  ``ChainShare``), all owners at once; the answer's prefix runs on through
  the keys found. An owner's answers are kept for ``pool_lookup_hint_ms``
  (``kvd.cluster.hints``): a lookup whose keys there all have one is
  answered from them, and the owners are told instead of asked (and asked
  again in the background now and then: ``kvd.cluster.refresh``); an
  owner keeps the keys it answered held meanwhile (``kvd.cluster.promises``).
  A chain's layout is remembered (``kvd.cluster.layouts``). Remote keys count as
  ``l2_hits`` (held, not in local memory) and are not leased; keys held
  here past the local prefix (owned, or copies) are leased with it. Every
  other owner of a key of the chain is told its share in the background
  (``kvd.cluster.tells``: several at a time in one PEER_TELL, which is not
  answered). An owner's eviction policy learns from its share as if the
  lookup had been made there, and this daemon's policy learns only of the
  keys it owns, so the members together learn what one daemon serving
  every engine would. A member that owns no key of the chain is not asked:
  the next share it gets from this daemon says how many such lookups it
  missed (``ChainShare.untold``), so every member's policy clock moves
  with every lookup of the pool; and every member keeps blocks by one plan
  (``kvd.cluster.plans``).
- **Get**: a local miss asks the key's owner (``Store.on_miss``); the value
  is read into local L1 pages over the owner's bulk TCP port (or gRPC:
  ``kvd.cluster.peer_reads``), checked against the checksum the owner sent
  before it becomes visible (a second get is local), and returned from
  there. Concurrent gets of one key share one peer read. The local copy is a
  guest (``kvd.store.entries``): evicted before any value this daemon owns.
- **Put**: lands here first and is answered from here (an engine's get after
  its own put stays on its node, and the put waits on no network); if
  another member owns the key the value is then handed to it in the
  background, so a lookup from any node finds it (``kvd.cluster.forwards``:
  a bounded queue; past it the owner does not get the value, counted). The
  copy here is a guest, pinned until it went to the owner (up to a quarter
  of L1 pinned so; past that a forward reads it when its turn comes, if it
  is still here).
- **Members change**: each member hands the values whose owner changed to
  the new owner, from L1 then L2, paced (``kvd.cluster.rebalance``).

A dead, slow or partitioned peer is a miss within the caller's deadline
(kvd.cluster.scope): a peer error, a timeout or a checksum mismatch is
counted and answered as "not found", never as an error or as its bytes.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import fields
from itertools import compress

from kvd.cluster import scope
from kvd.cluster.counters import PoolCounters
from kvd.cluster.forwards import Forwards
from kvd.cluster.hints import Hints
from kvd.cluster.layouts import Layouts, Owners
from kvd.cluster.membership import Membership
from kvd.cluster.outcomes import HIT, MISS, NOT_KEPT
from kvd.cluster.peer_reads import PeerReads
from kvd.cluster.peers import PeerError, Peers
from kvd.cluster.pinned import Holds, PinShare
from kvd.cluster.plans import PoolPlans
from kvd.cluster.prefetch import Prefetches
from kvd.cluster.promises import Promises
from kvd.cluster.rebalance import Rebalance
from kvd.cluster.refresh import Refresh
from kvd.cluster.tells import Tells
from kvd.store.index import Entry, Reader
from kvd.store.store import Store
from kvd.wire.bulk import EXISTS_NOT_HELD
from kvd.wire.errors import KvdError
from kvd.wire.lookup import UNTOLD_LOOKUPS_MAX, ChainShare, LookupResult

log = logging.getLogger("kvd.cluster")

# A member whose call just failed is skipped (a miss at once) for this long,
# then tried again: a batch of 100 gets owned by a stopped peer costs one
# timeout, not 100 (each would spend pool_peer_timeout_ms).
PEER_DOWN_S = 1.0
# Peer reads one batch may have in flight (each holds one value in transit).
FETCH_PARALLEL_MAX = 32
# Peer errors logged per member before the rest are only counted.
ERRORS_LOGGED_MAX = 10
# A value fetched from its owner is held in L1 (pinned) until a get opens
# it, at most this long: between the fetch landing and the get's open the
# loop runs other work (puts handed on by other members), and a fresh copy
# is the first thing evicted. kvd bench pool's replay lost 2 % of the
# pool's lookup hits so (the engine's get missed what its lookup found).
FETCHED_HOLD_S = 0.5
# A batch's fetched values are held this much longer than its fetches took:
# its reads open them in order right after (32 values of 4 MiB copy in
# 15-30 ms here). Held for FETCHED_HOLD_S, they crowded out the values the
# member owns: the replay's pool hit 22.12 % against 22.43 %.
FETCHED_BATCH_HOLD_S = 0.05
# Part of L1 held so at most; past it a fetched value is not held.
FETCHED_HOLD_FRACTION = 0.125
# Part of L1 an owner pins for the other members' lookup hints at most;
# past it a key is answered held but not kept, and asked again.
PROMISED_FRACTION = 0.125


class PoolRouter:
    """Pool lookups, remote gets and put forwarding over ``membership``."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        peers: Peers,
        reads: PeerReads,
        peer_timeout_s: float,
        lookup_hint_s: float = 0.0,
        rebalance_bytes_per_s: int = 0,
        prefetch_keys: int = 0,
    ) -> None:
        """``lookup_hint_s``: how long owners' answers answer lookups (``Hints``),
        0: never; ``rebalance_bytes_per_s``: the pace of ``Rebalance``, 0: unpaced;
        ``prefetch_keys``: values a leased lookup found at their owners fetched
        at once (``Prefetches``), 0: none."""
        self.store = store
        self.membership = membership
        self.peers = peers
        self.reads = reads
        self.peer_timeout_s = peer_timeout_s
        self.counters = PoolCounters()
        self.hints = Hints(lookup_hint_s)
        # A member's hint lasts up to twice the setting after its answer came,
        # which took up to the peer timeout to arrive.
        promise_s = 2 * lookup_hint_s + peer_timeout_s if lookup_hint_s > 0 else 0.0
        self.promises = Promises(
            store, promise_s, int(store.pool.capacity_bytes * PROMISED_FRACTION)
        )
        self.owners = Owners(lambda: membership.placement)
        self.layouts = Layouts(self.owners.of_chain)
        self._fetching: dict[tuple[str, bytes], asyncio.Task[bool]] = {}
        self._awaited: dict[tuple[str, bytes], int] = {}  # gets waiting on their fetch, by key
        # Values fetched, held until their get opens them (past the share:
        # one a get waits on, so that it lands held whatever the churn).
        share = PinShare(store.hold, int(store.pool.capacity_bytes * FETCHED_HOLD_FRACTION))
        self._holds = Holds(share, FETCHED_HOLD_S)
        reads.landed = self._landed  # held as it lands, before anything else runs
        self.tells = Tells(reads, self._exists, self._peer_failed, peer_timeout_s,
                           store.limits.max_lookup_keys)  # fmt: skip
        self.refresh = Refresh(lookup_hint_s / 4, self._exists)
        self.prefetches = Prefetches(self._prefetch, prefetch_keys)
        self._errors_logged: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        # Per member: this daemon's lookups since it last told the member of
        # one, of which it owned no key (ChainShare.untold).
        self._untold: dict[str, int] = {}
        self.forwards = Forwards(store, peers, reads, self._is_down, self._peer_failed)
        self.plans = PoolPlans(
            store.learning, membership, reads, timeout_s=peer_timeout_s,
            failed=self._peer_failed, is_down=self._is_down,
        )  # fmt: skip
        self.rebalance = Rebalance(store, membership, self.forwards, self._failing,
                                   rebalance_bytes_per_s)  # fmt: skip
        membership.on_change(self._members_changed)

    def start(self) -> None:
        """Take the store's miss and put hooks; start the forwarders (on the loop)."""
        self.store.on_miss = self.fetch_remote
        self.store.on_put = self._put_done
        self.store.guest_of = self._is_guest
        self.forwards.start()

    async def close(self) -> None:
        self.store.on_miss = None
        self.store.on_put = None
        self.store.guest_of = None
        tasks = [*self.rebalance.tasks(), *self.forwards.tasks(), *self._fetching.values(),
                 *self.tells.tasks(), *self.refresh.tasks(), *self.reads.tasks(),
                 *self.prefetches.tasks()]  # fmt: skip
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.plans.close()
        self._holds.close()
        self.promises.close()
        self.forwards.close()
        self.reads.close()
        await self.peers.close()

    def stats(self) -> dict[str, int]:
        self.counters.plans_adopted = self.plans.adopted
        self.counters.plans_refused = self.plans.refused
        self.counters.tells_dropped = self.tells.dropped
        self.counters.prefetched = self.prefetches.values
        self.counters.prefetches_dropped = self.prefetches.dropped
        forwards = self.forwards
        self.counters.forwards, self.counters.forward_errors = forwards.sent, forwards.errors
        self.counters.forwards_dropped = forwards.dropped
        self.counters.rebalanced = self.rebalance.handed_on
        self.counters.rebalanced_from_l2 = self.rebalance.read_from_l2
        self.counters.rebalance_adopted = self.rebalance.adopted
        values = {f.name: getattr(self.counters, f.name) for f in fields(self.counters)}
        values["members"] = len(self.membership.members)
        values["membership_stale"] = int(self.membership.stale)
        values["membership_changes"] = self.membership.changes
        values["membership_refused"] = self.membership.refused
        values["forward_queue"] = self.forwards.waiting()
        values["hint_pinned_bytes"] = self.promises.pinned_bytes
        values["nixl_read_batches"] = self.reads.gather.batches
        values["nixl_batched_reads"] = self.reads.gather.batched
        values["hint_refreshes"] = self.refresh.started
        values["hint_refreshes_skipped"] = self.refresh.skipped
        values["hints_kept"] = self.promises.kept
        values["hints_not_kept"] = self.promises.not_kept
        return values

    def _members_changed(self, members: tuple[str, ...]) -> None:
        self.hints.clear()  # owners change with the members
        self.refresh.clear()
        self.rebalance.changed()
        self.tells.retain(members)
        self._untold = {m: n for m, n in self._untold.items() if m in members}
        self.reads.retain(members)
        task = asyncio.get_running_loop().create_task(self.peers.retain(members))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _remote_owner(self, namespace: str, key: bytes) -> str | None:
        """The key's owner when it is another member, else None."""
        if len(self.membership.members) == 1:
            return None
        owner = self.owners.of(namespace, key)
        return None if owner == self.membership.advertise else owner

    def _is_guest(self, namespace: str, key: bytes) -> bool:
        if scope.current().kept:  # handed on by a member leaving: this one's own
            return False
        return self._remote_owner(namespace, key) is not None

    def _is_down(self, member: str) -> bool:
        """``_failing``, a call not made then counted (``peer_skips``)."""
        if self._failing(member):
            self.counters.peer_skips += 1
            return True
        self._down_until.pop(member, None)  # time to try it again
        return False

    def _failing(self, member: str) -> bool:
        """Whether a call to the member failed within ``PEER_DOWN_S``."""
        return self._down_until.get(member, 0.0) > time.monotonic()

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
        members = self.membership.members
        if len(members) == 1 or scope.current().hop:
            return self.store.lookup(namespace, keys, lease_ms)
        me = self.membership.advertise
        layout = self.layouts.of(namespace, keys, me, self.membership.placement)
        owners, mine, shares = layout.owners, layout.mine, layout.shares  # read only
        local = self.store.lookup(namespace, keys, lease_ms, mine)
        self._count_untold(members, me, shares)
        self.plans.seen()
        if local.prefix_len == len(keys):
            self._tell(namespace, keys, shares, list(shares))
            return local
        # Past the local prefix a key may still be here (this daemon owns it, or
        # kept a copy); the others are asked of their owners, up to the first
        # key this daemon owns and does not hold: the chain ends there.
        start = local.prefix_len
        tail = self.store.exists(namespace, keys[start:])
        found = [False] * start + tail
        # The first key this daemon owns and does not hold (mine > found) ends the chain.
        ends = list(map(operator.gt, mine[start:], tail))
        end = ends.index(True) if True in ends else len(tail)
        here = list(compress(keys[start : start + end], tail))  # held here past the local prefix
        missing = map(operator.not_, tail[:end])
        asks = dict.fromkeys(compress(owners[start : start + end], missing))
        hinted = self._hinted(namespace, keys[start : start + end], tail) if asks else None
        if hinted is not None:
            # The owners' recent answers settle the chain: none is waited for.
            found[start : start + hinted] = [True] * hinted
            asks = {}
            self.counters.hinted_lookups += 1
            self.refresh.chain(namespace, keys, shares, start, self.peer_timeout_s)
        lease_id = local.lease_id
        if here and lease_ms:
            # Leased with the prefix, as one daemon leases every hit it
            # answers: the batch get that follows fetches the owners' values
            # into L1 first, and those may evict them.
            try:
                lease_id = self.store.lease_more(namespace, here, lease_ms, lease_id)
            except KvdError:
                pass  # no lease left: they may go, a miss then, never an error
        self._tell(namespace, keys, shares, [owner for owner in shares if owner not in asks])
        await self._ask_owners(namespace, keys, shares, list(asks), found)
        extra = found.index(False, start) - start if False in found[start:] else len(keys) - start
        if not extra and lease_id == local.lease_id:
            return local
        self.counters.remote_lookup_hits += extra
        if lease_ms:  # leased: the engine loads the chain next; its owners' values start now
            away = compress(keys[start : start + extra], map(operator.not_, tail[:extra]))
            self.prefetches.start(namespace, list(away))
        return LookupResult(
            local.prefix_len + extra,
            local.l1_hits,
            local.l2_hits + extra,
            lease_id,
            lease_ms if lease_id else 0,
        )

    async def exists(
        self, namespace: str, keys: list[bytes], *, chain: ChainShare | None = None
    ) -> list[bool]:
        """Which keys the pool holds: here, else asked of their owners (one call
        each). A peer's ``chain`` (its lookup) teaches this member's policy."""
        found = self.store.exists(namespace, keys)
        if scope.current().hop:
            if chain is not None:
                self.learn(namespace, keys, chain)
            return found
        shares: dict[str, list[int]] = {}
        if len(self.membership.members) > 1:
            me = self.membership.advertise
            for i, owner in enumerate(self.owners.of_chain(namespace, keys)):
                if not found[i] and owner != me:
                    shares.setdefault(owner, []).append(i)
        await self._ask_owners(namespace, keys, shares, list(shares), found, chain=False)
        return found

    def learn(self, namespace: str, keys: list[bytes], chain: ChainShare) -> None:
        """Another member's lookup of a chain, this member's share of it: its
        policy learns (``ChainShares.learn_chain``) and its clock moves."""
        self.store.shares.learn_chain(namespace, keys, chain.length, chain.positions, chain.untold)
        self.plans.seen(1 + chain.untold)
        self.counters.shares_learned += 1

    def expect(self, namespace: str, key: bytes, history: bytes) -> None:
        """A value another member hands on comes next, with its history in
        that member's eviction policy (``ChainShares.expect``)."""
        if self.store.shares.expect(namespace, key, history):
            self.counters.histories_taken += 1

    def _hinted(self, namespace: str, keys: list[bytes], here: list[bool]) -> int | None:
        """``Hints.settle``, unless a member is down (its keys are misses: asked)."""
        now = time.monotonic()
        if not self.hints.enabled or any(t > now for t in self._down_until.values()):
            return None
        return self.hints.settle(namespace, keys, here)

    async def _ask_owners(
        self, namespace: str, keys: list[bytes], shares: dict[str, list[int]],
        asks: list[str], found: list[bool], *, chain: bool = True,
    ) -> None:  # fmt: skip
        """Ask each owner in ``asks``, all at once, about its keys (its
        positions in ``keys``, ``shares``; with ``chain``, as its share of a
        chain being looked up); set ``found`` for the keys it holds. An owner
        that fails holds none."""
        asks = [owner for owner in asks if not self._is_down(owner)]
        budget_s = scope.budget_s(self.peer_timeout_s)
        if not asks or budget_s <= 0:
            return  # no time left is a miss, and no fault of the owners
        self.counters.remote_lookups += 1
        answers = await asyncio.gather(
            *(self._share(owner, namespace, keys, shares[owner], budget_s, chain) for owner in asks)
        )
        for owner, answer in zip(asks, answers, strict=True):
            if len(answer) != len(shares[owner]):
                raise AssertionError(f"{owner} answered {len(answer)} of {len(shares[owner])} keys")
            for position in compress(shares[owner], answer):
                found[position] = True

    async def _share(
        self, owner: str, namespace: str, keys: list[bytes], positions: list[int],
        budget_s: float, chain: bool = True,
    ) -> list[bool]:  # fmt: skip
        share = ChainShare(len(keys), positions, self._untold.pop(owner, 0)) if chain else None
        mine = list(map(keys.__getitem__, positions))
        return await self._exists(owner, namespace, mine, budget_s, share)

    def _count_untold(
        self, members: tuple[str, ...], me: str, shares: dict[str, list[int]]
    ) -> None:
        """A lookup the members in no share (but this one) will not be told of."""
        untold = self._untold
        for member in members:
            if member != me and member not in shares:
                untold[member] = min(untold.get(member, 0) + 1, UNTOLD_LOOKUPS_MAX)

    def _tell(
        self, namespace: str, keys: list[bytes], shares: dict[str, list[int]],
        owners: Iterable[str],
    ) -> None:  # fmt: skip
        """Let ``owners`` learn of a lookup they were not asked about (background)."""
        for owner in owners:
            if self._is_down(owner):
                continue
            positions = shares[owner]
            chain = ChainShare(len(keys), positions, self._untold.get(owner, 0))
            if self.tells.tell(owner, namespace, list(map(keys.__getitem__, positions)), chain):
                self._untold.pop(owner, None)

    async def _exists(
        self, member: str, namespace: str, keys: list[bytes], budget_s: float,
        chain: ChainShare | None = None,
    ) -> list[bool]:  # fmt: skip
        deadline = time.monotonic() + budget_s
        try:
            answer = await self.reads.exists(member, namespace, keys, budget_s, chain)
            if answer is None:  # over gRPC: held or not, never kept
                left_s = deadline - time.monotonic()
                answer = bytes(
                    await self.peers.exists(member, namespace, keys, left_s, chain=chain)
                )
        except PeerError as error:
            self._peer_failed(error, member)
            return [False] * len(keys)
        self.hints.note_answers(namespace, keys, answer)
        return [held != EXISTS_NOT_HELD for held in answer]

    def answer_exists(self, namespace: str, keys: list[bytes], found: list[bool]) -> bytes:
        """A member's PEER_EXISTS answered: the keys held here are kept for
        its lookup hints where they can be (``Promises.answer``)."""
        return self.promises.answer(namespace, keys, found)

    # ---- get -------------------------------------------------------------------
    async def fetch_remote(self, namespace: str, key: bytes) -> Reader | None:
        """The store's miss hook: the value from its owner, now in local L1, or None."""
        awaited = self._awaited
        waiting = (namespace, key)
        awaited[waiting] = awaited.get(waiting, 0) + 1  # held as it lands, past the share
        try:
            found = await self._fetch(namespace, key)
        finally:
            if awaited[waiting] == 1:
                del awaited[waiting]
            else:
                awaited[waiting] -= 1
        if not found:
            return None
        reader = self.store.open(namespace, key)
        # Others waiting on the same fetch were woken with this caller:
        # they open it before the hold ends.
        asyncio.get_running_loop().call_soon(self._holds.end, namespace, key)
        if reader is None:
            self.counters.remote_not_kept += 1  # not held and evicted before this get
        return reader

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

    async def fetch_many(
        self, namespace: str, keys: list[bytes], landed: Callable[[bytes], None] | None = None
    ) -> None:
        """Fetch into L1, at once, the keys of a batch held nowhere here, so a
        batched get (gRPC BatchGet, a shared-memory region get or pool read)
        that then reads them in order waits one peer round trip, not one per
        key (at most ``FETCH_PARALLEL_MAX`` reads in flight). ``landed`` is
        called with each key as soon as its value is in L1 (held), while the
        others are still on their way."""
        if scope.current().hop or len(self.membership.members) == 1:
            return
        try:
            held = self.store.exists(namespace, keys)
        except KvdError:
            return  # the batch's own reads word the error
        missing = list(dict.fromkeys(k for k, h in zip(keys, held, strict=True) if not h))
        if len(missing) < 2:
            return
        self.counters.remote_get_batches += 1
        await self._fetch_all(namespace, missing, landed)

    async def _prefetch(self, namespace: str, keys: list[bytes]) -> None:
        """A lookup's ``Prefetches``: those of ``keys`` not here (meanwhile) into L1."""
        held = self.store.exists(namespace, keys)
        missing = [key for key, here in zip(keys, held, strict=True) if not here]
        if missing:
            await self._fetch_all(namespace, missing)

    async def _fetch_all(
        self, namespace: str, missing: list[bytes], landed: Callable[[bytes], None] | None = None
    ) -> None:
        """Read ``missing`` from their owners, ``FETCH_PARALLEL_MAX`` at once;
        each held until its get opens it, or ``FETCHED_BATCH_HOLD_S`` past the last."""
        room = asyncio.Semaphore(FETCH_PARALLEL_MAX)

        async def fetch(key: bytes) -> None:
            async with room:
                found = await self._fetch(namespace, key)  # the batch's read counts the hit
            if found and landed is not None:
                landed(key)

        await asyncio.gather(*(fetch(key) for key in missing))
        self._holds.end_later(namespace, missing, FETCHED_BATCH_HOLD_S)

    def _landed(self, namespace: str, key: bytes) -> None:
        """A value from its owner just published here (``PeerReads.landed``):
        held at once, before anything else runs. Past the held share only a
        value a get waits on is held (at most one per such get): a batch's
        other values may be evicted before its reads, which read them again
        (``fetch_remote``)."""
        self._holds.hold(namespace, key, past_share=(namespace, key) in self._awaited)

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
            self.hints.note(namespace, [key], [False])  # a lookup's hint may have said held
        elif outcome == NOT_KEPT:
            self.counters.remote_not_kept += 1
        elif outcome == HIT:
            self.counters.remote_hits += 1  # held as it landed (``_landed``)
        return outcome == HIT

    # ---- put -------------------------------------------------------------------
    def _put_done(self, entry: Entry) -> None:
        """The store's put hook: queue the value for its owner if that is another member."""
        if scope.current().hop:
            return
        owner = self._remote_owner(entry.ns.name, entry.key)
        if owner is None:
            return
        self.hints.forget(entry.ns.name, entry.key)  # its owner may have said "not held"
        self.forwards.put(entry, owner)
