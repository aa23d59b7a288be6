"""The cyclic garbage collector, kept from stopping the daemon for its whole heap.

CPython collects a generation once enough objects survived into it, and its
oldest ("full") collection walks every object it tracks: the daemon's L1
entries, their policy nodes and their runs among them. Measured in-process
on the development VM: 8 ms for a store of 10,000 entries, 87 ms for
100,000 (~0.9 µs an entry), so a node holding a million values would stop
for about a second. A steady churn of puts and evictions runs it every few
seconds: 400,000 puts into a store of 100,000 entries took 15 full
collections in 8.5 s, the longest 220 ms, 21 % of the time. Every call in
flight waits them out, deadlines or not.

Entries, nodes and runs form no reference cycles (reference counting frees
them on eviction), so the daemon does not let the collector decide:
``take_over`` freezes what start-up made (modules, grpc, numpy: never
garbage, never walked again), turns the automatic full collection off and
runs one every ``FULL_COLLECTION_S`` instead, for the cycles that outlived
the young collections (a long-lived connection's task, say), logged with
its duration. The young generations are collected as before: a cycle made
and dropped within a request is freed as it was. ``give_back`` restores
the collector as it was (a daemon run inside a test process).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("kvd.collector")

# One full collection per interval: at ~0.9 µs per L1 entry, a pause of
# ~1 s per ten minutes for a million entries, against one every few seconds
# under churn when the collector decides.
FULL_COLLECTION_S = 600.0
# The oldest generation's threshold, counted in young collections: never
# reached (2**31 - 1 is the largest a C int holds).
_NEVER = 2**31 - 1


@dataclass
class Collector:
    """The periodic full collection and what to restore."""

    thresholds: tuple[int, int, int]
    handle: asyncio.TimerHandle | None = None
    interval_s: float = FULL_COLLECTION_S
    runs: int = 0

    def _run(self) -> None:
        started = time.perf_counter()
        collected = gc.collect()
        self.runs += 1
        log.info(
            "full garbage collection",
            extra={"ms": round((time.perf_counter() - started) * 1e3, 1), "collected": collected},
        )
        self.handle = asyncio.get_running_loop().call_later(self.interval_s, self._run)


def take_over(interval_s: float = FULL_COLLECTION_S) -> Collector:
    """Freeze what exists, turn automatic full collections off and run one
    every ``interval_s`` on the running loop."""
    collector = Collector(gc.get_threshold(), interval_s=interval_s)
    gc.collect()  # start-up's garbage goes before the rest is frozen
    gc.freeze()
    young, middle, _ = collector.thresholds
    gc.set_threshold(young, middle, _NEVER)
    collector.handle = asyncio.get_running_loop().call_later(interval_s, collector._run)
    return collector


def give_back(collector: Collector) -> None:
    """The collector as it was before ``take_over``."""
    if collector.handle is not None:
        collector.handle.cancel()
        collector.handle = None
    gc.set_threshold(*collector.thresholds)
    gc.unfreeze()
