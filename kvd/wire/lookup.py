"""The answer to a lookup, as the store gives it and the client returns it:
the daemon's store and pool router build it, ``kvd.client`` decodes the
``LookupResponse`` into it; and the share of a chain one pool member tells
another of. Imports nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_len: int
    l1_hits: int
    l2_hits: int
    lease_id: int
    lease_ms: int


@dataclass(frozen=True, slots=True)
class ChainShare:
    """A pool member's share of a chain another member looked up (an Exists
    from a peer): the keys sent are at ``positions`` (increasing) of a chain
    of ``length`` keys."""

    length: int
    positions: list[int]
