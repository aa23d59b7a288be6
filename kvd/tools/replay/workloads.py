"""Synthetic request workloads in the trace format, for choosing eviction
policies on shapes the conversation trace does not have.

Each generator is seeded and returns JSON records of the Mooncake trace
format (``kvd.tools.replay.trace``): ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` of 512-token blocks. Hash ids are built
the way an engine's chained block hashes behave: a session's prompt is a
token count; its full blocks keep their ids from turn to turn, the partial
last block gets a fresh id every turn (its tokens change), and a block that
becomes full gets a new id (it now holds different tokens). A shared prefix
(a system prompt, a document) shares only its full blocks; the block where
it meets per-request text is per request.

The shapes (``WORKLOADS``):

* ``shared-prompts`` -- a few long system prompts (Zipf popularity) shared
  by many short chat sessions of 1-6 turns;
* ``documents`` -- long documents (Zipf popularity, the hot set drifting
  every 15 minutes) re-read by many one- or two-turn questions;
* ``agents`` -- tool-using agents: one of three tool prompts, then 5-60
  turns each adding a tool result and a short reply, seconds apart;
* ``bursts`` -- short chat sessions on shared prompts (the hot set), and
  every few minutes a burst of long one-shot requests that are never
  re-read (batch jobs), which must not flush the hot set;
* ``diurnal-mix`` -- the three first shapes together, arrivals following a
  day-shaped rate (a quiet night at a fifth of the peak), two hours long.

``TUNING`` and ``HELD_OUT`` split them: a policy is chosen on the tuning
shapes (and the conversation trace) and reported on the held-out ones
separately. Every workload is about 5-12k requests and 100-400k block
references, so one simulated policy run takes seconds.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvd.tools.replay.trace import BLOCK_TOKENS_DEFAULT, Trace, parse_trace

BLOCK_TOKENS = BLOCK_TOKENS_DEFAULT
HOUR_MS = 3_600_000
# Prompts are capped at 64k tokens (128 blocks): the conversation trace's
# longest chains are of that order, and longer ones only slow the replay.
PROMPT_TOKENS_MAX = 64 * 1024

Record = dict[str, object]


class WorkloadError(ValueError):
    """An unknown workload name or bad generator parameters."""


class _Ids:
    """Fresh hash ids, counting up (ids encode their whole prefix, so a new
    block anywhere is a new id)."""

    def __init__(self) -> None:
        self.next_id = 0

    def take(self, count: int) -> list[int]:
        first = self.next_id
        self.next_id += count
        return list(range(first, first + count))


@dataclass
class _Prefix:
    """A shared prefix: its token count and the ids of its full blocks."""

    tokens: int
    ids: list[int]


def _prefix(ids: _Ids, tokens: int, base: _Prefix | None = None) -> _Prefix:
    """A prefix of ``tokens`` more tokens, after ``base`` when given."""
    start_tokens = base.tokens if base else 0
    start_ids = list(base.ids) if base else []
    total = start_tokens + tokens
    return _Prefix(total, start_ids + ids.take(total // BLOCK_TOKENS - len(start_ids)))


@dataclass
class _Session:
    """A growing prompt: full block ids so far and its token count."""

    ids: list[int]
    tokens: int
    turns_left: int
    kind: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def on(cls, prefix: _Prefix, turns: int, kind: str = "") -> _Session:
        return cls(list(prefix.ids), prefix.tokens, turns, kind)

    def request(self, ids: _Ids, added_tokens: int, output_tokens: int, now_ms: int) -> Record:
        """The next turn: ``added_tokens`` appended to the prompt (after the
        previous turn's answer, already in it)."""
        self.tokens = min(self.tokens + max(1, added_tokens), PROMPT_TOKENS_MAX)
        full = self.tokens // BLOCK_TOKENS
        if full > len(self.ids):
            self.ids += ids.take(full - len(self.ids))
        chain = self.ids[:full]
        if self.tokens % BLOCK_TOKENS:
            chain = chain + ids.take(1)  # the partial last block: new every turn
        input_tokens = self.tokens
        # The answer joins the prompt of the next turn.
        self.tokens = min(self.tokens + output_tokens, PROMPT_TOKENS_MAX)
        return {
            "timestamp": now_ms,
            "input_length": input_tokens,
            "output_length": output_tokens,
            "hash_ids": chain,
        }


def _zipf_weights(n: int, exponent: float) -> npt.NDArray[np.float64]:
    weights = np.power(np.arange(1, n + 1, dtype=np.float64), -exponent)
    return weights / float(weights.sum())


def _lognormal_ms(rng: np.random.Generator, median_s: float, sigma: float) -> int:
    return int(1000 * median_s * math.exp(sigma * float(rng.standard_normal())))


class _Clock:
    """Events in time order: session arrivals and next turns."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, _Session]] = []
        self._seq = 0

    def at(self, when_ms: int, session: _Session) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when_ms, self._seq, session))

    def events(self) -> Iterator[tuple[int, _Session]]:
        while self._heap:
            when_ms, _, session = heapq.heappop(self._heap)
            yield when_ms, session


def _poisson_arrivals(
    rng: np.random.Generator, rate_per_s: float, duration_ms: int,
    shape: Callable[[float], float] | None = None,
) -> list[int]:  # fmt: skip
    """Arrival times of a Poisson process, thinned by ``shape(t / duration)``
    (a rate multiplier in 0..1) when given."""
    times: list[int] = []
    now_s = 0.0
    while True:
        now_s += float(rng.exponential(1.0 / rate_per_s))
        when_ms = int(now_s * 1000)
        if when_ms >= duration_ms:
            return times
        if shape is None or float(rng.random()) < shape(when_ms / duration_ms):
            times.append(when_ms)


def _chat_turn_tokens(rng: np.random.Generator) -> tuple[int, int]:
    """A chat user message (one in five pastes 1-6k tokens of text) and the
    model's answer, in tokens."""
    if float(rng.random()) < 0.2:
        return int(rng.integers(1000, 6000)), int(rng.integers(50, 700))
    return int(rng.integers(30, 400)), int(rng.integers(50, 700))


def _think_ms(rng: np.random.Generator) -> int:
    """A user's time to the next turn: median 3 minutes, heavy-tailed (the
    conversation trace's next turns come seconds to tens of minutes later)."""
    return _lognormal_ms(rng, 180.0, 1.1)


def _chat_turns(rng: np.random.Generator) -> int:
    """Turns of a chat session: geometric, mean 2.5, at most 12."""
    return int(min(12, rng.geometric(0.4)))


def shared_prompts(seed: int, duration_ms: int = HOUR_MS) -> list[Record]:
    """Six system prompts of 4-16k tokens (Zipf 1.1) under short chats."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompts = [_prefix(ids, int(rng.integers(4096, 16384))) for _ in range(6)]
    popularity = _zipf_weights(len(prompts), 1.1)
    clock = _Clock()
    for when_ms in _poisson_arrivals(rng, 1.2, duration_ms):
        prompt = prompts[int(rng.choice(len(prompts), p=popularity))]
        clock.at(when_ms, _Session.on(prompt, _chat_turns(rng), "chat"))
    return _run_sessions(rng, ids, clock, duration_ms)


@dataclass
class DocumentsDraw:
    """What ``documents`` drew besides its requests: the generator's own
    model, which an offline bound may use (kvd.tools.replay.oracle)."""

    instruction_ids: list[int]  # the full blocks every question starts with
    doc_ids: list[list[int]]  # each document's own full blocks, after the instruction
    popularity: npt.NDArray[np.float64]  # a question's chance of each rank
    epoch_ms: int
    ranks: list[npt.NDArray[np.int64]]  # per epoch: the document at each rank
    questions_per_s: float
    follow_up_chance: float
    session_of: list[int] = field(default_factory=list)  # per request: its session's number


def documents(seed: int, duration_ms: int = HOUR_MS) -> list[Record]:
    """2000 documents of 4-64k tokens (Pareto sizes) after a 1k-token
    instruction, re-read by one- or two-turn questions; Zipf 0.8 popularity
    whose ranks are reshuffled every 15 minutes (the hot set drifts)."""
    return documents_drawn(seed, duration_ms)[0]


def documents_drawn(seed: int, duration_ms: int = HOUR_MS) -> tuple[list[Record], DocumentsDraw]:
    """``documents``, with what it drew."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    instruction = _prefix(ids, 1024)
    docs = [
        _prefix(ids, int(min(65536, 4096 * rng.pareto(1.3) + 4096)), instruction)
        for _ in range(2000)
    ]
    popularity = _zipf_weights(len(docs), 0.8)
    ranks = rng.permutation(len(docs))
    draw = DocumentsDraw(
        instruction.ids, [doc.ids[len(instruction.ids) :] for doc in docs], popularity,
        epoch_ms=900_000, ranks=[ranks], questions_per_s=2.0, follow_up_chance=0.3,
    )  # fmt: skip
    epoch = 0
    clock = _Clock()
    arrivals = _poisson_arrivals(rng, draw.questions_per_s, duration_ms)
    for number, when_ms in enumerate(arrivals):
        if when_ms // draw.epoch_ms != epoch:
            epoch = when_ms // draw.epoch_ms
            ranks = rng.permutation(len(docs))
            draw.ranks += [ranks] * (epoch + 1 - len(draw.ranks))
        doc = docs[int(ranks[int(rng.choice(len(docs), p=popularity))])]
        session = _Session.on(doc, 1 + int(rng.random() < draw.follow_up_chance), "question")
        session.extra["number"] = number
        clock.at(when_ms, session)
    numbers = draw.session_of
    records = _run_sessions(
        rng, ids, clock, duration_ms, lambda s: numbers.append(int(s.extra["number"]))
    )
    return records, draw


def _agent_wait_ms(rng: np.random.Generator) -> int:
    """Time to an agent's next turn: a tool call of ~3 s, or one time in
    eight a pause of minutes (a person approving, a long job)."""
    if float(rng.random()) < 0.125:
        return _lognormal_ms(rng, 240.0, 0.8)
    return _lognormal_ms(rng, 3.0, 0.7)


def _agent_turns(rng: np.random.Generator) -> int:
    return int(min(60, 4 + rng.geometric(1 / 10)))


def agents(seed: int, duration_ms: int = HOUR_MS) -> list[Record]:
    """Agents on one of three 6-12k-token tool prompts, 5-60 turns each
    adding a tool result (100-1500 tokens) and a short reply."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    tools = [_prefix(ids, int(rng.integers(6144, 12288))) for _ in range(3)]
    clock = _Clock()
    for when_ms in _poisson_arrivals(rng, 0.2, duration_ms):
        clock.at(when_ms, _Session.on(tools[int(rng.integers(3))], _agent_turns(rng), "agent"))
    return _run_sessions(rng, ids, clock, duration_ms)


def _run_sessions(
    rng: np.random.Generator, ids: _Ids, clock: _Clock, duration_ms: int,
    on_request: Callable[[_Session], None] | None = None,
) -> list[Record]:  # fmt: skip
    """Serve every session's turns in time order: agents, chats, one-shots
    (``on_request`` sees each session as its next request is made)."""
    records: list[Record] = []
    for now_ms, session in clock.events():
        if on_request is not None:
            on_request(session)
        if session.kind == "agent":
            added, output = int(rng.integers(100, 1500)), int(rng.integers(20, 300))
            wait_ms = _agent_wait_ms(rng)
        elif session.kind == "batch":
            added, output = int(session.extra["tokens"]), 200
            wait_ms = 0
        else:
            added, output = _chat_turn_tokens(rng)
            wait_ms = _think_ms(rng)
        records.append(session.request(ids, added, output, now_ms))
        session.turns_left -= 1
        if session.turns_left > 0 and now_ms + wait_ms < duration_ms:
            clock.at(now_ms + wait_ms, session)
    return records


def bursts(seed: int, duration_ms: int = HOUR_MS) -> list[Record]:
    """Chats on four shared prompts, and every 4-8 minutes a burst of 150-400
    one-shot requests of 8-32k tokens within 30 s, never re-read."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompts = [_prefix(ids, int(rng.integers(2048, 8192))) for _ in range(4)]
    popularity = _zipf_weights(len(prompts), 1.0)
    clock = _Clock()
    for when_ms in _poisson_arrivals(rng, 1.0, duration_ms):
        prompt = prompts[int(rng.choice(len(prompts), p=popularity))]
        clock.at(when_ms, _Session.on(prompt, _chat_turns(rng), "chat"))
    start_ms = int(rng.integers(60_000, 240_000))
    while start_ms < duration_ms:
        for _ in range(int(rng.integers(150, 400))):
            when_ms = start_ms + int(rng.integers(0, 30_000))
            if when_ms < duration_ms:
                one_shot = _Session([], 0, 1, "batch")
                one_shot.extra["tokens"] = float(rng.integers(8192, 32768))
                clock.at(when_ms, one_shot)
        start_ms += int(rng.integers(240_000, 480_000))
    return _run_sessions(rng, ids, clock, duration_ms)


def _day(fraction: float) -> float:
    """A day's shape as a rate multiplier: 0.2 at night, 1.0 at the peak."""
    return 0.6 - 0.4 * math.cos(2 * math.pi * fraction)


def diurnal_mix(seed: int, duration_ms: int = 2 * HOUR_MS) -> list[Record]:
    """Chats on shared prompts, document questions and agents together,
    every arrival thinned by a day-shaped rate (``_day``)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompts = [_prefix(ids, int(rng.integers(3072, 12288))) for _ in range(5)]
    instruction = _prefix(ids, 1536)
    docs = [_prefix(ids, int(rng.integers(4096, 24576)), instruction) for _ in range(800)]
    tools = [_prefix(ids, int(rng.integers(6144, 10240))) for _ in range(2)]
    prompt_weights = _zipf_weights(len(prompts), 1.0)
    doc_weights = _zipf_weights(len(docs), 0.9)
    clock = _Clock()
    for when_ms in _poisson_arrivals(rng, 0.8, duration_ms, _day):
        draw = float(rng.random())
        if draw < 0.5:
            prompt = prompts[int(rng.choice(len(prompts), p=prompt_weights))]
            clock.at(when_ms, _Session.on(prompt, _chat_turns(rng), "chat"))
        elif draw < 0.9:
            doc = docs[int(rng.choice(len(docs), p=doc_weights))]
            clock.at(when_ms, _Session.on(doc, 1 + int(rng.random() < 0.3), "question"))
        else:
            clock.at(when_ms, _Session.on(tools[int(rng.integers(2))], _agent_turns(rng), "agent"))
    return _run_sessions(rng, ids, clock, duration_ms)


Generator = Callable[[int], list[Record]]

WORKLOADS: dict[str, Generator] = {
    "shared-prompts": shared_prompts,
    "documents": documents,
    "agents": agents,
    "bursts": bursts,
    "diurnal-mix": diurnal_mix,
}
TUNING: tuple[str, ...] = ("shared-prompts", "documents")
HELD_OUT: tuple[str, ...] = ("agents", "bursts", "diurnal-mix")
SEED_DEFAULT = 1


def records(name: str, seed: int = SEED_DEFAULT) -> list[Record]:
    """The requests of a workload, in time order."""
    generator = WORKLOADS.get(name)
    if generator is None:
        raise WorkloadError(f"unknown workload {name!r}; expected one of {tuple(WORKLOADS)}")
    return generator(seed)


def lines(name: str, seed: int = SEED_DEFAULT) -> list[str]:
    """The workload as JSONL lines (the trace format)."""
    return [json.dumps(record) for record in records(name, seed)]


def generate(name: str, seed: int = SEED_DEFAULT) -> Trace:
    """The workload parsed (and so validated) as a Trace."""
    return parse_trace(lines(name, seed))


def write(name: str, path: str | Path, seed: int = SEED_DEFAULT) -> int:
    """Write the workload as a JSONL trace file; returns the request count."""
    text = lines(name, seed)
    Path(path).write_text("\n".join(text) + "\n")
    return len(text)
