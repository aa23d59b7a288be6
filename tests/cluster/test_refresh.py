"""The background asks that keep a looked-up chain's hints fresh
(kvd.cluster.refresh): at most one per chain per period, each owner asked
about its keys past the local prefix, and bounded in chains remembered and
asks running."""

from __future__ import annotations

import asyncio

import pytest

from kvd.cluster import refresh as refresh_module
from kvd.cluster.refresh import Refresh

KEYS = [b"k%d" % i for i in range(6)]
SHARES = {"b": [0, 2, 4], "c": [1, 3, 5]}


class Owners:
    """The owners' side of the asks: what each was asked, answered after ``release``."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, list[bytes]]] = []
        self.release = asyncio.Event()

    async def ask(self, owner: str, namespace: str, keys: list[bytes], timeout_s: float) -> None:
        self.asked.append((owner, namespace, keys))
        await self.release.wait()


async def _settle(refresh: Refresh) -> None:
    await asyncio.gather(*refresh.tasks())


def test_a_chain_is_refreshed_once_a_period_past_its_local_prefix() -> None:
    async def run() -> None:
        owners = Owners()
        owners.release.set()
        refresh = Refresh(0.05, owners.ask)
        assert refresh.chain("ns", KEYS, SHARES, 2, 1.0)
        await _settle(refresh)
        assert sorted(owners.asked) == [("b", "ns", [b"k2", b"k4"]), ("c", "ns", [b"k3", b"k5"])]
        assert not refresh.chain("ns", KEYS, SHARES, 2, 1.0)  # within the period
        assert refresh.chain("other", KEYS, SHARES, 2, 1.0)  # another namespace's chain
        await asyncio.sleep(0.06)
        assert refresh.chain("ns", KEYS, SHARES, 5, 1.0)  # due again
        await _settle(refresh)
        assert owners.asked[-1] == ("c", "ns", [b"k5"])  # b holds nothing past the prefix
        assert refresh.started == 3 and refresh.skipped == 0

    asyncio.run(run())


def test_refreshes_are_bounded_in_flight_and_in_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refresh_module, "IN_FLIGHT_MAX", 2)
    monkeypatch.setattr(refresh_module, "CHAINS_MAX", 8)

    async def run() -> None:
        owners = Owners()
        refresh = Refresh(60.0, owners.ask)
        assert refresh.chain("ns", [b"a"], {"b": [0]}, 0, 1.0)
        assert refresh.chain("ns", [b"b"], {"b": [0]}, 0, 1.0)
        await asyncio.sleep(0)
        assert not refresh.chain("ns", [b"c"], {"b": [0]}, 0, 1.0)  # two running
        assert refresh.skipped == 1 and len(refresh.tasks()) == 2
        owners.release.set()
        await _settle(refresh)
        for i in range(20):  # past CHAINS_MAX the older half is forgotten
            assert refresh.chain("ns", [b"x%d" % i], {"b": [0]}, 0, 1.0)
            await _settle(refresh)
        assert len(refresh._last) <= 8
        assert not refresh.chain("ns", [b"x19"], {"b": [0]}, 0, 1.0)  # the newest kept
        refresh.clear()
        assert refresh.chain("ns", [b"x19"], {"b": [0]}, 0, 1.0)
        await _settle(refresh)

    asyncio.run(run())
