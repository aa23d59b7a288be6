"""Puts whose bytes are still arriving: pages are reserved as the bytes come.

A transport that streams a value in (a bulk TCP PUT frame, a gRPC Put
stream) opens an *upload* ticket with ``begin_upload``: it is validated
like any put but holds no page yet. Each time bytes arrive, ``grow_put``
reserves the pages for exactly those bytes (evicting for them if it must)
and returns their views to receive into. So a sender that declares 64 MiB
and stalls holds the pages of what it sent, never of what it declared, and
cached values are never evicted for bytes that have not arrived: before
this, 40 such senders with 4 KiB each emptied a 128 MiB pool in under 2 s.

All uploads in progress together hold at most ``uploads_max_bytes`` of
pages; a growth past it is RESOURCE_EXHAUSTED for that put (its transport
drops the rest of its bytes and answers the code), unless the put is the
only one holding pages, so one value of any allowed size still fits.

The store opens the ticket (``Store.begin_upload``, checked like any put)
and waits for room; this module keeps the count and grows tickets, making
room through the callables it is given (the L1 index's). Imports neither
grpc nor metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from kvd.l1.pool import PAGE_BYTES, Pool, Run, pages_for
from kvd.store.index import PutTicket
from kvd.wire.errors import ResourceExhausted


class Uploads:
    def __init__(
        self,
        pool: Pool,
        uploads_max_bytes: int,
        quota_room: Callable[[str, int], bool],
        alloc_now: Callable[[int], list[Run] | None],
    ) -> None:
        self.pool = pool
        self.uploads_max_bytes = uploads_max_bytes  # 0: no cap
        self._quota_room = quota_room
        self._alloc_now = alloc_now
        # Pool bytes held by upload tickets not yet published or aborted.
        self.held_bytes = 0

    def grow_now(self, ticket: PutTicket, nbytes: int) -> list[memoryview] | None:
        """Views of the ticket's pages for its next ``nbytes`` (bytes that have
        arrived); None where room needs write-back first. A zero-byte value's
        one page comes with ``nbytes`` 0."""
        assert ticket.upload and not ticket.done, "grow of a finished or whole-value ticket"
        start = ticket.covered_bytes
        end = start + nbytes
        assert end <= ticket.size, "bytes past the declared size"
        held = _pages(ticket.runs)
        need = pages_for(end) - held
        if need > 0:
            cap = self.uploads_max_bytes
            more = need * PAGE_BYTES
            others = self.held_bytes - held * PAGE_BYTES
            if cap and others > 0 and self.held_bytes + more > cap:
                raise ResourceExhausted(
                    f"uploads in progress hold {self.held_bytes} bytes of pages, "
                    f"{more} more would pass uploads_max_bytes={cap}"
                )
            if not self._quota_room(ticket.ns_name, end):
                return None
            runs = self._alloc_now(more)
            if runs is None:
                return None
            _append_runs(ticket.runs, runs)
            self.held_bytes += more
        views = self.pool.views_between(ticket.runs, start, end)
        ticket.views.extend(views)
        ticket.covered_bytes = end
        return views

    def ended(self, ticket: PutTicket) -> None:
        """A ticket was published or aborted: its pages no longer count as an upload's."""
        if ticket.upload:
            assert ticket.done
            self.held_bytes -= _pages(ticket.runs) * PAGE_BYTES
            assert self.held_bytes >= 0, "upload bytes released twice"


def _pages(runs: list[Run]) -> int:
    return sum(count for _, count in runs)


def _append_runs(runs: list[Run], more: list[Run]) -> None:
    """Add ``more`` to ``runs``, merging a run that continues the last one
    (growths taken from one free run are adjacent: a value keeps few runs)."""
    for first, count in more:
        if runs and runs[-1][0] + runs[-1][1] == first:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            runs.append((first, count))
