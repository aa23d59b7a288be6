"""NIXL reads gathered into batches (kvd.cluster.nixl_reads), without an
agent: the reads of one owner asked in one turn of the loop go as one batch
(a read alone is a batch of one), each caller gets its own key's outcome
(as soon as the batch reports it, before the batch ends), a caller
that gives up leaves the batch to the others, a failed batch fails each of
its reads, and a batch's values are cut into transfers of at most
SEGMENTS_MAX descriptors. The batches against real daemons and agents are
in test_peer_nixl.py."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kvd.cluster import nixl_node, nixl_reads
from kvd.cluster.nixl_reads import Gather, Outcome, Pinned, Report
from kvd.cluster.peer_bulk import BulkAnswer
from kvd.cluster.peers import PeerError
from kvd.store.index import PutTicket
from kvd.store.store import Store


class Owners:
    """What the gatherer ran: its batches, answered by key."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, str, list[bytes]]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail: BaseException | None = None

    async def run(
        self, member: str, ns: str, keys: list[bytes], timeout_s: float, report: Report
    ) -> list[Outcome]:
        self.batches.append((member, ns, keys))
        if keys[0] == b"early":  # known before the rest: its caller goes on
            report(0, "hit:early")
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return [PeerError("bad", "checksum") if k == b"bad" else "hit:" + k.decode() for k in keys]


def test_reads_of_one_turn_go_as_one_batch_per_owner() -> None:
    async def run() -> None:
        owners = Owners()
        gather = Gather(owners.run)
        got = await asyncio.gather(
            gather.read("a", "ns", b"k1", 1.0), gather.read("a", "ns", b"k2", 1.0),
            gather.read("b", "ns", b"k3", 1.0), gather.read("a", "other", b"k4", 1.0),
            gather.read("a", "ns", b"bad", 1.0), gather.read("a", "ns", b"k1", 1.0),
            return_exceptions=True,
        )  # fmt: skip
        assert got[:4] == ["hit:k1", "hit:k2", "hit:k3", "hit:k4"]
        assert isinstance(got[4], PeerError) and got[4].kind == "checksum"
        assert got[5] == "hit:k1"  # asked twice in the turn: read once
        assert sorted(owners.batches) == [
            ("a", "ns", [b"k1", b"k2", b"bad"]), ("a", "other", [b"k4"]), ("b", "ns", [b"k3"]),
        ]  # fmt: skip
        assert (gather.batches, gather.batched) == (1, 3)  # reads alone are not counted
        # A later turn is another batch.
        assert await gather.read("a", "ns", b"k5", 1.0) == "hit:k5"
        assert owners.batches[-1] == ("a", "ns", [b"k5"])

    asyncio.run(run())


def test_a_caller_that_gives_up_leaves_the_batch_to_the_others() -> None:
    async def run() -> None:
        owners = Owners()
        owners.release.clear()
        gather = Gather(owners.run)
        quick = asyncio.ensure_future(asyncio.wait_for(gather.read("a", "ns", b"k1", 0.01), 0.01))
        patient = asyncio.ensure_future(gather.read("a", "ns", b"k2", 5.0))
        with pytest.raises(TimeoutError):
            await quick
        owners.release.set()
        assert await patient == "hit:k2"
        await asyncio.sleep(0.01)
        assert not gather.tasks()

    asyncio.run(run())


def test_a_failed_batch_fails_each_of_its_reads() -> None:
    async def run() -> None:
        owners = Owners()
        owners.fail = PeerError("connection reset", "short")
        gather = Gather(owners.run)
        got = await asyncio.gather(
            *(gather.read("a", "ns", k, 1.0) for k in (b"k1", b"k2")), return_exceptions=True
        )
        assert all(isinstance(g, PeerError) and g.kind == "short" for g in got)

    asyncio.run(run())


class Ticket:
    """The part of a put's ticket a transfer reads: its local pages."""

    def __init__(self, *views: memoryview) -> None:
        self.views = list(views)


class Pages:
    """The store's part: pages given back."""

    def __init__(self) -> None:
        self.aborted: list[Any] = []

    def abort_put(self, ticket: Any) -> None:
        self.aborted.append(ticket)


def _value(key: bytes, runs: int, size: int = 4096) -> Pinned:
    """A value in ``runs`` local runs of pages apart, one run at its owner."""
    buffers = [memoryview(bytearray(size)) for _ in range(runs)]
    value = Pinned(key, BulkAnswer(runs * size, b"", 0), 1, [(1 << 30, runs * size)])
    value.ticket = cast(PutTicket, Ticket(*buffers))
    return value


def test_a_batch_is_cut_into_transfers_of_at_most_segments_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nixl_reads, "SEGMENTS_MAX", 4)
    monkeypatch.setattr(nixl_node, "SEGMENTS_MAX", 4)
    values = [_value(b"a", 2), _value(b"b", 2), _value(b"c", 5), _value(b"d", 3)]
    pages = Pages()
    outcomes: list[Outcome] = ["hit"] * len(values)
    groups = nixl_reads._transfers(cast(Store, pages), "m", list(enumerate(values)), outcomes)
    assert [[i for i, *_ in group] for group in groups] == [[0, 1], [3]]
    assert [sum(len(mine) for _, _, mine, _ in group) for group in groups] == [4, 3]
    # c needs five descriptors, more than a transfer takes: its pages go back.
    assert isinstance(outcomes[2], PeerError) and outcomes[2].kind == "transfer"
    assert pages.aborted == [values[2].ticket]


def test_an_outcome_reported_early_wakes_its_caller_before_the_batch_ends() -> None:
    async def run() -> None:
        owners = Owners()
        owners.release.clear()
        gather = Gather(owners.run)
        early = asyncio.ensure_future(gather.read("a", "ns", b"early", 1.0))
        late = asyncio.ensure_future(gather.read("a", "ns", b"late", 1.0))
        assert await asyncio.wait_for(early, 1.0) == "hit:early"
        assert not late.done()  # the batch goes on
        owners.release.set()
        assert await late == "hit:late"
        assert owners.batches == [("a", "ns", [b"early", b"late"])]

    asyncio.run(run())
