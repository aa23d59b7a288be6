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
    of ``length`` keys. ``untold``: the lookups the asking member made since
    it last told this one of a chain, of which this one owned no key (at
    most ``UNTOLD_LOOKUPS_MAX``): its eviction policy's clock moves by them
    first."""

    length: int
    positions: list[int]
    untold: int = 0


# The most lookups one share may say were untold: an asking member stops
# counting there (a member no lookup reaches for that long has a clock far
# off anyway).
UNTOLD_LOOKUPS_MAX = 4096
