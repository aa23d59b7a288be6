"""What a read of a value from its owner ended in (kvd.cluster.peer_reads,
kvd.cluster.nixl_reads); a failure is a ``PeerError`` instead."""

from __future__ import annotations

import logging

from kvd.wire.errors import KvdError

log = logging.getLogger("kvd.cluster")

HIT = "hit"  # the value is now in local L1
MISS = "miss"  # the owner does not hold it
NOT_KEPT = "not_kept"  # the owner sent it, this daemon could not keep it (L1 full, a conflict)


def not_kept(member: str, error: KvdError) -> str:
    """``NOT_KEPT``, logged with why."""
    log.info("peer value not kept in L1", extra={"peer": member, "error": str(error)})
    return NOT_KEPT
