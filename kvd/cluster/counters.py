"""The pool router's counters: plain integers the metrics collector reads at
scrape time (``kvd.cluster.node``'s ``POOL_COUNTERS`` names and explains each),
kept apart from the router, which only adds to them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolCounters:
    """Plain integers the metrics collector reads at scrape time."""

    remote_lookups: int = 0  # lookups and exists that asked at least one peer
    remote_lookup_hits: int = 0  # chain keys found on a peer
    hinted_lookups: int = 0  # lookups the owners' recent answers settled (none asked)
    shares_learned: int = 0  # other members' lookups this member learned its share of
    remote_gets: int = 0
    remote_get_batches: int = 0  # batches whose missing values were read together
    remote_hits: int = 0
    remote_misses: int = 0
    remote_not_kept: int = 0
    peer_errors: int = 0  # failed or timed-out peer calls (each a miss)
    peer_skips: int = 0  # calls not made: the member failed within PEER_DOWN_S
    checksum_mismatches: int = 0  # peer values whose bytes failed their checksum
    forwards: int = 0
    forward_errors: int = 0
    forwards_dropped: int = 0
    tells_dropped: int = 0  # lookups an owner was not told of (kvd.cluster.tells)
    prefetched: int = 0  # values leased lookups started fetching (kvd.cluster.prefetch)
    prefetches_dropped: int = 0  # leased lookups whose values were not fetched: too many ran
    plans_adopted: int = 0  # the plan holder's eviction plans this member keeps blocks by
    plans_refused: int = 0  # plans of another policy or member size (it plans for itself)
    rebalanced: int = 0  # values handed to their new owner after the members changed
    rebalanced_from_l2: int = 0  # of them, values read from L2 to be handed on
    rebalance_adopted: int = 0  # copies whose key this member owns since, kept as its own
    histories_taken: int = 0  # handed-on values' histories this member's policy took
