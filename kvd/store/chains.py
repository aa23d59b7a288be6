"""A chain lookup's one pass over the index: how far a chain's keys are
stored, and where each of those values is (``Store.lookup`` validates,
leases, prefetches and tells the policy around it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.l2 import L2Record, L2Tier
from kvd.store.index import Entry


@dataclass(frozen=True, slots=True)
class ChainScan:
    """The stored prefix of a chain: its values in order (an L1 entry or an
    L2 record each), the keys among them found in L1, and how many lead
    before the first only on L2."""

    pins: list[Entry | L2Record]
    in_l1: list[bytes]
    leading_l1: int


def scan_chain(
    resident: dict[bytes, Entry], l2: L2Tier | None, ns_name: str, keys: Sequence[bytes]
) -> ChainScan:
    """One pass, the namespace's index at hand: ~0.2 µs a key here."""
    pins: list[Entry | L2Record] = []
    in_l1: list[bytes] = []
    for key in keys:
        entry = resident.get(key)
        if entry is not None:
            in_l1.append(key)
            pins.append(entry)
            continue
        record = l2.lookup(ns_name, key) if l2 is not None else None
        if record is None:
            break
        pins.append(record)
    leading_l1 = len(in_l1)
    if leading_l1 < len(pins):  # an L2 hit among them: the L1 run before the first
        leading_l1 = next(i for i, p in enumerate(pins) if not isinstance(p, Entry))
    return ChainScan(pins, in_l1, leading_l1)
