"""The answer to a lookup, as the store gives it and the client returns it:
the daemon's store and pool router build it, ``kvd.client`` decodes the
``LookupResponse`` into it. Imports nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_len: int
    l1_hits: int
    l2_hits: int
    lease_id: int
    lease_ms: int
