"""What the eviction policy learns from a lookup, told to it after the lookup answered.

A lookup sits on the engine's scheduler path (vLLM asks it from
``get_num_new_matched_tokens``, once per waiting request and step), so its
answer is worth more than the bookkeeping behind it. Its hits must be found
and pinned before it answers; what the policy learns from it (a ``touch``
per hit and ``on_lookup`` of the chain) only has to reach the policy before
the policy is next asked anything. For ``density`` that learning was
~1.1 ms of a 1,000-key lookup's 1.8 ms in the store on the development VM.

``DeferredPolicy`` stands in front of the policy: a lookup queues its calls
(``defer_lookup``), and every other call first runs the queue (``settle``),
so the policy sees exactly the calls, in exactly the order, it would have
seen had the lookup made them itself: what it evicts is the same, call for
call (the replay tests compare the daemon with the simulator). The daemon
hands ``schedule`` its loop's ``call_soon``: the queue then runs as soon as
the loop is free, after the answer went out. The queue is bounded: past
``PENDING_KEYS_MAX`` keys it runs at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any, Generic

from kvd.store.eviction.chains import K
from kvd.store.eviction.policy import EvictionPolicy

# Keys queued before the queue runs in line: 16 lookups of the largest
# chain the default max_lookup_keys allows, ~2 MB of key tuples.
PENDING_KEYS_MAX = 65_536

Schedule = Callable[[Callable[[], None]], Any]
_Lookup = tuple[list[Any], list[Any], int, int | None, Sequence[bool] | None, int]


def policy_keys(ns_id: int, keys: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """The keys of values in the eviction policy: each is its namespace's id
    and its key (``kvd.store.entries`` makes the same tuples). Made in C (a
    zip): 35 us for 1,000 keys, against 84 us for a Python call per key."""
    return list(zip(repeat(ns_id), keys))


class DeferredPolicy(Generic[K]):
    """``policy``, with a lookup's calls run after its answer (``schedule``)."""

    def __init__(self, policy: EvictionPolicy[K], schedule: Schedule | None = None) -> None:
        self.policy = policy
        self.name = policy.name
        self.schedule = schedule
        # Each lookup's (touched, chain, hits, ns_id, mine, untold).
        self._pending: list[_Lookup] = []
        self._pending_keys = 0

    def defer_lookup(
        self,
        touched: list[K],
        chain: list[K],
        hits: int,
        ns_id: int | None = None,
        mine: Sequence[bool] | None = None,
        untold: int = 0,
    ) -> None:
        """A lookup's calls: ``untold`` lookups of none of this member's keys
        first (``on_lookup`` of an empty chain each: a pool member's clock
        moves with the pool's lookups), then ``touch`` of each of
        ``touched``, then ``on_lookup(chain, hits, mine)``; with ``ns_id``,
        the policy's keys are ``policy_keys(ns_id, ...)`` of the keys given,
        made only when the calls are told."""
        first = not self._pending
        self._pending.append((touched, chain, hits, ns_id, mine, untold))
        self._pending_keys += len(touched) + len(chain) + untold
        if self._pending_keys > PENDING_KEYS_MAX:
            self.settle()
        elif first and self.schedule is not None:
            self.schedule(self.settle)

    def settle(self) -> None:
        """Tell the policy every queued call, in order."""
        if not self._pending:
            return
        pending, self._pending, self._pending_keys = self._pending, [], 0
        policy = self.policy
        for touched, chain, hits, ns_id, mine, untold in pending:
            for _ in range(untold):
                policy.on_lookup([], 0, [])
            if ns_id is not None:
                # A lookup's hits are mostly its chain's first keys: their
                # policy keys are made once.
                n = len(touched)
                leading = touched == chain[:n]
                chain = policy_keys(ns_id, chain)
                touched = chain[:n] if leading else policy_keys(ns_id, touched)
            policy.touch_many(touched)
            policy.on_lookup(chain, hits, mine)

    # The policy's calls (EvictionPolicy), each after the queued ones.
    def insert(self, key: K, parent: K | None) -> None:
        self.settle()
        self.policy.insert(key, parent)

    def touch(self, key: K) -> None:
        self.settle()
        self.policy.touch(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        self.settle()
        self.policy.touch_many(keys)

    def remove(self, key: K) -> None:
        self.settle()
        self.policy.remove(key)

    def victim(self, skip: Callable[[K], int]) -> K | None:
        self.settle()
        return self.policy.victim(skip)

    def unpark(self, key: K) -> None:
        self.policy.unpark(key)  # nothing queued changes what a search parked

    def unpark_all(self) -> None:
        self.policy.unpark_all()

    def on_lookup(self, keys: Sequence[K], hits: int, mine: Sequence[bool] | None = None) -> None:
        self.settle()
        self.policy.on_lookup(keys, hits, mine)

    def shared_plan(self) -> bytes | None:
        self.settle()
        return self.policy.shared_plan()

    def adopt_plan(self, plan: bytes) -> bool:
        self.settle()
        return self.policy.adopt_plan(plan)

    def history(self, key: K) -> bytes | None:
        self.settle()
        return self.policy.history(key)

    def expect(self, key: K, history: bytes) -> bool:
        self.settle()
        return self.policy.expect(key, history)

    def __len__(self) -> int:
        self.settle()
        return len(self.policy)
