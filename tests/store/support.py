"""What the store's tests share: a store over a small pool with the
settings' limits and a clock the test turns, blocking put / read, and a
policy that records the calls it is told."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from kvd.config.settings import Config
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.store.eviction.policy import EvictionPolicy
from kvd.store.index import PutResult, StoreLimits
from kvd.store.store import Store
from kvd.wire.checksum import checksum

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store_limits(**limits: int | str) -> StoreLimits:
    """The settings' defaults (the only ones), with ``limits`` changed."""
    return dataclasses.replace(StoreLimits.from_config(Config()), **limits)


def make_store(pages: int = 16, **limits: int) -> tuple[Store, Clock]:
    clock = Clock()
    return Store(Pool(pages * PAGE_BYTES), store_limits(**limits), clock=clock), clock


_loop = asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return _loop.run_until_complete(coro)


def put(
    store: Store, key: bytes, value: bytes, ns: str = "ns", parent: bytes | None = None
) -> PutResult:
    coro = store.put(ns, key, value, parent=parent, checksum=checksum(value), hasher=checksum)
    return _loop.run_until_complete(coro)


def read(store: Store, key: bytes, ns: str = "ns") -> bytes | None:
    return run(fetched(store, key, ns))


async def fetched(store: Store, key: bytes, ns: str = "ns") -> bytes | None:
    """``read`` inside a running event loop."""
    reader = await store.fetch(ns, key)
    if reader is None:
        return None
    try:
        return b"".join(reader.views)
    finally:
        reader.close()


class Recorded:
    """A real policy, and the calls it was told, in order."""

    def __init__(self, policy: EvictionPolicy[Any]) -> None:
        self.policy = policy
        self.name = policy.name
        self.calls: list[tuple[Any, ...]] = []
        self.mines: list[list[bool] | None] = []  # on_lookup's, in order

    def insert(self, key: Any, parent: Any) -> None:
        self.calls.append(("insert", key, parent))
        self.policy.insert(key, parent)

    def touch(self, key: Any) -> None:
        self.calls.append(("touch", key))
        self.policy.touch(key)

    def touch_many(self, keys: Iterable[Any]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: Any) -> None:
        self.calls.append(("remove", key))
        self.policy.remove(key)

    def victim(self, skip: Callable[[Any], bool]) -> Any:
        key = self.policy.victim(skip)
        self.calls.append(("victim", key))
        return key

    def unpark(self, key: Any) -> None:
        self.policy.unpark(key)

    def unpark_all(self) -> None:
        self.policy.unpark_all()

    def on_lookup(self, keys: Sequence[Any], hits: int, mine: Sequence[bool] | None = None) -> None:
        self.calls.append(("on_lookup", tuple(keys), hits))
        self.mines.append(None if mine is None else list(mine))
        self.policy.on_lookup(keys, hits, mine)

    def shared_plan(self) -> bytes | None:
        return self.policy.shared_plan()

    def adopt_plan(self, plan: bytes) -> bool:
        self.calls.append(("adopt_plan", len(plan)))
        return self.policy.adopt_plan(plan)

    def history(self, key: Any) -> bytes | None:
        return self.policy.history(key)

    def expect(self, key: Any, history: bytes) -> bool:
        self.calls.append(("expect", key))
        return self.policy.expect(key, history)

    def __len__(self) -> int:
        return len(self.policy)
