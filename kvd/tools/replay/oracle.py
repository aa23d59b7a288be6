"""How far an online policy can go on ``documents``: a policy told the
generator's own model.

``popularity_bound`` replays the ``documents`` workload (the simulator's
semantics: a lookup's hits are the longest resident prefix and are pinned
while the rest of the chain is stored) with a policy that knows what the
generator drew but not what it will draw: each document's chance of being
asked about in the current 15-minute epoch, and for a question's own
blocks the follow-up's chance and its think-time distribution. It keeps the
blocks with the highest expected reuse rate now (per second):

* the shared instruction: always;
* a document's blocks: questions per second times the document's
  popularity in this epoch, plus the follow-up hazard of every question on
  it still waiting for its follow-up;
* a question's own blocks: the follow-up hazard ``p f(a) / (1 - p F(a))``
  at the question's age ``a`` (``p`` the follow-up chance, ``f``/``F`` the
  log-normal think time), 0 once the follow-up came or for a follow-up's
  blocks (a session has at most two turns); never more than its document's
  (a block is worth nothing without its prefix).

Within equal rates the chain's tail goes first. Under the independent
reference model, keeping the highest-rate blocks is the optimal online
policy for unit-size blocks; here it is the policy that knows the
popularity any online estimate can only approach. It is not an upper bound
for every conceivable policy (one could, say, gamble on the epoch's end),
but no policy in this repository estimates popularity better than the
generator knows it. Belady's offline optimum knows the future draws as well.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.tools.replay.workloads import SEED_DEFAULT, DocumentsDraw, documents_drawn

THINK_MEDIAN_S = 180.0  # the generator's think time (workloads._think_ms)
THINK_SIGMA = 1.1
REFRESH_REQUESTS = 4  # rates are re-evaluated this often (about 2 s of the trace)
HORIZON_S = 3600.0  # a question older than this waits for no follow-up


@dataclass(frozen=True)
class BoundResult:
    """Block hits of the popularity-aware policy at one capacity."""

    capacity_blocks: int
    block_hits: int
    block_refs: int

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_refs if self.block_refs else 0.0


def follow_up_hazard(age_s: npt.NDArray[np.float64], chance: float) -> npt.NDArray[np.float64]:
    """Per second: the chance that a question of age ``age_s`` (no follow-up
    yet) gets it now, ``p f(a) / (1 - p F(a))``."""
    age = np.maximum(age_s, 1e-3)
    z = np.log(age / THINK_MEDIAN_S) / THINK_SIGMA
    pdf = np.exp(-0.5 * z * z) / (age * THINK_SIGMA * math.sqrt(2.0 * math.pi))
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    return np.asarray(chance * pdf / (1.0 - chance * cdf), dtype=np.float64)


class _Rates:
    """Each block's reuse rate now, from the draw and what happened so far."""

    def __init__(self, draw: DocumentsDraw, half_life_s: float | None) -> None:
        self.draw = draw
        # Estimated instead of known: questions per document, decayed.
        self.half_life_s = half_life_s
        self.asked = np.zeros(len(draw.doc_ids))
        self.asked_at_s = 0.0
        self.instruction = set(draw.instruction_ids)
        self.doc_of: dict[int, int] = {}
        self.position = {key: i for i, key in enumerate(draw.instruction_ids)}
        head = len(draw.instruction_ids)
        for doc, ids in enumerate(draw.doc_ids):
            for i, key in enumerate(ids):
                self.doc_of[key] = doc
                self.position[key] = head + i
        self.rank_of = [np.argsort(ranks) for ranks in draw.ranks]
        self.born: dict[int, int] = {}  # a question's own block -> its session
        self.waiting: dict[int, tuple[float, int]] = {}  # session -> (asked at s, doc)
        self.session_doc: dict[int, int] = {}
        self.doc_rate: npt.NDArray[np.float64] = np.zeros(len(draw.doc_ids))
        self.session_rate: dict[int, float] = {}

    def on_request(self, session: int, chain: list[int], now_s: float, first: bool) -> None:
        doc = self.doc_of[chain[len(self.draw.instruction_ids)]]
        self.session_doc[session] = doc
        if first:
            self.waiting[session] = (now_s, doc)
            if self.half_life_s is not None:
                self.asked *= 0.5 ** ((now_s - self.asked_at_s) / self.half_life_s)
                self.asked_at_s = now_s
                self.asked[doc] += 1.0
        else:
            self.waiting.pop(session, None)
        for position, key in enumerate(chain):
            if key not in self.doc_of and key not in self.instruction:
                self.born.setdefault(key, session)
                self.position.setdefault(key, position)

    def refresh(self, now_s: float) -> None:
        """Rates at ``now_s``: the epoch's popularity and the waiting
        questions' hazards."""
        draw = self.draw
        if self.half_life_s is None:
            epoch = min(int(now_s * 1000) // draw.epoch_ms, len(draw.ranks) - 1)
            self.doc_rate = draw.questions_per_s * draw.popularity[self.rank_of[epoch]]
        else:  # a decayed count over its mean life is a rate
            decay = 0.5 ** ((now_s - self.asked_at_s) / self.half_life_s)
            self.doc_rate = self.asked * decay * math.log(2.0) / self.half_life_s
        for session, (asked_s, _) in list(self.waiting.items()):
            if now_s - asked_s > HORIZON_S:
                del self.waiting[session]
        self.session_rate = {}
        if self.waiting:
            sessions = list(self.waiting)
            ages = np.array([now_s - self.waiting[s][0] for s in sessions])
            hazards = follow_up_hazard(ages, draw.follow_up_chance)
            docs = np.array([self.waiting[s][1] for s in sessions])
            np.add.at(self.doc_rate, docs, hazards)
            self.session_rate = dict(zip(sessions, hazards.tolist(), strict=True))

    def rate(self, key: int) -> float:
        if key in self.instruction:
            return math.inf
        doc = self.doc_of.get(key)
        if doc is not None:
            return float(self.doc_rate[doc])
        session = self.born[key]
        own = self.session_rate.get(session, 0.0)
        return min(own, float(self.doc_rate[self.session_doc[session]]))


def popularity_bound(
    fraction: float, seed: int = SEED_DEFAULT, half_life_s: float | None = None
) -> BoundResult:
    """Block hit ratio of the popularity-aware policy on ``documents`` at
    ``fraction`` of its unique blocks (as ``sim.capacity_for``). With
    ``half_life_s`` each document's popularity is not told but estimated, as
    an online policy must: its questions so far, decayed with that half-life
    (the follow-up model is still told)."""
    records, draw = documents_drawn(seed)
    chains = [list(map(int, record["hash_ids"])) for record in records]  # type: ignore[call-overload]
    unique = len({key for chain in chains for key in chain})
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    capacity = max(1, int(unique * fraction))
    rates = _Rates(draw, half_life_s)
    resident: dict[int, int] = {}  # key -> version of its heap entry
    heap: list[tuple[float, int, int, int]] = []  # (rate, -position, key, version)
    version = 0
    refreshed, built = -REFRESH_REQUESTS, False
    hits_total = refs_total = 0
    seen_sessions: set[int] = set()
    for request, (record, chain) in enumerate(zip(records, chains, strict=True)):
        now_s = int(record["timestamp"]) / 1000.0  # type: ignore[call-overload]
        session = draw.session_of[request]
        first = session not in seen_sessions
        seen_sessions.add(session)
        rates.on_request(session, chain, now_s, first)
        if request >= refreshed + REFRESH_REQUESTS:
            rates.refresh(now_s)
            refreshed = request
            built = False
        hits = 0
        while hits < len(chain) and chain[hits] in resident:
            hits += 1
        hits_total += hits
        refs_total += len(chain)
        pinned = set(chain[:hits])
        held: list[tuple[float, int, int, int]] = []
        for key in chain[hits:]:
            if key in resident:
                continue
            if len(resident) >= capacity and not built:
                # The order by the rates of now, built only when needed.
                heap = [(rates.rate(k), -rates.position[k], k, v) for k, v in resident.items()]
                heapq.heapify(heap)
                built = True
            while len(resident) >= capacity and heap:
                entry = heapq.heappop(heap)
                if resident.get(entry[2]) != entry[3]:
                    continue  # stale: evicted, or pushed again since
                if entry[2] in pinned:
                    held.append(entry)
                    continue
                del resident[entry[2]]
            if len(resident) >= capacity:
                break  # everything else is pinned: the rest is not stored
            version += 1
            resident[key] = version
            heapq.heappush(heap, (rates.rate(key), -rates.position[key], key, version))
        for entry in held:
            heapq.heappush(heap, entry)
    return BoundResult(capacity, hits_total, refs_total)


def main() -> None:
    """``python -m kvd.tools.replay.oracle``: the bound at 5 and 10 %, and
    the same policy with popularity estimated from decayed counts."""
    for fraction in (0.05, 0.10):
        for half_life_s in (None, 70.0, 300.0, 900.0):
            result = popularity_bound(fraction, half_life_s=half_life_s)
            told = "told" if half_life_s is None else f"half-life {half_life_s:g} s"
            print(json.dumps({
                "fraction": fraction, "popularity": told,
                "capacity_blocks": result.capacity_blocks,
                "block_hit_ratio": round(result.block_hit_ratio, 6),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
