"""Tests for ``L2Tier.sync``'s group commit on real O_DIRECT files: callers
share an fdatasync, but never one that began before they asked (it may
not cover their writes); a failed sync fails its callers, none is told
its writes are durable when they may not be."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvd.io import faults
from kvd.io.backend import IoBackend, IoError
from kvd.l2.tier import L2Tier
from tests.l2 import Env, KiB, PassThrough, payload, put

TEST_TIMEOUT_S = 30.0


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    env = Env(tmp_path, "threads", paths=2, segments=4, segment_bytes=256 * KiB)
    yield env
    env.close_all()


class GatedSyncs(PassThrough):
    """An io backend that counts fsyncs and holds each at a gate while armed."""

    def __init__(self, inner: IoBackend) -> None:
        super().__init__(inner)
        self.fsyncs = 0
        self.armed = False
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def fsync(self, fd: int, *, data_only: bool = False) -> None:
        self.fsyncs += 1
        if self.armed:
            self.entered.set()
            await self.gate.wait()
        await self.inner.fsync(fd, data_only=data_only)


async def gated(env: Env) -> tuple[L2Tier, GatedSyncs]:
    made: list[GatedSyncs] = []
    tier = await env.open(lambda io: made.append(GatedSyncs(io)) or made[0])
    return tier, made[0]


async def test_callers_at_once_share_a_sync(env: Env) -> None:
    tier, io = await gated(env)
    await put(tier, b"k", payload(1000, 1))
    await asyncio.wait_for(asyncio.gather(*(tier.sync() for _ in range(16))), TEST_TIMEOUT_S)
    assert io.fsyncs == 2  # one fdatasync of each of the two paths
    assert tier.counters.syncs == 1


async def test_a_sync_that_began_before_the_ask_is_not_enough(env: Env) -> None:
    tier, io = await gated(env)
    io.armed = True
    first = asyncio.create_task(tier.sync())
    await asyncio.wait_for(io.entered.wait(), TEST_TIMEOUT_S)  # its fdatasync has begun
    await put(tier, b"late", payload(1000, 2))  # written after it began
    second = asyncio.create_task(tier.sync())
    third = asyncio.create_task(tier.sync())
    await asyncio.sleep(0.05)
    assert not second.done() and not third.done()
    io.armed = False
    io.gate.set()
    await asyncio.wait_for(first, TEST_TIMEOUT_S)
    await asyncio.sleep(0)
    assert not second.done(), "told durable by a sync that began before its ask"
    await asyncio.wait_for(asyncio.gather(second, third), TEST_TIMEOUT_S)
    assert io.fsyncs == 4  # two syncs of two paths: the second and third shared one
    assert tier.counters.syncs == 2


async def test_a_failed_sync_fails_its_callers(env: Env) -> None:
    tier = await env.open(lambda io: faults.wrap(io, "fsync:eio:nth=1"))
    await put(tier, b"k", payload(1000, 3))
    outcomes = await asyncio.wait_for(
        asyncio.gather(tier.sync(), tier.sync(), return_exceptions=True), TEST_TIMEOUT_S
    )
    # The first sync's fdatasync of one path failed: it raises; the caller
    # waiting behind it makes its own sync, which succeeds.
    assert isinstance(outcomes[0], IoError) and outcomes[0].errno == errno.EIO
    assert outcomes[1] is None
    assert tier.counters.syncs == 1
