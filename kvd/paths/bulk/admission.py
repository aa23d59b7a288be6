"""Who may hold a bulk TCP connection: caps in total, per peer address, and
on connections that have not yet sent their HELLO.

Before these caps, 256 idle connections (with or without HELLO) filled
``bulk_max_connections`` and locked every other client out of the port
for as long as they stayed (30 s without HELLO, 600 s after). Now:

- one peer address holds at most ``bulk_max_connections_per_peer``; more
  are refused;
- connections waiting for their HELLO are at most
  ``bulk_max_unauthenticated``, each for ``bulk_hello_timeout_ms``; a new
  one past the cap, or past ``bulk_max_connections`` while any waits,
  closes the oldest waiting one (an honest client's HELLO follows its
  connect by one round trip, ~0.1 ms on loopback, so it is never the
  oldest);
- a connection refused is answered RESOURCE_EXHAUSTED (best effort) and
  closed; ``kvd.client`` then makes that call over gRPC.

Plain bookkeeping on the event loop: no sockets, no grpc, no metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Slot:
    """One admitted connection; ``close`` ends it (a waiting one pushed out)."""

    host: str
    close: Callable[[], None]
    released: bool = False


class Admission:
    def __init__(self, max_connections: int, max_per_peer: int, max_unauthenticated: int) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_unauthenticated = max_unauthenticated
        self.count = 0
        self.per_peer: dict[str, int] = {}
        self.waiting: OrderedDict[Slot, None] = OrderedDict()  # no HELLO yet, oldest first
        self.pushed_out = 0  # waiting connections closed to admit newer ones

    def admit(self, host: str, close: Callable[[], None]) -> Slot | str:
        """A slot for a new connection from ``host``, or why it is refused."""
        if self.per_peer.get(host, 0) >= self.max_per_peer:
            return f"{self.max_per_peer} connections from {host} (bulk_max_connections_per_peer)"
        if self.count >= self.max_connections and not self.waiting:
            return f"{self.max_connections} connections (bulk_max_connections)"
        while self.waiting and (
            self.count >= self.max_connections or len(self.waiting) >= self.max_unauthenticated
        ):
            oldest = next(iter(self.waiting))
            self.release(oldest)
            self.pushed_out += 1
            oldest.close()
        slot = Slot(host, close)
        self.count += 1
        self.per_peer[host] = self.per_peer.get(host, 0) + 1
        self.waiting[slot] = None
        return slot

    def authenticated(self, slot: Slot) -> None:
        """Its HELLO was accepted: it no longer counts as waiting."""
        self.waiting.pop(slot, None)

    def release(self, slot: Slot) -> None:
        """The connection ended (idempotent)."""
        if slot.released:
            return
        slot.released = True
        self.waiting.pop(slot, None)
        self.count -= 1
        left = self.per_peer[slot.host] - 1
        if left:
            self.per_peer[slot.host] = left
        else:
            del self.per_peer[slot.host]
        assert self.count >= 0
