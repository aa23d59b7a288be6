"""Workload replay against a real daemon: ``kvd bench replay``.

Each request of a trace (``kvd.tools.replay.trace``) becomes what an inference
engine does with kvd: ``Lookup`` its chain (with a lease), ``Get`` the hit
prefix and verify every byte, ``Put`` the missed blocks as one chained
``put_many``. Block ``i``'s value is the 8-byte word ``mix(i)`` repeated
(``block_value``), so a block served for another key, or a torn one, fails
the comparison.

Capacity. The daemon's L1 holds ``dram_bytes // page_bytes`` pages and a block
of ``block_bytes`` takes ``ceil(block_bytes / page_bytes)`` of them, so a pool
of exactly ``capacity_blocks * pages_per_block`` pages holds ``capacity_blocks``
blocks, the simulator's capacity. With one client and no L2 the daemon makes
the same decisions as ``kvd.tools.replay.sim.simulate``: its lookups touch the hits
and call ``on_lookup`` once the store is wired to, its puts insert in chain
order, the lease pins the hits while the misses are put. (Gets touch the hits
a second time; that changes nothing for ``lru`` and ``pred``, whose touch
only refreshes, but counts twice in ``gdf``.) Several clients interleave
requests, so there the figures are the daemon's own.

Requests go out in timestamp order, as fast as the clients go
(``speed=0``) or at ``timestamp / speed``.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvd.client import Client
from kvd.l2.format import BLOCK_BYTES, RECORD_ALIGN_BYTES, align_up
from kvd.tools.bench.daemon import SpawnedDaemon
from kvd.tools.replay.trace import Trace

PAGE_BYTES = 64 * 1024
# A 512-token block: SmolLM2-135M fp32 (30 layers x 2 x 3 KV heads x 64 dims x
# 4 B x 512) = 22.5 MiB; Llama-3.1-8B bf16 (32 x 2 x 8 x 128 x 2 B x 512) = 64 MiB.
MODEL_BLOCK_BYTES = {"smollm2-135m-fp32": 23_592_960, "llama-3.1-8b-bf16": 67_108_864}
LEASE_MS = 30_000
CLIENTS_MAX = 256
SPEED_MAX = 1e6
# Latency samples kept per operation (reservoir beyond it): 12k requests fit.
SAMPLES_MAX = 1 << 16
START_TIMEOUT_S = 30.0
# The L2 a replay gives its daemon (``l2_layout``): segments this large, so
# that reclaim, which empties the oldest segment whole, frees a small share
# of L2 at a time (FIFO by segment), and at least this many of them.
L2_SEGMENT_BYTES = 16 << 20
L2_SEGMENTS_MIN = 8


class ReplayError(RuntimeError):
    """A replay that could not run or found wrong data."""


def mix(block: int) -> int:
    """A 64-bit word per block id (splitmix64 finaliser): neighbours differ in every byte."""
    z = (block + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def block_value(block: int, block_bytes: int) -> bytes:
    words = np.full(-(-block_bytes // 8), mix(block), dtype=np.uint64)
    return words.tobytes()[:block_bytes]


def block_key(block: int) -> bytes:
    return block.to_bytes(8, "big")


def pages_per_block(block_bytes: int) -> int:
    return max(1, -(-block_bytes // PAGE_BYTES))


def dram_bytes_for(capacity_blocks: int, block_bytes: int) -> int:
    """A pool that holds exactly ``capacity_blocks`` blocks (at least 1 MiB, the
    daemon's minimum; then the capacity is what that holds)."""
    return max(capacity_blocks * pages_per_block(block_bytes) * PAGE_BYTES, 1 << 20)


def capacity_of(dram_bytes: int, block_bytes: int) -> int:
    return (dram_bytes // PAGE_BYTES) // pages_per_block(block_bytes)


class Samples:
    """Latencies in seconds: a bounded reservoir and percentiles."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.count = 0
        self._random = np.random.default_rng(1)

    def add(self, seconds: float) -> None:
        self.count += 1
        if len(self.values) < SAMPLES_MAX:
            self.values.append(seconds)
        else:
            slot = int(self._random.integers(self.count))
            if slot < SAMPLES_MAX:
                self.values[slot] = seconds

    def percentiles_ms(self) -> dict[str, float]:
        if not self.values:
            return {}
        p50, p90, p99, p999 = np.percentile(self.values, [50, 90, 99, 99.9]) * 1e3
        return {"n": self.count, "p50": p50, "p90": p90, "p99": p99, "p99.9": p999}


@dataclass
class ReplayStats:
    requests: int = 0
    block_refs: int = 0
    block_hits: int = 0
    l1_hits: int = 0
    l2_hits: int = 0
    token_refs: int = 0
    token_hits: int = 0
    bytes_got: int = 0
    bytes_put: int = 0
    blocks_put: int = 0
    lost_after_lookup: int = 0  # a leased hit that Get did not return
    wrong_blocks: int = 0
    elapsed_s: float = 0.0
    lookup: Samples = field(default_factory=Samples)
    get: Samples = field(default_factory=Samples)
    put: Samples = field(default_factory=Samples)

    def figures(self) -> dict[str, float]:
        """The block counts, their hit ratio, what went wrong, the seconds."""
        return {
            "requests": self.requests,
            "block_refs": self.block_refs,
            "block_hits": self.block_hits,
            "block_hit_ratio": self.block_hits / self.block_refs if self.block_refs else 0.0,
            "lost_after_lookup": self.lost_after_lookup,
            "wrong_blocks": self.wrong_blocks,
            "seconds": round(self.elapsed_s, 1),
        }

    def merge(self, other: ReplayStats) -> None:
        for name in ("requests", "block_refs", "block_hits", "l1_hits", "l2_hits", "token_refs",
                     "token_hits", "bytes_got", "bytes_put", "blocks_put", "lost_after_lookup",
                     "wrong_blocks"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for samples in ("lookup", "get", "put"):
            mine, theirs = getattr(self, samples), getattr(other, samples)
            mine.count += theirs.count - len(theirs.values)
            for value in theirs.values:
                mine.add(value)


def _request(client: Client, ns: str, trace: Trace, index: int, block_bytes: int,
             stats: ReplayStats) -> None:  # fmt: skip
    chain = trace.chain(index).tolist()
    keys = [block_key(b) for b in chain]
    started = time.perf_counter()
    found = client.lookup_ex(ns, keys, lease_ms=LEASE_MS)
    stats.lookup.add(time.perf_counter() - started)
    hits = found.prefix_len
    try:
        if hits:
            started = time.perf_counter()
            values = client.get_many(ns, keys[:hits])
            stats.get.add(time.perf_counter() - started)
            for block, value in zip(chain[:hits], values, strict=True):
                if value is None:
                    stats.lost_after_lookup += 1
                    continue
                stats.bytes_got += len(value)
                if value != block_value(block, block_bytes):
                    stats.wrong_blocks += 1
        missed = [(block_key(b), block_value(b, block_bytes)) for b in chain[hits:]]
        if missed:
            started = time.perf_counter()
            client.put_many(ns, missed, chained=True, parent=keys[hits - 1] if hits else None)
            stats.put.add(time.perf_counter() - started)
            stats.blocks_put += len(missed)
            stats.bytes_put += len(missed) * block_bytes
    finally:
        if found.lease_id:
            client.release(ns, found.lease_id)
    n = len(chain)
    stats.requests += 1
    stats.block_refs += n
    stats.block_hits += hits
    stats.l1_hits += found.l1_hits
    stats.l2_hits += found.l2_hits
    input_tokens = int(trace.input_tokens[index])
    stats.token_refs += input_tokens
    stats.token_hits += input_tokens if hits == n else hits * trace.block_tokens


def replay(target: str, trace: Trace, *, block_bytes: int, namespace: str = "replay",
           clients: int = 1, speed: float = 0.0, requests: int = 0,
           progress: Callable[[str], None] | None = None) -> ReplayStats:  # fmt: skip
    """Replay ``trace`` (its first ``requests``, 0: all) against ``target``."""
    if not 1 <= clients <= CLIENTS_MAX:
        raise ReplayError(f"clients must be in 1..{CLIENTS_MAX}, got {clients}")
    if not 0 <= speed <= SPEED_MAX:
        raise ReplayError(f"speed must be in 0..{SPEED_MAX:g} (0: as fast as possible)")
    if block_bytes < 8:
        raise ReplayError(f"block_bytes must be >= 8, got {block_bytes}")
    total = len(trace) if requests <= 0 else min(requests, len(trace))
    work: queue.Queue[int] = queue.Queue(maxsize=4 * clients)
    per_worker = [ReplayStats() for _ in range(clients)]
    errors: list[BaseException] = []
    client = Client(target, timeout_s=60.0)

    def worker(stats: ReplayStats) -> None:
        while True:
            index = work.get()
            if index < 0:
                return
            if errors:
                continue
            try:
                _request(client, namespace, trace, index, block_bytes, stats)
            except BaseException as exc:  # reported once the workers stop
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in per_worker]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    try:
        for index in range(total):
            if speed:
                due = started + float(trace.timestamps_ms[index]) / 1000 / speed
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            work.put(index)
            if errors:
                break
            if progress and index and index % 1000 == 0:
                progress(f"replay: {index}/{total} requests")
    finally:
        for _ in threads:
            work.put(-1)
        for thread in threads:
            thread.join()
        client.close()
    if errors:
        raise ReplayError(f"replay failed: {errors[0]!r}") from errors[0]
    stats = ReplayStats()
    for worker_stats in per_worker:
        stats.merge(worker_stats)
    stats.elapsed_s = time.perf_counter() - started
    return stats


def start_l1_daemon(
    workdir: Path,
    dram_bytes: int,
    max_value_bytes: int,
    extra_args: Sequence[str] = (),
    l2: L2Layout | None = None,
) -> SpawnedDaemon:
    """``kvd serve`` with an L1 of a given size and no L2, on ephemeral ports:
    the daemon whose decisions the simulator reproduces; with ``l2``, that
    L2 in ``workdir`` as well."""
    workdir.mkdir(parents=True, exist_ok=True)
    return SpawnedDaemon(
        workdir, [*extra_args, "--metrics-listen", ""], dram=str(dram_bytes),
        max_value=str(max(max_value_bytes, 1024)),
        ssd=str(l2.ssd_bytes) if l2 else "", segment=str(L2_SEGMENT_BYTES),
    )  # fmt: skip


@dataclass(frozen=True)
class L2Layout:
    """An L2 for a replay's daemon: its bytes, and the blocks it holds
    (a 64 KiB-aligned record a block, less each segment's marker)."""

    ssd_bytes: int
    blocks: int


def l2_layout(blocks: int, block_bytes: int) -> L2Layout:
    """The smallest L2 of whole ``L2_SEGMENT_BYTES`` segments (at least
    ``L2_SEGMENTS_MIN``) holding ``blocks`` blocks of ``block_bytes``."""
    record = align_up(BLOCK_BYTES + block_bytes, RECORD_ALIGN_BYTES)
    per_segment = L2_SEGMENT_BYTES // record - 1
    if per_segment < 1:
        raise ReplayError(f"blocks of {block_bytes} B do not fit L2 segments of 16 MiB")
    segments = max(L2_SEGMENTS_MIN, -(-blocks // per_segment))
    return L2Layout(segments * L2_SEGMENT_BYTES, segments * per_segment)


def modeled_ttft(trace: Trace, stats: ReplayStats, prefill_tokens_per_s: float,
                 requests: int) -> dict[str, Any]:  # fmt: skip
    """Prefill saved by the hits, and mean TTFT with and without kvd, when
    prefill runs at ``prefill_tokens_per_s`` and a hit costs its measured Get."""
    n = requests
    tokens = float(trace.input_tokens[:n].sum())
    without_s = tokens / prefill_tokens_per_s / n
    saved = stats.token_hits
    get_s = float(np.mean(stats.get.values)) if stats.get.values else 0.0
    gets_per_request = stats.get.count / n
    with_s = (tokens - saved) / prefill_tokens_per_s / n + get_s * gets_per_request
    return {
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "prefill_tokens_saved": saved,
        "prefill_tokens_saved_ratio": saved / tokens if tokens else 0.0,
        "ttft_mean_without_kvd_s": without_s,
        "ttft_mean_with_kvd_s": with_s,
        "ttft_speedup": without_s / with_s if with_s > 0 else math.inf,
    }
