"""Uploads (kvd.store.uploads): a put whose bytes arrive in pieces holds pages for
what arrived, evicts only for that, and all uploads together stay under
uploads_max_bytes."""

from __future__ import annotations

import os

import pytest

from kvd.l1.pool import PAGE_BYTES
from kvd.store.index import PutTicket
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from kvd.wire.errors import ResourceExhausted
from tests.store.support import make_store, put, read, run


def _upload(store: Store, key: bytes, size: int) -> PutTicket:
    ticket = store.begin_upload("ns", key, size)
    assert isinstance(ticket, PutTicket)
    return ticket


def _feed(store: Store, ticket: PutTicket, data: bytes) -> None:
    pos = 0
    for view in run(store.grow_put(ticket, len(data))):
        view[:] = data[pos : pos + len(view)]
        pos += len(view)


def test_pages_follow_the_bytes_that_arrived() -> None:
    store, _ = make_store(pages=16)
    value = os.urandom(5 * PAGE_BYTES + 123)
    ticket = _upload(store, b"k", len(value))
    assert store.pool.free_pages == 16 and store.upload_bytes == 0
    for start in range(0, len(value), 40_000):  # pieces that straddle pages
        _feed(store, ticket, value[start : start + 40_000])
        assert store.upload_bytes == -(-ticket.covered_bytes // PAGE_BYTES) * PAGE_BYTES
    assert len(ticket.runs) == 1, "growths from one free run stay one run"
    store.publish_now(ticket, checksum(value))
    assert store.upload_bytes == 0
    assert read(store, b"k") == value


def test_a_stalled_upload_evicts_nothing_for_bytes_not_sent() -> None:
    store, _ = make_store(pages=8)
    for i in range(8):
        put(store, b"cached-%d" % i, b"v" * PAGE_BYTES)
    ticket = _upload(store, b"big", 8 * PAGE_BYTES)  # the whole pool, declared
    assert store.counters.evictions == 0
    _feed(store, ticket, b"x" * 100)  # one page arrived: one value goes
    assert store.counters.evictions == 1
    store.abort_put(ticket)
    assert store.upload_bytes == 0 and store.pool.free_pages == 1


def test_uploads_in_progress_are_capped_in_total() -> None:
    store, _ = make_store(pages=16, uploads_max_bytes=4 * PAGE_BYTES)
    first = _upload(store, b"a", 8 * PAGE_BYTES)
    _feed(store, first, b"a" * (3 * PAGE_BYTES))
    second = _upload(store, b"b", 8 * PAGE_BYTES)
    _feed(store, second, b"b" * PAGE_BYTES)
    with pytest.raises(ResourceExhausted, match="uploads_max_bytes"):
        run(store.grow_put(second, PAGE_BYTES))
    store.abort_put(second)
    # Alone, an upload may pass the cap: one value of any allowed size still fits.
    _feed(store, first, b"a" * (5 * PAGE_BYTES))
    store.publish_now(first, checksum(b"a" * (8 * PAGE_BYTES)))
    assert store.upload_bytes == 0


def test_an_empty_upload_gets_its_page() -> None:
    store, _ = make_store()
    ticket = _upload(store, b"e", 0)
    run(store.grow_put(ticket, 0))
    store.publish_now(ticket, checksum(b""))
    assert read(store, b"e") == b""
