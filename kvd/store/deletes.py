"""Deletes: a key leaves L1 at once (its pages freed after its last reader)
and L2 (a tombstone record), whichever holds it. Imports neither grpc nor
metrics."""

from __future__ import annotations

from collections.abc import Iterable

from kvd.l2 import L2Tier
from kvd.store.entries import Entries


async def delete_keys(
    entries: Entries, l2: L2Tier | None, ns_name: str, keys: Iterable[bytes]
) -> int:
    """Delete each key; how many were held (in L1, on L2 or both)."""
    deleted = 0
    for key in keys:
        found = False
        entry = entries.get(ns_name, key)
        if entry is not None:
            entry.deleted = True
            entries.unlink(entry)
            found = True
        if l2 is not None and await l2.delete(ns_name, key):
            found = True
        deleted += found
    return deleted


async def delete_namespace(entries: Entries, l2: L2Tier | None, ns_name: str) -> int:
    """Delete every key of a namespace, in L1 and on L2."""
    ns = entries.by_name.get(ns_name)
    keys = set(ns.entries) if ns is not None else set()
    if l2 is not None:
        keys.update(l2.keys_of(ns_name))
    return await delete_keys(entries, l2, ns_name, keys)
