"""Trace-driven cache simulator for the store's eviction policies.

Semantics, per request of a trace, at a capacity in blocks:

1. look up the chain: the hits are the longest prefix of resident blocks
   (a lookup stops at the first miss, as the daemon's ``Lookup`` does);
2. touch the hits, head first, then tell the policy the lookup's outcome
   (``on_lookup(chain, hits)``, as the store does after a ``Lookup``);
3. store the rest of the chain in order, each block with its parent: a block
   that is still resident past the first miss is touched, a missing one is
   inserted, evicting ``victim()``s first while the cache is full. The
   lookup's hits are pinned (``skip`` is true for them), as the replay's
   lease pins them in the daemon; the blocks this request puts are not, so
   when a chain is longer than what is free its own new blocks can go
   (exactly what the daemon does: pinning the whole chain instead made the
   simulator differ from it by 0.3-0.5 points when a chain was longer than
   L1). If nothing is evictable the rest of the chain is not stored.

Block hit ratio = hit blocks / referenced blocks. Token hit ratio uses
``block_tokens`` per block and the request's ``input_length`` for its last,
partial block. With these semantics plain (not prefix-aware) LRU over the
touched and stored blocks reproduces the trace README's LRU figures
(19.54 / 27.84 / 34.46 % at 5 / 10 / 20 % of the unique blocks).

``belady`` is the offline optimum: on each insert it evicts the resident block
whose next reference is farthest (possibly the block just stored, i.e. it
may bypass). Time is the position in the flat reference sequence, so a
block's next reference always comes after its parent's; the farthest block
therefore never has a resident descendant, the resident set stays
prefix-closed, and prefix hits equal plain hits. MIN is optimal for plain
hits and prefix hits can only be fewer, so no policy beats it on either.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.store.eviction.policy import POLICIES, EvictionPolicy, make_policy
from kvd.tools.replay.trace import Trace

SWEEP_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50)
BELADY = "belady"
UNBOUNDED = "unbounded"
PLAIN_LRU = "plain-lru"


class SimError(ValueError):
    """Bad simulation parameters (capacity, policy name)."""


@dataclass(frozen=True)
class SimResult:
    """Outcome of one policy over one trace at one capacity."""

    policy: str
    capacity_blocks: int
    requests: int
    block_refs: int
    block_hits: int
    token_refs: int
    token_hits: int
    evictions: int
    policy_ops: int  # insert + touch + remove + victim calls
    elapsed_s: float  # wall time of the whole replay

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.token_hits / self.token_refs if self.token_refs else 0.0

    @property
    def ops_per_s(self) -> float:
        """Policy calls per second, replay overhead included (a lower bound)."""
        return self.policy_ops / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _check_capacity(capacity_blocks: int) -> None:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int):
        raise SimError(f"capacity_blocks must be an int, got {type(capacity_blocks).__name__}")
    if capacity_blocks < 0:
        raise SimError(f"capacity_blocks must be >= 0, got {capacity_blocks}")


def _token_hits(hit_blocks: int, chain_blocks: int, input_tokens: int, block_tokens: int) -> int:
    if hit_blocks == chain_blocks:
        return input_tokens
    return hit_blocks * block_tokens


def simulate(
    trace: Trace,
    policy_name: str,
    capacity_blocks: int,
    *,
    lookup_hook: bool = True,
    wrap: Callable[[EvictionPolicy[int]], EvictionPolicy[int]] | None = None,
) -> SimResult:
    """Replay ``trace`` through a fresh ``policy_name`` policy (see module doc);
    without ``lookup_hook`` the policy never hears of lookups, as in a store
    that does not call ``on_lookup``; ``wrap`` may wrap the policy (to time
    its calls, kvd.tools.replay.suite)."""
    _check_capacity(capacity_blocks)
    if policy_name not in POLICIES:
        raise SimError(f"unknown policy {policy_name!r}; expected one of {POLICIES}")
    policy: EvictionPolicy[int] = make_policy(policy_name)
    if wrap is not None:
        policy = wrap(policy)
    blocks: list[int] = trace.blocks.tolist()
    offsets: list[int] = trace.offsets.tolist()
    inputs: list[int] = trace.input_tokens.tolist()
    resident = bytearray(trace.n_unique)
    pinned: set[int] = set()
    skip: Callable[[int], bool] = pinned.__contains__
    insert, touch, remove, victim = policy.insert, policy.touch, policy.remove, policy.victim
    on_lookup = policy.on_lookup
    block_tokens = trace.block_tokens
    stored = block_hits = token_hits = evictions = ops = 0
    started = time.perf_counter()
    for request in range(len(offsets) - 1):
        chain = blocks[offsets[request] : offsets[request + 1]]
        n = len(chain)
        hits = 0
        while hits < n and resident[chain[hits]]:
            hits += 1
        block_hits += hits
        token_hits += _token_hits(hits, n, inputs[request], block_tokens)
        for key in chain[:hits]:
            touch(key)
        if lookup_hook:
            on_lookup(chain, hits)
            # The replay then Gets every hit, and a Get is a hit to the policy
            # too (the store cannot tell it follows a Lookup).
            for key in chain[:hits]:
                touch(key)
        ops += hits + 1
        if hits == n:
            continue
        pinned.clear()
        pinned.update(chain[:hits])
        parent = chain[hits - 1] if hits else None
        for key in chain[hits:]:
            ops += 1
            if resident[key]:
                touch(key)
                parent = key
                continue
            while stored >= capacity_blocks:
                ops += 2
                evicted = victim(skip)
                if evicted is None:
                    break
                remove(evicted)
                resident[evicted] = 0
                stored -= 1
                evictions += 1
            if stored >= capacity_blocks:
                break  # everything else is pinned: the rest is not stored
            insert(key, parent)
            resident[key] = 1
            stored += 1
            parent = key
    elapsed_s = time.perf_counter() - started
    assert stored == len(policy), "policy lost track of resident blocks"
    return _result(
        trace,
        policy_name,
        capacity_blocks,
        block_hits,
        token_hits,
        evictions=evictions,
        policy_ops=ops,
        elapsed_s=elapsed_s,
    )


def _next_reference(blocks: np.ndarray) -> list[int]:
    """For each reference, the position of the next reference to the same
    block, or len(blocks) when there is none."""
    n = int(blocks.shape[0])
    order = np.argsort(blocks, kind="stable")
    following = np.full(n, n, dtype=np.int64)
    same = blocks[order[1:]] == blocks[order[:-1]]
    following[order[:-1][same]] = order[1:][same]
    result: list[int] = following.tolist()
    return result


def belady(trace: Trace, capacity_blocks: int) -> SimResult:
    """The offline optimum (MIN with bypass) under the prefix-hit semantics."""
    _check_capacity(capacity_blocks)
    blocks: list[int] = trace.blocks.tolist()
    offsets: list[int] = trace.offsets.tolist()
    inputs: list[int] = trace.input_tokens.tolist()
    following = _next_reference(trace.blocks)
    resident_next: dict[int, int] = {}  # block -> position of its next reference
    heap: list[tuple[int, int]] = []  # (-next position, block), stale entries skipped
    block_tokens = trace.block_tokens
    block_hits = token_hits = evictions = 0
    started = time.perf_counter()
    for request in range(len(offsets) - 1):
        start, end = offsets[request], offsets[request + 1]
        hits = 0
        while start + hits < end and blocks[start + hits] in resident_next:
            hits += 1
        block_hits += hits
        token_hits += _token_hits(hits, end - start, inputs[request], block_tokens)
        for position in range(start, end):
            key = blocks[position]
            upcoming = following[position]
            resident_next[key] = upcoming
            heapq.heappush(heap, (-upcoming, key))
            while len(resident_next) > capacity_blocks:
                negative_next, farthest = heapq.heappop(heap)
                if resident_next.get(farthest) == -negative_next:
                    del resident_next[farthest]
                    evictions += 1
            if len(heap) > 2 * len(resident_next) + 1024:
                heap = [(-upcoming_, key_) for key_, upcoming_ in resident_next.items()]
                heapq.heapify(heap)
    elapsed_s = time.perf_counter() - started
    return _result(
        trace,
        BELADY,
        capacity_blocks,
        block_hits,
        token_hits,
        evictions=evictions,
        policy_ops=0,
        elapsed_s=elapsed_s,
    )


def plain_lru(trace: Trace, capacity_blocks: int) -> SimResult:
    """Block-level LRU that ignores chains (evicts heads as readily as tails):
    the baseline the trace README quotes, kept to validate the simulator."""
    _check_capacity(capacity_blocks)
    blocks: list[int] = trace.blocks.tolist()
    offsets: list[int] = trace.offsets.tolist()
    inputs: list[int] = trace.input_tokens.tolist()
    recency: OrderedDict[int, None] = OrderedDict()
    block_hits = token_hits = evictions = 0
    started = time.perf_counter()
    for request in range(len(offsets) - 1):
        chain = blocks[offsets[request] : offsets[request + 1]]
        hits = 0
        while hits < len(chain) and chain[hits] in recency:
            hits += 1
        block_hits += hits
        token_hits += _token_hits(hits, len(chain), inputs[request], trace.block_tokens)
        for key in chain:
            if key in recency:
                recency.move_to_end(key)
                continue
            recency[key] = None
            if len(recency) > capacity_blocks:
                recency.popitem(last=False)
                evictions += 1
    return _result(
        trace,
        PLAIN_LRU,
        capacity_blocks,
        block_hits,
        token_hits,
        evictions=evictions,
        policy_ops=0,
        elapsed_s=time.perf_counter() - started,
    )


def unbounded(trace: Trace) -> SimResult:
    """Hits of a cache that never evicts: the bound for every capacity."""
    blocks: list[int] = trace.blocks.tolist()
    offsets: list[int] = trace.offsets.tolist()
    inputs: list[int] = trace.input_tokens.tolist()
    resident = bytearray(trace.n_unique)
    block_hits = token_hits = 0
    started = time.perf_counter()
    for request in range(len(offsets) - 1):
        chain = blocks[offsets[request] : offsets[request + 1]]
        hits = 0
        while hits < len(chain) and resident[chain[hits]]:
            hits += 1
        block_hits += hits
        token_hits += _token_hits(hits, len(chain), inputs[request], trace.block_tokens)
        for key in chain:
            resident[key] = 1
    return _result(
        trace,
        UNBOUNDED,
        trace.n_unique,
        block_hits,
        token_hits,
        evictions=0,
        policy_ops=0,
        elapsed_s=time.perf_counter() - started,
    )


def capacity_for(trace: Trace, fraction: float) -> int:
    """Capacity in blocks for a fraction of the trace's unique blocks."""
    if not 0.0 < fraction <= 1.0:
        raise SimError(f"fraction must be in (0, 1], got {fraction}")
    return max(1, int(trace.n_unique * fraction))


def sweep(
    trace: Trace,
    policies: Sequence[str] = POLICIES,
    fractions: Iterable[float] = SWEEP_FRACTIONS,
    *,
    with_belady: bool = True,
    with_plain_lru: bool = True,
) -> list[SimResult]:
    """At each fraction of the unique blocks: plain LRU, every policy, Belady;
    then the unbounded bound; results in that order."""
    results: list[SimResult] = []
    for fraction in fractions:
        capacity_blocks = capacity_for(trace, fraction)
        if with_plain_lru:
            results.append(plain_lru(trace, capacity_blocks))
        for name in policies:
            results.append(simulate(trace, name, capacity_blocks))
        if with_belady:
            results.append(belady(trace, capacity_blocks))
    results.append(unbounded(trace))
    return results


def format_table(trace: Trace, results: Sequence[SimResult]) -> str:
    """Block hit ratios as a Markdown table: a row per policy, a column per capacity."""
    capacities = sorted({r.capacity_blocks for r in results if r.policy != UNBOUNDED})
    names = list(dict.fromkeys(r.policy for r in results))
    by_key = {(r.policy, r.capacity_blocks): r for r in results}
    header = ["policy"] + [f"{100 * c / trace.n_unique:.0f}% ({c})" for c in capacities]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        cells = [name]
        for capacity in capacities:
            result = by_key.get((name, capacity)) or by_key.get((name, trace.n_unique))
            cells.append(f"{100 * result.block_hit_ratio:.2f}%" if result else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _result(
    trace: Trace,
    policy: str,
    capacity_blocks: int,
    block_hits: int,
    token_hits: int,
    *,
    evictions: int,
    policy_ops: int,
    elapsed_s: float,
) -> SimResult:
    """A run's result; the trace gives the reference counts."""
    return SimResult(
        policy=policy,
        capacity_blocks=capacity_blocks,
        requests=len(trace),
        block_refs=trace.n_refs,
        block_hits=block_hits,
        token_refs=int(trace.input_tokens.sum()),
        token_hits=token_hits,
        evictions=evictions,
        policy_ops=policy_ops,
        elapsed_s=elapsed_s,
    )
