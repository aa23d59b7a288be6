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

A mixin of ``kvd.store.store.Store``, like ``kvd.store.placement``. Imports neither grpc
nor metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.l1.pool import PAGE_BYTES, Pool, Run, pages_for
from kvd.store.index import PutResult, PutTicket, StoreLimits
from kvd.wire.errors import ResourceExhausted


class Uploads:
    pool: Pool
    limits: StoreLimits
    # Pool bytes held by upload tickets not yet published or aborted.
    upload_bytes: int = 0

    if TYPE_CHECKING:  # defined by Store

        def _check_put(
            self,
            ns_name: str,
            key: bytes,
            size: int,
            meta: bytes,
            parent: bytes | None,
            checksum: int | None,
        ) -> PutResult | None: ...
        def _l1_quota_room(self, ns_name: str, size: int) -> bool: ...
        def _alloc_now(self, size: int) -> list[Run] | None: ...
        async def _write_back_progress(self, size: int, ns_name: str = "") -> None: ...

    def begin_upload(
        self,
        ns_name: str,
        key: bytes,
        size: int,
        meta: bytes = b"",
        parent: bytes | None = None,
        checksum: int | None = None,
    ) -> PutTicket | PutResult:
        """A put whose bytes are yet to arrive: checked, holding no page yet
        (``grow_put`` adds them), or the answer when the key holds these bytes."""
        existed = self._check_put(ns_name, key, size, meta, parent, checksum)
        if existed is not None:
            return existed
        return PutTicket(ns_name, key, size, meta, parent or None, checksum, [], [], upload=True)

    def grow_put_now(self, ticket: PutTicket, nbytes: int) -> list[memoryview] | None:
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
            cap = self.limits.uploads_max_bytes
            more = need * PAGE_BYTES
            others = self.upload_bytes - held * PAGE_BYTES
            if cap and others > 0 and self.upload_bytes + more > cap:
                raise ResourceExhausted(
                    f"uploads in progress hold {self.upload_bytes} bytes of pages, "
                    f"{more} more would pass uploads_max_bytes={cap}"
                )
            if not self._l1_quota_room(ticket.ns_name, end):
                return None
            runs = self._alloc_now(more)
            if runs is None:
                return None
            _append_runs(ticket.runs, runs)
            self.upload_bytes += more
        views = self.pool.views_between(ticket.runs, start, end)
        ticket.views.extend(views)
        ticket.covered_bytes = end
        return views

    async def grow_put(self, ticket: PutTicket, nbytes: int) -> list[memoryview]:
        """``grow_put_now``, waiting for write-back to make room; ResourceExhausted
        when it cannot."""
        while (views := self.grow_put_now(ticket, nbytes)) is None:
            await self._write_back_progress(nbytes, ticket.ns_name)
        return views

    def _upload_ended(self, ticket: PutTicket) -> None:
        """A ticket was published or aborted: its pages no longer count as an upload's."""
        if ticket.upload:
            assert ticket.done
            self.upload_bytes -= _pages(ticket.runs) * PAGE_BYTES
            assert self.upload_bytes >= 0, "upload bytes released twice"


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
