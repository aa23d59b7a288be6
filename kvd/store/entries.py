"""L1's index: the namespaces, their entries over the pool's pages, and the
eviction that makes room for a new value.

An entry is evictable when no reader, lease or write-back holds it and it is
on L2, or L2 is failing: ``keep_dirty`` (given by the store: write-back is
healthy) says whether a value not yet on L2 must stay. Room that eviction
cannot make at once is waited for through ``wait_write_back`` (write-back
unpinning values); expired leases let go first (``expire_leases``). Nothing
here knows the store, the L2 tier or write-back: the store hands this index
the callables above, and hands its ``pin``/``unpin`` to them. Imports neither grpc nor metrics.

Guests. In a pool, a member also holds copies of values other members own:
a put it forwards to the owner, a value it fetched from one. The owner keeps
the value; the copy only saves a network round trip. Guests stay out of
the eviction policy (it learns and plans for the member's own share) and
are evicted first, oldest first, so a copy never costs an owned value its
place: four members then hold what one daemon of their total size would
(kvd bench pool).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kvd.l1.pool import PAGE_BYTES, Pool, PoolFull, Run, pages_for
from kvd.store.eviction.chains import PARK
from kvd.store.eviction.policy import EvictionPolicy
from kvd.store.index import Entry, Namespace, PolicyKey, StoreCounters, check_namespace
from kvd.wire.errors import ResourceExhausted
from kvd.wire.limits import NAMESPACES_MAX

# Guests looked at per eviction before the policy is asked instead: pinned
# ones (being read, or waiting to be forwarded) go to the back of the line.
GUEST_SCAN_MAX = 64


class Entries:
    def __init__(
        self,
        pool: Pool,
        policy: EvictionPolicy[Any],
        counters: StoreCounters,
        namespace_l1_quota_bytes: int,
        keep_dirty: Callable[[], bool],
        on_drop_dirty: Callable[[], None],
        expire_leases: Callable[[], None],
        wait_write_back: Callable[[], Awaitable[bool]],
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.counters = counters
        self.namespace_l1_quota_bytes = namespace_l1_quota_bytes
        self._keep_dirty = keep_dirty
        self._on_drop_dirty = on_drop_dirty
        self._expire_leases = expire_leases
        self._wait_write_back = wait_write_back
        self.by_name: dict[str, Namespace] = {}
        self._by_id: dict[int, Namespace] = {}
        self._ids = itertools.count(1)
        self._uids = itertools.count(1)  # directory ids, never reused
        self.count = 0
        self.guests: dict[PolicyKey, Entry] = {}  # oldest first
        # Told of each value linked into and unlinked from L1 (the pool's KV events).
        self.on_link: Callable[[Entry], None] | None = None
        self.on_unlink: Callable[[Entry], None] | None = None

    # ---- namespaces and lookups ----------------------------------------------
    def namespace(self, name: str) -> Namespace:
        """The namespace called ``name``, made on first use."""
        ns = self.by_name.get(name)
        if ns is None:
            check_namespace(name)
            if len(self.by_name) >= NAMESPACES_MAX:
                raise ResourceExhausted(f"more than {NAMESPACES_MAX} namespaces")
            ns = Namespace(next(self._ids), name)
            self.by_name[name] = ns
            self._by_id[ns.id] = ns
        return ns

    def get(self, ns_name: str, key: bytes) -> Entry | None:
        ns = self.by_name.get(ns_name)
        return None if ns is None else ns.entries.get(key)

    def _by_pk(self, pk: PolicyKey) -> Entry | None:
        ns = self._by_id.get(pk[0])
        return None if ns is None else ns.entries.get(pk[1])

    # ---- linking -------------------------------------------------------------
    def link(self, entry: Entry) -> None:
        self.link_many((entry,))

    def link_many(self, entries: Iterable[Entry]) -> None:
        """Link each entry into L1, in order (a batched get's promotions)."""
        insert, directory, on_link = self.policy.insert, self.pool.directory, self.on_link
        for entry in entries:
            ns = entry.ns
            ns.entries[entry.key] = entry
            ns.bytes_stored += entry.size
            self.count += 1
            if entry.guest:
                self.guests[(ns.id, entry.key)] = entry
            else:
                insert((ns.id, entry.key), (ns.id, entry.parent) if entry.parent else None)
            if directory is not None and len(entry.runs) == 1:
                entry.uid = next(self._uids)
                first = entry.runs[0][0]
                entry.slot = directory.publish(
                    ns.name, entry.key, entry.uid, first, entry.size, entry.checksum,
                    first * PAGE_BYTES,
                )  # fmt: skip
            if on_link is not None:
                on_link(entry)

    def unlink(self, entry: Entry) -> None:
        """Remove from L1; free the pages unless a reader still holds them."""
        ns = entry.ns
        del ns.entries[entry.key]
        ns.bytes_stored -= entry.size
        self.count -= 1
        entry.linked = False
        if entry.guest:
            del self.guests[(ns.id, entry.key)]
        else:
            self.policy.remove((ns.id, entry.key))
        if entry.slot >= 0:
            directory = self.pool.directory
            assert directory is not None
            directory.withdraw(entry.slot, entry.uid)
            entry.slot = -1
        if self.on_unlink is not None:
            self.on_unlink(entry)
        if entry.readers == 0:
            self.pool.free(entry.runs)
            entry.runs = []

    def set_guest(self, entry: Entry, guest: bool) -> None:
        """A linked entry becomes a guest (its key is another member's now:
        out of the policy, evicted first) or the member's own (into the
        policy, linked under its parent) after the pool's members changed."""
        if entry.guest == guest or not entry.linked:
            return
        pk = (entry.ns.id, entry.key)
        entry.guest = guest
        if guest:
            self.policy.remove(pk)
            self.guests[pk] = entry
        else:
            del self.guests[pk]
            self.policy.insert(pk, (entry.ns.id, entry.parent) if entry.parent else None)

    def pin(self, entry: Entry) -> None:
        """Hold an entry's pages for a reader or a write."""
        entry.readers += 1

    def unpin(self, entry: Entry) -> None:
        """Give a reader's hold back; an entry unlinked meanwhile frees its pages."""
        entry.readers -= 1
        assert entry.readers >= 0, "reader closed twice"
        if entry.readers == 0 and not entry.linked and entry.runs:
            self.pool.free(entry.runs)
            entry.runs = []

    # ---- eviction ------------------------------------------------------------
    def evictable(self, entry: Entry) -> bool:
        if entry.readers > 0 or entry.leases > 0:
            return False
        # A value not yet on L2 stays, unless L2 is failing (then it is dropped).
        return not (entry.dirty and self._keep_dirty())

    def _pinned(self, pk: PolicyKey) -> int:
        """The victim search's ``skip``: False for an evictable value, PARK for
        one not yet on L2 (held out of the searches until ``cleaned``: a
        write-back backlog is not walked by every eviction), True for the
        other pinned ones (a reader or a lease holds it)."""
        entry = self._by_pk(pk)
        if entry is None:
            return True
        if self.evictable(entry):
            return False
        return PARK if entry.dirty and self._keep_dirty() else True

    def cleaned(self, entry: Entry) -> None:
        """A value reached L2 (write-back): evictable again, once unpinned."""
        if entry.linked and not entry.guest:
            self.policy.unpark((entry.ns.id, entry.key))

    def l2_failing(self) -> None:
        """Write-back failed and backs off: values not on L2 may be dropped
        meanwhile (``keep_dirty`` is false), so none stays parked."""
        self.policy.unpark_all()

    def evict(self, entry: Entry) -> None:
        if entry.dirty:
            self._on_drop_dirty()
        elif entry.held_back:
            self.counters.l2_never_written += 1
        self.unlink(entry)
        self.counters.evictions += 1

    def drop_clean(self, entry: Entry) -> bool:
        """Evict an entry now if it is safe on L2 and not pinned; False if not."""
        if entry.dirty or entry.l2 is None or entry.readers or entry.leases:
            return False
        self.unlink(entry)
        self.counters.evictions += 1
        return True

    def _evict_guest(self) -> bool:
        """Evict the oldest guest that can go; False when none of the first
        ``GUEST_SCAN_MAX`` can."""
        guests = self.guests
        for _ in range(min(len(guests), GUEST_SCAN_MAX)):
            pk, entry = next(iter(guests.items()))
            if self.evictable(entry):
                self.evict(entry)
                return True
            del guests[pk]  # pinned: to the back of the line
            guests[pk] = entry
        return False

    def _evict_one(self) -> bool:
        if self.guests and self._evict_guest():
            return True
        pk = self.policy.victim(self._pinned)
        if pk is None:
            return False
        entry = self._by_pk(pk)
        assert entry is not None and entry.readers == 0 and entry.leases == 0, pk
        self.evict(entry)
        return True

    async def wait_room(self, size: int, ns_name: str = "") -> None:
        """Wait until write-back unpinned some values; ResourceExhausted when it
        cannot, naming the namespace's quota or the pool as what is full."""
        if await self._wait_write_back():
            return
        self.counters.eviction_failures += 1
        quota = self.namespace_l1_quota_bytes
        ns = self.by_name.get(ns_name)
        if quota and ns is not None and ns.bytes_stored + size > quota:
            raise ResourceExhausted(
                f"namespace {ns_name!r} is at its L1 quota ({quota} bytes) and its values are "
                "pinned by readers, leases or write-back"
            )
        raise ResourceExhausted(
            f"pool full: {pages_for(size)} pages needed, {self.pool.free_pages} free, "
            "the rest pinned by readers, leases or write-back"
        )

    async def alloc(self, size: int) -> list[Run]:
        while (runs := self.alloc_now(size)) is None:
            await self.wait_room(size)
        return runs

    def alloc_now(self, size: int, expire: bool = True) -> list[Run] | None:
        """Pages for ``size`` bytes, after expired leases let go of theirs and
        evicting what can go at once; None when too much of the rest is pinned.
        ``expire=False``: leases were just expired (the batch's first value)."""
        if expire:
            self._expire_leases()
        need = pages_for(size)
        while self.pool.free_pages < need:
            if not self._evict_one():
                return None
        try:
            return self.pool.alloc(size)
        except PoolFull as exc:  # cannot happen after the loop above
            raise AssertionError(str(exc)) from exc

    def quota_room(self, ns_name: str, size: int) -> bool:
        """Room for ``size`` more bytes under the namespace's L1 quota, after
        evicting what of its own can go at once; False when the rest is pinned."""
        quota = self.namespace_l1_quota_bytes
        if not quota:
            return True
        if size > quota:
            raise ResourceExhausted(f"value of {size} bytes is over the namespace's L1 quota")
        ns = self.by_name.get(ns_name)
        while ns is not None and ns.bytes_stored + size > quota:
            victim = next((e for e in ns.entries.values() if self.evictable(e)), None)
            if victim is None:
                return False
            self.evict(victim)
        return True
