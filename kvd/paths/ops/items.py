"""The op layer's values, as the transports hand them to ``RegionOps`` and
``ValueOps`` and take their answers back: a region item (where in the
region, which key), its result (a status number, the value's size,
checksum, meta and tier; a batch put's answer too), a region batch, and a
whole value to put or fetched inline. Plain dataclasses with slots: the
shm socket makes one item and one result per op on its µs path, where
protobuf messages cost more."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.wire.errors import CODE_NUMBERS, DeadlineExceeded, KvdError, error_number

NOT_FOUND = CODE_NUMBERS["NOT_FOUND"]
RESOURCE_EXHAUSTED = CODE_NUMBERS["RESOURCE_EXHAUSTED"]


@dataclass(slots=True)
class RegionItem:
    """A value's room in a region: ``length`` bytes at ``offset``."""

    key: bytes
    offset: int
    length: int
    checksum: int | None = None  # a put's: the bytes must match it
    meta: bytes = b""  # a put's
    parent: bytes = b""  # a put's; empty: none (or the batch's previous key when chained)


@dataclass(slots=True)
class ItemResult:
    """One item's answer; ``code`` 0 or a status number (``kvd.wire.errors``)."""

    code: int = 0
    message: str = ""
    size: int = 0
    checksum: int = 0
    meta: bytes = b""
    tier: int = 0  # TIER_L1 or TIER_L2 (kvd.store.index) for a get; 0: none
    existed: bool = False


@dataclass(slots=True)
class RegionBatch:
    """Items of one region and namespace; ``deadline_ns`` on the daemon's
    CLOCK_MONOTONIC (0: none). ``chained`` and ``durable`` are a put's."""

    region_id: int
    token: bytes
    namespace: str
    items: Sequence[RegionItem]
    deadline_ns: int = 0
    chained: bool = False
    durable: bool = False


@dataclass(slots=True)
class PutItem:
    """A whole value of a batch put; ``parent`` empty: none (or the previous key when chained)."""

    key: bytes
    value: bytes
    meta: bytes = b""
    parent: bytes = b""
    checksum: int | None = None  # the bytes must match it


@dataclass(slots=True)
class FetchedValue:
    """A batch get's value copied out; ``code`` NOT_FOUND for a miss,
    RESOURCE_EXHAUSTED for a value with no room in the answer."""

    code: int = 0
    value: bytes = b""
    meta: bytes = b""
    checksum: int = 0
    tier: int = 0


def item_status(exc: KvdError) -> ItemResult:
    return ItemResult(code=error_number(exc), message=str(exc))


def late_result(what: str) -> ItemResult:
    return item_status(DeadlineExceeded(f"{what} past the client's deadline"))


def miss() -> ItemResult:
    return ItemResult(code=NOT_FOUND, message="miss")


def existed_result(checksum: int, item: RegionItem) -> ItemResult:
    """The answer of a put whose key already holds these bytes."""
    return ItemResult(existed=True, checksum=checksum, size=item.length)


def all_results(results: list[ItemResult | None]) -> list[ItemResult]:
    done = [result for result in results if result is not None]
    assert len(done) == len(results), "an item without a result"
    return done
