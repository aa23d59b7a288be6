"""The daemon's hold on the cyclic garbage collector (kvd.util.collector):
no automatic full collection under a churn of puts and evictions, young
cycles still freed at once, old ones by the periodic full collection, and
the collector given back as it was."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

from kvd.util import collector


class _Cycle:
    def __init__(self) -> None:
        self.me: Any = self


def _full_collections() -> tuple[list[int], Any]:
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(count)
    return seen, count


class _Entry:
    """A long-lived object, as an L1 entry is: tracked, in no cycle."""

    __slots__ = ("runs",)

    def __init__(self, runs: list[int]) -> None:
        self.runs = runs


def _churn(live: int, puts: int, until: list[int] | None = None) -> int:
    """Objects that each outlive the young collections, ``live`` at a time,
    each replacing the oldest (an L1 under a steady churn): ``puts`` of them,
    or with ``until``, as many as it takes ``until`` to fill (at most
    ``puts``). How many were made."""
    ring: list[_Entry | None] = [None] * live
    for i in range(puts):
        ring[i % live] = _Entry([i])
        if until and i >= live:
            return i + 1
    return puts


async def test_churn_runs_no_full_collection_and_cycles_are_still_freed() -> None:
    before = gc.get_threshold()
    seen, count = _full_collections()
    try:
        # When the collector decides, a full collection comes once the
        # objects that reached the oldest generation since the last one are
        # a quarter of it (CPython 3.11): how many puts that is depends on
        # what this process holds.
        puts = _churn(100_000, 5_000_000, until=seen)
        assert seen, "the churn runs full collections when the collector decides"
        held = collector.take_over(interval_s=3600)
        seen.clear()
        try:
            _churn(100_000, 2 * puts)
            assert seen == []
            # A young cycle is freed by the young collections, as before.
            young = _Cycle()
            gone = weakref.ref(young)
            del young
            gc.collect(1)
            assert gone() is None
        finally:
            collector.give_back(held)
    finally:
        gc.callbacks.remove(count)
    assert gc.get_threshold() == before


async def test_the_periodic_full_collection_frees_old_cycles() -> None:
    held = collector.take_over(interval_s=0.05)
    try:
        old = _Cycle()
        gone = weakref.ref(old)
        gc.collect(1)
        gc.collect(1)  # survived the young generations: only a full collection frees it
        del old
        gc.collect(1)
        assert gone() is not None
        for _ in range(100):
            if held.runs:
                break
            await asyncio.sleep(0.02)
        assert held.runs >= 1
        assert gone() is None
    finally:
        collector.give_back(held)
