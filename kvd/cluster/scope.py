"""The call a pool operation serves: its deadline, and whether it came from
another member (a hop). Transports set it where a call enters (the gRPC
service from the deadline and metadata); the router reads it deep in the
store's get path without every layer passing it down.

A hop is answered from this daemon alone: a peer's request is never sent on,
so two members with different views of the pool cannot bounce a key between
them. Calls that enter without a deadline (bulk TCP, shared memory) are
bounded by ``pool_peer_timeout_ms`` alone.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Metadata a member adds to its calls to a peer.
HOP_HEADER = "kvd-pool-hop"

# Part of the caller's remaining time kept back for the local work after a
# peer answers (copy into L1, send back): 10 %, at least 2 ms.
RESERVE_FRACTION = 0.1
RESERVE_S_MIN = 0.002


@dataclass(frozen=True)
class Scope:
    deadline: float | None = None  # time.monotonic() by which the caller wants an answer
    hop: bool = False
    # A value a member leaving the pool handed on: this daemon's own,
    # whichever member its placement names (kvd.wire.bulk.FLAG_KEEP).
    kept: bool = False


_NONE = Scope()  # a call from no transport: no deadline, not a hop
_current: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "kvd_pool_scope", default=None
)


def current() -> Scope:
    return _current.get() or _NONE


def enter(
    metadata: Iterable[tuple[str, str | bytes]] | None, time_remaining_s: float | None
) -> contextvars.Token[Scope | None]:
    """Set the scope of a call that just arrived; ``leave`` with the token."""
    hop = any(name == HOP_HEADER for name, _ in metadata or ())
    deadline = None if time_remaining_s is None else time.monotonic() + time_remaining_s
    return _current.set(Scope(deadline, hop))


def leave(token: contextvars.Token[Scope | None]) -> None:
    _current.reset(token)


@contextmanager
def as_hop(kept: bool = False) -> Iterator[None]:
    """Run work that must stay on this daemon (storing a value a peer sent;
    ``kept``: as its own)."""
    token = _current.set(Scope(current().deadline, True, kept))
    try:
        yield
    finally:
        _current.reset(token)


def budget_s(limit_s: float) -> float:
    """Seconds a peer call may take now: ``limit_s``, or less to meet the deadline."""
    deadline = current().deadline
    if deadline is None:
        return limit_s
    left = deadline - time.monotonic()
    return max(0.0, min(limit_s, left - max(RESERVE_S_MIN, left * RESERVE_FRACTION)))
