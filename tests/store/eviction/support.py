"""What the eviction tests share: draining a policy, inserting a chain, a
density policy that has planned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvd.store.eviction.density import DensityPolicy
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


def planned(tag: str, period: int, lookups: int = 640, blocks: int = 300) -> DensityPolicy[Any]:
    """A density policy tracking ``blocks`` blocks that has planned: a head
    re-read every ``period`` lookups and one-shot chains."""
    policy = DensityPolicy[Any]()
    for i in range(lookups):
        chain = (
            [(tag, "head", j) for j in range(4)]
            if i % period == 0
            else [(tag, i, j) for j in range(3)]
        )
        policy.on_lookup(chain, 0)
        parent = None
        for key in chain:
            if key not in policy:
                while len(policy) >= blocks:
                    victim = policy.victim(never)
                    assert victim is not None
                    policy.remove(victim)
                policy.insert(key, parent)
            parent = key
    return policy
