"""A member's values read over NIXL together: the reads asked of one owner
in the same turn of the event loop (a batched get fetching a chain's
missing values: kvd.cluster.router's ``fetch_many``) become one batch.

Read one by one, each value cost a NIXL_PIN round trip on its own bulk
connection, a READ of its own polled to its end, and a NIXL_RELEASE round
trip. A batch sends its NIXL_PIN frames back to back on one connection and
reads their answers in order, READs every pinned value in one transfer
(their descriptors side by side, at most ``SEGMENTS_MAX``; more go in
further transfers, one after the other), checks and publishes each value,
and releases the pins in one more round trip. On RDMA NICs that is one
doorbell and one completion for the chain instead of one per value.

Each value keeps its own outcome: a value the owner lacks is a miss, one
whose bytes fail their checksum a ``checksum`` peer error, one this daemon
cannot keep ``NOT_KEPT``; a failed transfer or connection fails every value
of the batch still unpublished, as it failed the one read before. A caller
that gives up (its timeout) leaves the batch to finish for the others; the
batch is bounded by the longest of its callers' timeouts. Pages reserved
for a value go back on any failure, once the transfer that writes into
them has stopped (``NixlNode.read``'s ``give_back``).

A read alone in its turn is a batch of one. ``Gather`` serves the bulk
transport's batches too (``kvd.cluster.peer_reads``); a batch may report a
value's outcome as soon as it is known (``report``), and its caller goes on
while the others are read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvd.cluster import scope
from kvd.cluster.nixl_node import SEGMENTS_MAX, NixlError, NixlNode, pair_segments, segments
from kvd.cluster.outcomes import HIT, not_kept
from kvd.cluster.peer_bulk import BulkAnswer
from kvd.cluster.peers import PeerError
from kvd.store.index import PutResult, PutTicket
from kvd.store.store import Store
from kvd.wire.checksum import checksum_views
from kvd.wire.errors import DataLoss, KvdError

# Reads gathered into one batch at most: a connection holds at most 64 pins
# (kvd.paths.bulk.peer_ops.PINS_MAX), and a batched get has 32 in flight.
BATCH_MAX = 32

Outcome = str | BaseException
# report(i, outcome): key i's outcome, known before the batch ends (its caller wakes)
Report = Callable[[int, Outcome], None]
# run(member, namespace, keys, timeout_s, report) -> each key's outcome, in order
RunFn = Callable[[str, str, list[bytes], float, Report], Awaitable[list[Outcome]]]
# landed(namespace, key): a value just published in L1 from its owner
Landed = Callable[[str, bytes], None]


@dataclass
class _Waiting:
    """The reads asked of one owner and namespace this turn."""

    keys: list[bytes] = field(default_factory=list)
    futures: list[asyncio.Future[str]] = field(default_factory=list)
    timeout_s: float = 0.0


class Gather:
    """Reads asked in one turn of the loop, run as one batch per owner."""

    def __init__(self, run: RunFn) -> None:
        self._run = run
        self._waiting: dict[tuple[str, str], _Waiting] = {}
        self._batches: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches of two or more reads run
        self.batched = 0  # reads in them

    async def read(self, member: str, namespace: str, key: bytes, timeout_s: float) -> str:
        """``key``'s value from ``member`` into L1: ``HIT``, ``MISS`` or
        ``NOT_KEPT``; a failure raises as the read alone would."""
        loop = asyncio.get_running_loop()
        name = (member, namespace)
        waiting = self._waiting.get(name)
        if waiting is None:
            waiting = self._waiting[name] = _Waiting()
            loop.call_soon(self._start, name)
        waiting.timeout_s = max(waiting.timeout_s, timeout_s)
        if key in waiting.keys:  # asked twice this turn: one read
            return await asyncio.shield(waiting.futures[waiting.keys.index(key)])
        future: asyncio.Future[str] = loop.create_future()
        waiting.keys.append(key)
        waiting.futures.append(future)
        if len(waiting.keys) >= BATCH_MAX:
            self._start(name)
        return await future

    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._batches)

    def _start(self, name: tuple[str, str]) -> None:
        waiting = self._waiting.pop(name, None)
        if waiting is None:  # started when it filled up
            return
        task = asyncio.get_running_loop().create_task(self._serve(name, waiting))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _serve(self, name: tuple[str, str], waiting: _Waiting) -> None:
        member, namespace = name
        outcomes: list[Outcome]

        def report(i: int, outcome: Outcome) -> None:
            future = waiting.futures[i]
            if future.done():  # its caller gave up, or it was reported
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        try:
            if len(waiting.keys) > 1:
                self.batches += 1
                self.batched += len(waiting.keys)
            async with asyncio.timeout(waiting.timeout_s):
                outcomes = await self._run(
                    member, namespace, waiting.keys, waiting.timeout_s, report
                )
        except asyncio.CancelledError:  # the daemon stopping
            for future in waiting.futures:
                future.cancel()
            raise
        except Exception as exc:  # every caller gets it, as each read alone would
            outcomes = [exc] * len(waiting.keys)
        for i, outcome in enumerate(outcomes):
            report(i, outcome)


@dataclass
class Pinned:
    """One value of a batch, pinned at its owner."""

    key: bytes
    answer: BulkAnswer
    lease: int  # the pin's, released once read
    pages: list[tuple[int, int]]  # the owner's (address, length)
    ticket: PutTicket | None = None  # the local pages reserved for it


async def land_many(
    store: Store, nixl: NixlNode, member: str, agent: str, namespace: str,
    values: list[Pinned], landed: Landed,
) -> list[Outcome]:  # fmt: skip
    """Reserve pages for each pinned value, READ them all (one transfer per
    ``SEGMENTS_MAX`` descriptors), publish each whose bytes match (``landed``
    at once); each value's outcome, in order. Pages of values not published
    go back once their transfer has stopped."""
    outcomes: list[Outcome] = [HIT] * len(values)
    posted: set[int] = set()  # values a transfer took: it gives their pages back
    try:
        with scope.as_hop():  # the owner has it: not handed back
            for i, value in enumerate(values):
                try:
                    ticket = await store.begin_put(
                        namespace, value.key, value.answer.size, value.answer.meta, None,
                        value.answer.checksum,
                    )  # fmt: skip
                except KvdError as error:
                    outcomes[i] = not_kept(member, error)
                    continue
                if isinstance(ticket, PutResult):  # stored here meanwhile
                    landed(namespace, value.key)
                else:
                    value.ticket = ticket
            reading = [(i, v) for i, v in enumerate(values) if v.ticket is not None]
            for group in _transfers(store, member, reading, outcomes):
                posted.update(i for i, _, _, _ in group)
                if not await _read_group(store, nixl, member, agent, group, outcomes, landed):
                    failed = outcomes[group[0][0]]
                    for i, _ in reading:  # not posted: their pages go back below
                        if i not in posted:
                            outcomes[i] = failed
                    break
    finally:
        for i, value in enumerate(values):
            if value.ticket is not None and i not in posted:
                store.abort_put(value.ticket)  # a no-op once published
    return outcomes


Paired = tuple[int, Pinned, list[tuple[int, int, int]], list[tuple[int, int, int]]]


def _transfers(
    store: Store, member: str, reading: list[tuple[int, Pinned]], outcomes: list[Outcome]
) -> list[list[Paired]]:
    """The values cut into transfers of at most SEGMENTS_MAX descriptors,
    each value's (local, remote) descriptors paired; a value whose pages
    cannot be paired (more descriptors than a transfer takes) is a
    ``transfer`` peer error, its pages given back (nothing was posted)."""
    groups: list[list[Paired]] = [[]]
    count = 0
    for i, value in reading:
        assert value.ticket is not None
        try:
            mine, theirs = pair_segments(segments(value.ticket.views), value.pages)
        except NixlError as error:
            store.abort_put(value.ticket)
            outcomes[i] = PeerError(f"{member}: {error}", "transfer")
            continue
        if groups[-1] and count + len(mine) > SEGMENTS_MAX:
            groups.append([])
            count = 0
        groups[-1].append((i, value, mine, theirs))
        count += len(mine)
    return [group for group in groups if group]


async def _read_group(
    store: Store, nixl: NixlNode, member: str, agent: str, group: list[Paired],
    outcomes: list[Outcome], landed: Landed,
) -> bool:  # fmt: skip
    """One transfer of ``group``'s values, then each published or given
    back; False where the transfer failed (each of its values then has the
    ``transfer`` peer error as its outcome)."""
    tickets = [value.ticket for _, value, _, _ in group if value.ticket is not None]
    stopped = gave_up = False

    def give_back() -> None:  # the READ has stopped: its pages may go
        nonlocal stopped
        stopped = True
        if gave_up:  # a reaper, after this transfer failed
            for ticket in tickets:
                store.abort_put(ticket)

    local = [d for _, _, mine, _ in group for d in mine]
    remote = [d for _, _, _, theirs in group for d in theirs]
    try:
        try:
            await nixl.read_paired(agent, local, remote, give_back)
        except NixlError as error:
            failed = PeerError(f"{member}: {error}", "transfer")
            for i, _, _, _ in group:
                outcomes[i] = failed
            return False
        for i, value, _, _ in group:
            assert value.ticket is not None
            try:
                store.publish_now(value.ticket, checksum_views(value.ticket.views))
                landed(value.ticket.ns_name, value.key)
            except DataLoss:
                outcomes[i] = PeerError(
                    f"{member}: value of {value.answer.size} bytes failed its checksum", "checksum"
                )
            except KvdError as error:
                outcomes[i] = not_kept(member, error)
    finally:
        if stopped:
            for ticket in tickets:
                store.abort_put(ticket)  # a no-op once published
        else:
            gave_up = True  # the reaper gives the pages back once the READ stops
    return True
