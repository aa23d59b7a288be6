"""The queue of lookups told to owners (kvd.cluster.tells), over a transport
played by this test: lookups queued while a frame is on its way go together,
in order, a namespace a frame; a full queue drops and counts; an owner whose
call fails loses its queue (counted) and is reported; an owner without
PEER_TELL is asked once per lookup instead."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvd.cluster import tells as tells_module
from kvd.cluster.peers import PeerError
from kvd.cluster.tells import Tells
from kvd.wire.lookup import ChainShare


class Transport:
    """``PeerReads.tell`` as a member's bulk port would take it: each frame
    recorded; ``gate`` holds frames back until set; ``takes`` False plays an
    owner without PEER_TELL; ``fails`` one whose calls fail."""

    def __init__(self, takes: bool = True, fails: bool = False) -> None:
        self.frames: list[tuple[str, str, list[tuple[list[bytes], ChainShare]]]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.takes, self.fails = takes, fails

    async def tell(self, member: str, namespace: str, shares: Any, timeout_s: float) -> bool:
        await self.gate.wait()
        if self.fails:
            raise PeerError(f"{member}: connection refused", "unreachable")
        if self.takes:
            self.frames.append((member, namespace, list(shares)))
        return self.takes


def share(i: int) -> tuple[list[bytes], ChainShare]:
    return [b"key-%d" % i], ChainShare(10, [i % 10])


def test_lookups_queued_meanwhile_go_in_one_frame_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tells_module, "TELL_GAP_S", 0.0)

    async def run() -> Transport:
        transport = Transport()
        tells = Tells(transport, _never_asked, _never_failed, 1.0, 1000)  # type: ignore[arg-type]
        transport.gate.clear()
        tells.tell("m1", "ns", *share(0))  # its frame waits at the gate
        await asyncio.sleep(0)
        for i in range(1, 5):
            tells.tell("m1", "ns", *share(i))
        tells.tell("m1", "other", *share(5))
        transport.gate.set()
        await asyncio.gather(*tells.tasks())
        assert tells.dropped == 0
        return transport

    frames = asyncio.run(run()).frames
    assert [(ns, [s[0] for s in shares]) for _, ns, shares in frames] == [
        ("ns", [[b"key-0"]]),
        ("ns", [[b"key-%d" % i] for i in range(1, 5)]),
        ("other", [[b"key-5"]]),
    ]


def test_a_full_queue_drops_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tells_module, "TELLS_MAX", 8)

    async def run() -> int:
        transport = Transport()
        transport.gate.clear()
        tells = Tells(transport, _never_asked, _never_failed, 1.0, 1000)  # type: ignore[arg-type]
        taken = [tells.tell("m1", "ns", *share(i)) for i in range(12)]
        assert taken == [True] * 8 + [False] * 4
        dropped = tells.dropped
        transport.gate.set()
        await asyncio.gather(*tells.tasks())
        assert sum(len(shares) for _, _, shares in transport.frames) == 8
        return dropped

    assert asyncio.run(run()) == 4


def test_a_failing_owner_loses_its_queue_and_is_reported() -> None:
    failed: list[str] = []

    async def run() -> int:
        transport = Transport(fails=True)
        transport.gate.clear()
        tells = Tells(transport, _never_asked, lambda error, member: failed.append(member),  # type: ignore[arg-type]
                      1.0, 1000)  # fmt: skip
        for i in range(5):
            tells.tell("m1", "ns", *share(i))
        transport.gate.set()
        await asyncio.gather(*tells.tasks())
        return tells.dropped

    assert asyncio.run(run()) == 5
    assert failed == ["m1"]


def test_an_owner_without_peer_tell_is_asked_once_per_lookup() -> None:
    asked: list[tuple[str, list[bytes], ChainShare]] = []

    async def ask(
        member: str, ns: str, keys: list[bytes], timeout_s: float, chain: ChainShare
    ) -> list[bool]:
        asked.append((member, keys, chain))
        return [True] * len(keys)

    async def run() -> None:
        tells = Tells(Transport(takes=False), ask, _never_failed, 1.0, 1000)  # type: ignore[arg-type]
        for i in range(3):
            tells.tell("m2", "ns", *share(i))
        await asyncio.gather(*tells.tasks())

    asyncio.run(run())
    assert asked == [("m2", *share(i)) for i in range(3)]


async def _never_asked(*args: Any) -> list[bool]:
    raise AssertionError("an owner that takes PEER_TELL was asked")


def _never_failed(error: PeerError, member: str) -> None:
    raise AssertionError(f"{member} failed: {error}")
