"""L1 pool: run allocation, bounds, views and coalescing."""

from __future__ import annotations

import random

import pytest

from kvd.l1.pool import PAGE_BYTES, Pool, PoolFull, ViewWriter, chunked, pages_for


def test_capacity_is_whole_pages() -> None:
    pool = Pool(10 * PAGE_BYTES + 123)
    assert pool.page_count == 10
    assert pool.capacity_bytes == 10 * PAGE_BYTES
    assert pool.free_bytes == pool.capacity_bytes and pool.used_bytes == 0


def test_pool_smaller_than_a_page_is_refused() -> None:
    with pytest.raises(ValueError, match="no 64 KiB page"):
        Pool(PAGE_BYTES - 1)


def test_pages_for() -> None:
    assert pages_for(0) == 1
    assert pages_for(1) == 1
    assert pages_for(PAGE_BYTES) == 1
    assert pages_for(PAGE_BYTES + 1) == 2


def test_alloc_free_round_trip_and_full() -> None:
    pool = Pool(8 * PAGE_BYTES)
    a = pool.alloc(3 * PAGE_BYTES)
    b = pool.alloc(5 * PAGE_BYTES - 7)
    assert pool.free_pages == 0
    with pytest.raises(PoolFull):
        pool.alloc(1)
    assert pool.free_pages == 0  # a failed alloc takes nothing
    pool.free(a)
    assert pool.free_pages == 3
    pool.free(b)
    assert pool.free_pages == 8


def test_views_cover_exactly_the_value_and_do_not_overlap() -> None:
    pool = Pool(16 * PAGE_BYTES)
    rng = random.Random(1)
    held = []
    for size in (1, PAGE_BYTES, 3 * PAGE_BYTES + 5, 2 * PAGE_BYTES - 1):
        runs = pool.alloc(size)
        views = pool.views(runs, size)
        assert sum(len(v) for v in views) == size
        data = rng.randbytes(size)
        writer = ViewWriter(views)
        writer.write(data)
        assert writer.written == size
        held.append((runs, size, data))
    for runs, size, data in held:
        assert b"".join(pool.views(runs, size)) == data


def test_random_alloc_free_never_loses_or_overlaps_pages() -> None:
    pool = Pool(64 * PAGE_BYTES)
    rng = random.Random(7)
    live: list[list[tuple[int, int]]] = []
    for _ in range(5000):
        if live and (rng.random() < 0.5 or pool.free_pages < 8):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.alloc(rng.randrange(1, 8 * PAGE_BYTES)))
        owned = [page for runs in live for first, n in runs for page in range(first, first + n)]
        assert len(owned) == len(set(owned))
        assert len(owned) + pool.free_pages == pool.page_count
    for runs in live:
        pool.free(runs)
    assert pool.free_pages == pool.page_count


def test_coalescing_rebuilds_large_runs() -> None:
    pool = Pool(5000 * PAGE_BYTES)
    singles = [pool.alloc(1) for _ in range(5000)]
    for runs in singles:  # 5000 one-page runs: past the coalescing threshold
        pool.free(runs)
    runs = pool.alloc(5000 * PAGE_BYTES)
    assert len(runs) <= 2


def test_double_free_is_caught() -> None:
    pool = Pool(4 * PAGE_BYTES)
    runs = pool.alloc(4 * PAGE_BYTES)
    pool.free(runs)
    with pytest.raises(AssertionError):
        pool.free(runs)


def test_chunked_groups_views() -> None:
    pool = Pool(8 * PAGE_BYTES)
    size = 5 * PAGE_BYTES + 100
    views = pool.views(pool.alloc(size), size)
    pieces = chunked(views, 2 * PAGE_BYTES)
    assert [sum(len(v) for v in piece) for piece in pieces] == [
        2 * PAGE_BYTES,
        2 * PAGE_BYTES,
        PAGE_BYTES + 100,
    ]


def test_a_large_value_takes_one_run_where_one_holds_it() -> None:
    """After 2,048 one-page values were freed, a 4 MiB value takes one run
    of 64 pages (it took 64 one-page runs with one stack for all sizes),
    and a one-page value reuses a freed page, not a piece of the large run."""
    pool = Pool(4096 * PAGE_BYTES)
    singles = [pool.alloc(PAGE_BYTES) for _ in range(2048)]
    for runs in singles:
        pool.free(runs)
    big = [pool.alloc(64 * PAGE_BYTES) for _ in range(16)]
    assert all(len(runs) == 1 and runs[0][1] == 64 for runs in big)
    freed = {runs[0][0] for runs in singles}
    small = pool.alloc(PAGE_BYTES)
    assert small[0][0] in freed  # a freed page, on top of its class
    assert pool.free_pages == 4096 - 16 * 64 - 1


def test_a_value_no_run_holds_is_gathered_largest_runs_first() -> None:
    """In a fragmented pool a value takes the largest free runs first, and
    every page is accounted for."""
    pool = Pool(64 * PAGE_BYTES)
    one, two, four = (pool.alloc(n * PAGE_BYTES) for n in (1, 2, 4))
    rest = pool.alloc(57 * PAGE_BYTES)
    for runs in (one, two, four):
        pool.free(runs)
    runs = pool.alloc(6 * PAGE_BYTES)  # no free run holds 6 pages
    assert runs == [four[0], two[0]]
    assert pool.free_pages == 1
    pool.free(runs)
    pool.free(rest)
    assert pool.free_pages == 64
    assert sum(count for _, count in pool.alloc(64 * PAGE_BYTES)) == 64
