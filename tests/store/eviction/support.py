"""What the eviction tests share: draining a policy, inserting a chain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvd.store.eviction.policy import EvictionPolicy


def never(_key: object) -> bool:
    return False


def drain(policy: EvictionPolicy[Any], skip: Callable[[Any], bool] = never) -> list[Any]:
    """Evict until victim() says None; the order of victims."""
    order: list[Any] = []
    for _ in range(10_000):
        key = policy.victim(skip)
        if key is None:
            return order
        policy.remove(key)
        order.append(key)
    raise AssertionError("victim() never returned None")


def insert_chain(policy: Any, chain: list[Any]) -> None:
    """Insert a chain head first, each block with its parent, as the store does."""
    parent = None
    for key in chain:
        policy.insert(key, parent)
        parent = key
