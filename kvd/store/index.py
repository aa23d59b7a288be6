"""The store's records: what the index holds for each value, and the
handles given to a put in progress (``PutTicket``) and to a reader
(``Reader``), with the validation of names and keys against the limits both
sides agree on (``kvd.wire.limits``).

Pure data: no I/O, no grpc, no metrics. A reader unpins through the callable
it is given, never through its store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.l1.pool import Pool, Run, pages_for
from kvd.l2.records import L2Record
from kvd.wire.errors import InvalidArgument
from kvd.wire.limits import KEY_BYTES_MAX, META_BYTES_MAX, NAMESPACE_BYTES_MAX

if TYPE_CHECKING:
    from kvd.config.settings import Config

# Same numbers as kvd.v1.Tier on the wire.
TIER_L1 = 1
TIER_L2 = 2
TIER_NAMES = {TIER_L1: "l1", TIER_L2: "l2"}

PolicyKey = tuple[int, bytes]


@dataclass(frozen=True)
class StoreLimits:
    """The store's limits. Their defaults are the settings' (``from_config``):
    the settings table is the one place a limit's default is written."""

    max_value_bytes: int
    max_lookup_keys: int
    lease_ms_max: int
    max_leases: int
    namespace_l1_quota_bytes: int  # 0: no quota
    namespace_l2_quota_bytes: int
    uploads_max_bytes: int  # 0: no cap
    l2_admission: str  # which puts reach L2 (kvd.store.admission)

    @classmethod
    def from_config(cls, config: Config) -> StoreLimits:
        return cls(
            max_value_bytes=config.max_value_bytes,
            max_lookup_keys=config.max_lookup_keys,
            lease_ms_max=config.lease_ms_max,
            max_leases=config.max_leases,
            namespace_l1_quota_bytes=config.namespace_l1_quota_bytes,
            namespace_l2_quota_bytes=config.namespace_l2_quota_bytes,
            # 0 in the setting: half of L1 (dram_bytes).
            uploads_max_bytes=config.uploads_max_bytes or config.dram_bytes // 2,
            l2_admission=config.l2_admission,
        )


@dataclass(eq=False, slots=True)
class Entry:
    """One value in L1 (and maybe also on L2: ``l2``)."""

    ns: Namespace
    key: bytes
    size: int
    checksum: int
    meta: bytes
    runs: list[Run]
    parent: bytes | None
    readers: int = 0
    leases: int = 0
    linked: bool = True  # False once unlinked from L1 (evicted or deleted)
    deleted: bool = False  # unlinked by a delete (not by eviction)
    dirty: bool = False  # not yet on L2 (only when there is an L2)
    # Not queued for L2 until a second reference (``l2_admission = twice``).
    held_back: bool = False
    l2: L2Record | None = None
    # A pool member's copy of a value another member owns (Entries.guests):
    # outside the eviction policy, and the first to go.
    guest: bool = False
    # Its slot in the shared pool's directory (kvd.l1.directory), -1 for
    # none, and the id that slot and its page's tag name it by.
    slot: int = -1
    uid: int = 0


@dataclass(eq=False, slots=True)
class Namespace:
    id: int
    name: str
    entries: dict[bytes, Entry] = field(default_factory=dict)
    bytes_stored: int = 0
    hits: int = 0
    misses: int = 0


@dataclass(eq=False, slots=True)
class PutTicket:
    """Pages reserved for a put in progress; invisible until published."""

    ns_name: str
    key: bytes
    size: int
    meta: bytes
    parent: bytes | None
    checksum: int | None
    runs: list[Run]
    views: list[memoryview]
    done: bool = False
    # A put whose bytes are still arriving (``Store.begin_upload``): its pages
    # cover the first ``covered_bytes`` of the value, and grow as more arrive.
    upload: bool = False
    covered_bytes: int = 0


@dataclass(eq=False, slots=True)
class Reader:
    """A pinned entry being read; ``close()`` unpins it (idempotent) through
    ``unpin``, which the store gives (the pages of an entry unlinked while it
    was read are freed after its last reader)."""

    unpin: Callable[[Entry], None]
    entry: Entry
    views: list[memoryview]
    tier: int = TIER_L1
    closed: bool = False

    @property
    def size(self) -> int:
        return self.entry.size

    @property
    def checksum(self) -> int:
        return self.entry.checksum

    @property
    def meta(self) -> bytes:
        return self.entry.meta

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.unpin(self.entry)


@dataclass(frozen=True, slots=True)
class PutResult:
    existed: bool
    checksum: int


@dataclass
class StoreCounters:
    """Plain integers the metrics collector reads at scrape time."""

    hits: int = 0
    l2_hits: int = 0
    misses: int = 0
    puts: int = 0
    put_existed: int = 0
    put_conflicts: int = 0
    evictions: int = 0
    eviction_failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    l2_reinserted: int = 0
    l2_held_back: int = 0  # puts not queued for L2 at once (kvd.store.admission)
    l2_admitted: int = 0  # of those, queued at a later reference
    l2_never_written: int = 0  # of those, evicted from L1 first


def check_namespace(name: str) -> None:
    if not name:
        raise InvalidArgument("namespace is empty")
    if len(name.encode()) > NAMESPACE_BYTES_MAX:
        raise InvalidArgument(f"namespace longer than {NAMESPACE_BYTES_MAX} bytes")
    if not name.isprintable():
        raise InvalidArgument("namespace has non-printable characters")


def check_key(key: bytes) -> None:
    if not key:
        raise InvalidArgument("key is empty")
    if len(key) > KEY_BYTES_MAX:
        raise InvalidArgument(f"key of {len(key)} bytes is longer than {KEY_BYTES_MAX}")


def check_keys(keys: Sequence[bytes], max_keys: int) -> None:
    """A chain of keys (a lookup, an exists, a delete) within its limits."""
    if len(keys) > max_keys:
        raise InvalidArgument(f"{len(keys)} keys in one call, max_lookup_keys={max_keys}")
    # The lengths checked together, not with a call per key (a lookup of
    # thousands of keys sits on the engine's scheduler path).
    lengths = set(map(len, keys))
    if min(lengths, default=1) < 1 or max(lengths, default=1) > KEY_BYTES_MAX:
        for key in keys:
            check_key(key)  # says which key and why


def check_put(
    ns_name: str,
    key: bytes,
    parent: bytes | None,
    meta: bytes,
    size: int,
    max_value_bytes: int,
    pool: Pool,
) -> None:
    """A put's namespace, key, parent key, meta and size are within their
    limits, and its value fits in ``pool``."""
    check_namespace(ns_name)
    check_key(key)
    if parent is not None and len(parent) > KEY_BYTES_MAX:
        raise InvalidArgument(f"parent key longer than {KEY_BYTES_MAX} bytes")
    if len(meta) > META_BYTES_MAX:
        raise InvalidArgument(f"meta of {len(meta)} bytes is over {META_BYTES_MAX}")
    if size < 0 or size > max_value_bytes:
        raise InvalidArgument(f"value of {size} bytes is over max_value_bytes={max_value_bytes}")
    if pages_for(size) > pool.page_count:
        raise InvalidArgument(
            f"value of {size} bytes is larger than the pool ({pool.capacity_bytes} bytes)"
        )
