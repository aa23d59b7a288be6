"""A policy's own CPU cost per block reference, measured so that it holds
still on a machine shared with other work.

Timing every policy call with a wall clock (what ``kvd bench replay
--workloads`` did first) moved by +-50 % between runs on the 2-core
development machine: a call's wall time includes every moment the thread
waited for a core, and the clock calls around it (~0.1 us each) were
counted in. Here a simulation records the calls it makes into the policy
(``CallLog``, a wrapper the simulator accepts); the recorded calls are then
replayed into a fresh policy of the same name in a tight loop, timed with
the thread's CPU clock (``time.thread_time``: time waiting for a core is not
in it), best of a few repeats, and the same loop into a policy that does
nothing is taken off. The policies are deterministic, so the replay makes
the same decisions; every victim is checked against the recorded one.

What is left is the policy's own work per reference (chain tree, heaps,
learning), the figure the daemon pays on every Lookup key and Put: the
store makes the same calls for the same requests (the daemon equals the
simulator, tests/tools/replay/test_run.py). Wall time of the same loop is
reported beside it.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvd.store.eviction.policy import EvictionPolicy, make_policy
from kvd.tools.replay.sim import SimResult, simulate
from kvd.tools.replay.trace import Trace

# Best of this many replays (each is a whole trace, 1-3 s of CPU for the
# learned policies on the conversation trace): the minimum drops the runs
# that shared a core's caches with other work.
REPEATS_DEFAULT = 3

_INSERT, _TOUCH, _REMOVE, _VICTIM, _LOOKUP = range(5)
_NONE = -1  # keys are block indexes (>= 0) in the simulator


class CostError(RuntimeError):
    """A replayed policy decided differently from the recorded run."""


class CallLog:
    """Wraps a policy and records every call into it, in order.

    ``victim``'s ``skip`` must be a set's ``__contains__`` (the simulator's
    pinned blocks): the set is copied when it changed since the last call.
    """

    def __init__(self, inner: EvictionPolicy[int]) -> None:
        self.inner = inner
        self.name = inner.name
        self.ops = bytearray()
        self.first = array("q")  # the key; for victim the pin set; for on_lookup the chain
        self.second = array("q")  # parent, victim chosen, or hits; _NONE for None
        self.pins: list[frozenset[int]] = []
        self.chains: list[Sequence[int]] = []

    def insert(self, key: int, parent: int | None) -> None:
        self._add(_INSERT, key, _NONE if parent is None else parent)
        self.inner.insert(key, parent)

    def touch(self, key: int) -> None:
        self._add(_TOUCH, key, 0)
        self.inner.touch(key)

    def touch_many(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: int) -> None:
        self._add(_REMOVE, key, 0)
        self.inner.remove(key)

    def victim(self, skip: Callable[[int], int]) -> int | None:
        pinned = getattr(skip, "__self__", None)
        if not isinstance(pinned, (set, frozenset)):
            raise TypeError("CallLog records victim(skip) only for skip = a_set.__contains__")
        if not self.pins or self.pins[-1] != pinned:
            self.pins.append(frozenset(pinned))
        key = self.inner.victim(skip)
        self._add(_VICTIM, len(self.pins) - 1, _NONE if key is None else key)
        return key

    def on_lookup(self, keys: Sequence[int], hits: int, mine: Sequence[bool] | None = None) -> None:
        assert mine is None, "the cost replay is of one daemon"
        self.chains.append(keys)
        self._add(_LOOKUP, len(self.chains) - 1, hits)
        self.inner.on_lookup(keys, hits)

    def shared_plan(self) -> bytes | None:
        return self.inner.shared_plan()

    def adopt_plan(self, plan: bytes) -> bool:
        raise AssertionError("the cost replay is of one daemon")

    def history(self, key: int) -> bytes | None:
        raise AssertionError("the cost replay is of one daemon")

    def expect(self, key: int, history: bytes) -> bool:
        raise AssertionError("the cost replay is of one daemon")

    def unpark(self, key: int) -> None:
        self.inner.unpark(key)

    def unpark_all(self) -> None:
        self.inner.unpark_all()

    def __len__(self) -> int:
        return len(self.inner)

    def _add(self, op: int, first: int, second: int) -> None:
        self.ops.append(op)
        self.first.append(first)
        self.second.append(second)


class _NullPolicy:
    """Takes every call and does nothing: the replay loop's own cost."""

    name = "null"

    def insert(self, key: int, parent: int | None) -> None:
        pass

    def touch(self, key: int) -> None:
        pass

    def touch_many(self, keys: Iterable[int]) -> None:
        pass

    def remove(self, key: int) -> None:
        pass

    def victim(self, skip: Callable[[int], int]) -> int | None:
        return None

    def unpark(self, key: int) -> None:
        pass

    def unpark_all(self) -> None:
        pass

    def on_lookup(self, keys: Sequence[int], hits: int, mine: Sequence[bool] | None = None) -> None:
        pass

    def shared_plan(self) -> bytes | None:
        return None

    def adopt_plan(self, plan: bytes) -> bool:
        return False

    def history(self, key: int) -> bytes | None:
        return None

    def expect(self, key: int, history: bytes) -> bool:
        return False

    def __len__(self) -> int:
        return 0


def _replay(policy: EvictionPolicy[int], log: CallLog) -> tuple[float, float, list[int | None]]:
    """Thread CPU and wall seconds of replaying ``log`` into ``policy``, and
    the victims it chose."""
    insert, touch, remove = policy.insert, policy.touch, policy.remove
    victim, on_lookup = policy.victim, policy.on_lookup
    pins, chains = log.pins, log.chains
    chosen: list[int | None] = []
    choose = chosen.append
    started_cpu, started_wall = time.thread_time(), time.perf_counter()
    for op, first, second in zip(log.ops, log.first, log.second, strict=True):
        if op == _TOUCH:
            touch(first)
        elif op == _INSERT:
            insert(first, None if second == _NONE else second)
        elif op == _REMOVE:
            remove(first)
        elif op == _VICTIM:
            choose(victim(pins[first].__contains__))
        else:
            on_lookup(chains[first], second)
    return time.thread_time() - started_cpu, time.perf_counter() - started_wall, chosen


@dataclass(frozen=True)
class PolicyCost:
    """A policy's CPU and wall time per block reference and per request."""

    policy: str
    block_refs: int
    requests: int
    calls: int
    cpu_s: float  # best replay, the null loop's best taken off
    wall_s: float

    @property
    def cpu_us_per_ref(self) -> float:
        return 1e6 * self.cpu_s / self.block_refs if self.block_refs else 0.0

    @property
    def wall_us_per_ref(self) -> float:
        return 1e6 * self.wall_s / self.block_refs if self.block_refs else 0.0

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.cpu_s / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "cpu_us_per_ref": self.cpu_us_per_ref,
                "wall_us_per_ref": self.wall_us_per_ref}  # fmt: skip


def measure(
    trace: Trace,
    policy_name: str,
    capacity_blocks: int,
    *,
    repeats: int = REPEATS_DEFAULT,
    lookup_hook: bool = True,
) -> tuple[SimResult, PolicyCost]:
    """Simulate ``policy_name`` on ``trace`` (the hit ratios) and measure its
    CPU cost by replaying the recorded calls (module doc)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    logs: list[CallLog] = []

    def record(inner: EvictionPolicy[int]) -> EvictionPolicy[int]:
        logs.append(CallLog(inner))
        return logs[-1]

    result = simulate(trace, policy_name, capacity_blocks, lookup_hook=lookup_hook, wrap=record)
    log = logs[0]
    recorded = [
        None if key == _NONE else key
        for op, key in zip(log.ops, log.second, strict=True)
        if op == _VICTIM
    ]
    cpu_s = wall_s = null_cpu_s = null_wall_s = float("inf")
    for _ in range(repeats):
        spent_cpu_s, spent_wall_s, chosen = _replay(make_policy(policy_name), log)
        if chosen != recorded:
            raise CostError(f"{policy_name}: the replayed calls chose other victims")
        cpu_s, wall_s = min(cpu_s, spent_cpu_s), min(wall_s, spent_wall_s)
        spent_cpu_s, spent_wall_s, _ = _replay(_NullPolicy(), log)
        null_cpu_s, null_wall_s = min(null_cpu_s, spent_cpu_s), min(null_wall_s, spent_wall_s)
    cost = PolicyCost(
        policy_name, trace.n_refs, len(trace), len(log.ops),
        max(0.0, cpu_s - null_cpu_s), max(0.0, wall_s - null_wall_s),
    )  # fmt: skip
    return result, cost
