"""What a member of a pool learns of the chains other members look up: its
share of a chain (``learn_chain``: the policy learns of the member's own
keys as if the lookup had been made here). It reaches the policy through
the store's ``DeferredPolicy``, in order with the store's own calls, and
comes from peers (kvd.cluster.router), never from an engine. Imports
neither grpc nor metrics."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

from kvd.l2 import L2Tier
from kvd.store.entries import Entries
from kvd.store.index import Entry, PolicyKey, StoreLimits, check_key, check_keys
from kvd.store.learning import DeferredPolicy
from kvd.wire.errors import InvalidArgument
from kvd.wire.lookup import UNTOLD_LOOKUPS_MAX


class ChainShares:
    """A member's learning from the other members of its pool: their
    lookups' shares of chains, and the histories of values handed to it."""

    def __init__(
        self,
        entries: Entries,
        learning: DeferredPolicy[Any],
        l2: L2Tier | None,
        limits: StoreLimits,
    ) -> None:
        self._entries = entries
        self._learning = learning
        self._l2 = l2
        self._limits = limits

    def learn_chain(
        self,
        ns_name: str,
        keys: Sequence[bytes],
        length: int,
        positions: Sequence[int],
        untold: int = 0,
    ) -> None:
        """A pool member's share of a chain another member looked up: ``keys``
        at ``positions`` (increasing) of a chain of ``length`` keys, after
        ``untold`` lookups of that member's that held none of this one's
        keys. The policy learns of them as if the lookups had been made here
        (the other positions are other members' keys:
        ``EvictionPolicy.on_lookup``'s ``mine``). Its hits are the chain's
        leading keys that are another member's or held here; nothing is
        leased."""
        check_keys(keys, self._limits.max_lookup_keys)
        if not 0 <= untold <= UNTOLD_LOOKUPS_MAX:
            raise InvalidArgument(
                f"a chain share after {untold} untold lookups, not 0..{UNTOLD_LOOKUPS_MAX}"
            )
        if not 0 < length <= self._limits.max_lookup_keys or len(positions) != len(keys):
            raise InvalidArgument(
                f"a chain share of {len(keys)} keys at {len(positions)} positions "
                f"of a chain of {length}"
            )
        # Increasing from >= 0 to < length: within the chain (C loops, not a generator).
        if positions and (
            positions[0] < 0
            or positions[-1] >= length
            or not all(map(operator.lt, positions, itertools.islice(positions, 1, None)))
        ):
            raise InvalidArgument("chain positions must increase and lie within the chain")
        ns = self._entries.namespace(ns_name)
        ns_id, held = ns.id, ns.entries
        # The policy's keys (``policy_keys``), made for this member's keys
        # alone: other members' keys stand in as one placeholder the policy
        # never keeps (a share is about a quarter of a chain in a pool of 4).
        chain: list[PolicyKey] = [(ns_id, b"")] * length
        mine = [False] * length
        touched: list[PolicyKey] = []
        hits = length
        for key, position in zip(keys, positions, strict=True):
            chain[position] = pk = (ns_id, key)
            mine[position] = True
            if hits < length:
                continue
            if key in held:
                touched.append(pk)
            elif self._l2 is None or self._l2.lookup(ns_name, key) is None:
                hits = position
        self._learning.defer_lookup(touched, chain, hits, None, mine, untold)

    def history(self, entry: Entry) -> bytes | None:
        """What the policy knows of ``entry``'s references, for the member
        it is handed to (``EvictionPolicy.history``); None: nothing."""
        return self._learning.history((entry.ns.id, entry.key))

    def expect(self, ns_name: str, key: bytes, history: bytes) -> bool:
        """The next put of ``key`` is a value another member handed on, with
        its ``history`` there (``EvictionPolicy.expect``); False where the
        policy takes none of it."""
        check_key(key)
        return self._learning.expect((self._entries.namespace(ns_name).id, key), history)
