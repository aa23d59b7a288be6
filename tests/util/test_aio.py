"""kvd.util.aio.settle: work that runs on the caller's memory ends before the caller
returns, however many times the caller is cancelled meanwhile."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from kvd.util.aio import settle


async def test_waits_through_repeated_cancels_then_re_raises() -> None:
    loop = asyncio.get_running_loop()
    work: asyncio.Future[int] = loop.create_future()
    ended_at: list[bool] = []

    async def waiter() -> None:
        try:
            await settle([work])
        finally:
            ended_at.append(work.done())

    task = asyncio.create_task(waiter())
    for _ in range(3):  # e.g. a deadline, then the daemon stopping
        await asyncio.sleep(0)
        task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # still waiting for the work
    work.set_result(7)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended_at == [True] and work.result() == 7


async def test_returns_when_all_done_and_leaves_errors_to_the_caller() -> None:
    loop = asyncio.get_running_loop()
    unread: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    ok: asyncio.Future[int] = loop.create_future()
    bad: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, ok.set_result, 1)
    loop.call_later(0.02, bad.set_exception, OSError("broken"))
    await settle([ok, bad])  # raises nothing itself
    assert ok.result() == 1
    with pytest.raises(OSError):
        bad.result()
    dropped: asyncio.Future[int] = loop.create_future()
    loop.call_soon(dropped.set_exception, OSError("nobody reads this"))
    await settle([dropped])
    del dropped, bad
    gc.collect()
    assert unread == []  # no "exception was never retrieved"
    loop.set_exception_handler(None)


async def test_nothing_to_wait_for() -> None:
    await settle([])
