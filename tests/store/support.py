"""What the store's tests share: a store over a small pool with the
settings' limits and a clock the test turns, and blocking put / read."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvd.config.settings import Config
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.store.index import PutResult, StoreLimits
from kvd.store.store import Store
from kvd.wire.checksum import checksum

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store_limits(**limits: int) -> StoreLimits:
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
    reader = run(store.fetch(ns, key))
    if reader is None:
        return None
    try:
        return b"".join(reader.views)
    finally:
        reader.close()
