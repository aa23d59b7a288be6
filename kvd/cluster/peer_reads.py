"""A value read from its owner into this daemon's L1, over the transport
each member offers, and the per-peer traffic the metrics show.

Transports (``pool_peer_transport``, the name -> way table is ``TRANSPORTS``):

- ``bulk``: the owner's bulk TCP port (``kvd.cluster.peer_bulk``), which its
  DescribePaths names (asked once per member, then cached; forgotten when a
  read from it fails, so a restarted member is asked again). The answer's
  header gives the size, meta and checksum; pages are reserved for it as a
  put (``Store.begin_put``) and the bytes are received straight into them,
  hashed as they land, and published only if they match the owner's
  checksum (``Store.publish_now``; else the pages go back, DATA_LOSS → a
  ``checksum`` peer error). No Python ``bytes`` per value. The reads of one
  owner asked in the same turn of the loop (a batched get's, a lookup's
  fetch ahead) are spread over up to ``CONNECTIONS_MAX`` connections, each
  sending its share's GET frames back to back and reading the answers in
  order; a value not kept here is read and dropped when answers follow it.
- ``nixl``: a one-sided NIXL/UCX read into the same reserved pages
  (``kvd.cluster.nixl_node``) where NIXL imports and starts and the owner
  offers it; ``auto`` picks it then, else bulk. The reads of one owner
  asked in the same turn of the loop (a batched get's) go as one batch:
  pinned on one connection, READ in one transfer (``kvd.cluster.nixl_reads``).
- ``grpc``: the owner's gRPC Get (1 MiB messages, joined, then stored), as
  for a member that has no bulk port (``bulk_port`` 0), no DescribePaths, or
  a bulk port this daemon cannot connect to (a loopback ``bulk_listen``).

A member's Exists (its share of a chain being looked up) goes the same
way as its values: a PEER_EXISTS frame on its bulk port where it takes one
(``exists``), else gRPC. A member's eviction plan is asked on its bulk port
only (PEER_PLAN, where it takes ``plan``). A put handed on to its owner
(``kvd.cluster.forwards``) is a PUT on its bulk port where it takes one
(``put``), sent from this daemon's L1 pages, else a gRPC BatchPut.

A member whose DescribePaths names a bulk protocol version other than this
daemon's is refused (a ``version`` peer error, logged by the router, and
asked again once it comes back from being skipped).

Whatever the transport, the read is bounded by the time it is given (a
timeout is a ``timeout`` peer error); a read cancelled or failed half-way
gives its pages back (``Store.abort_put``) and closes its connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvd.cluster import scope
from kvd.cluster.nixl_node import NixlError, NixlNode
from kvd.cluster.nixl_reads import Gather, Landed, Outcome, Pinned, Report, land_many
from kvd.cluster.outcomes import HIT, MISS, NOT_KEPT, not_kept
from kvd.cluster.peer_bulk import CONNECTIONS_MAX, BulkConnection, BulkPeers, BulkUnreachable
from kvd.cluster.peers import PeerError, PeerPaths, Peers
from kvd.config.addresses import parse_address
from kvd.store.index import PutResult, Reader
from kvd.store.store import Store
from kvd.wire.bulk import VERSION as BULK_VERSION
from kvd.wire.checksum import Hasher, checksum
from kvd.wire.errors import DataLoss, KvdError
from kvd.wire.grpc import POOL_VERSION
from kvd.wire.lookup import ChainShare
from kvd.wire.shm import join_keys

log = logging.getLogger("kvd.cluster")
_T = TypeVar("_T")

# The settings' choices of pool_peer_transport (kvd.config.settings).
TRANSPORTS = ("auto", "nixl", "bulk", "grpc")


@dataclass
class PeerTraffic:
    """Per member: value reads and their bytes by transport, failures by kind.
    Members only (entries of a member that left are dropped), so the label
    sets stay as small as the pool."""

    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes_in: dict[tuple[str, str], int] = field(default_factory=dict)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)

    def called(self, member: str, transport: str, nbytes: int) -> None:
        key = (member, transport)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes_in[key] = self.bytes_in.get(key, 0) + nbytes

    def failed(self, member: str, kind: str) -> None:
        key = (member, kind)
        self.errors[key] = self.errors.get(key, 0) + 1

    def retain(self, members: tuple[str, ...]) -> None:
        for table in (self.calls, self.bytes_in, self.errors):
            for key in [k for k in table if k[0] not in members]:
                del table[key]

    def rows(self) -> dict[str, tuple[str, tuple[str, ...], list[tuple[tuple[str, ...], int]]]]:
        """metric name -> (help, label names, [(label values, value)]), for the collector."""
        return {
            "kvd_cluster_peer_reads": (
                "Value reads from each member, by transport",
                ("peer", "transport"),
                list(self.calls.items()),
            ),
            "kvd_cluster_peer_read_bytes": (
                "Value bytes read from each member, by transport",
                ("peer", "transport"),
                list(self.bytes_in.items()),
            ),
            "kvd_cluster_peer_call_errors": (
                "Failed calls to each member, by kind (each a miss)",
                ("peer", "kind"),
                list(self.errors.items()),
            ),
        }


class PeerReads:
    """Reads of values from their owners into local L1, over ``transport``."""

    def __init__(
        self,
        store: Store,
        peers: Peers,
        bulk: BulkPeers,
        transport: str,
        nixl: NixlNode | str | None = None,
    ) -> None:
        """``nixl``: this daemon's agent, or why it has none (for ``auto`` and ``nixl``)."""
        assert transport in TRANSPORTS, transport
        self.store = store
        self.peers = peers
        self.bulk = bulk
        self.asked = transport
        self.nixl = nixl if isinstance(nixl, NixlNode) else None
        self.nixl_missing = nixl if isinstance(nixl, str) else ""
        if transport in ("auto", "nixl"):
            self.transport = "nixl" if self.nixl is not None else "bulk"
        else:
            self.transport = transport
        # Per member: its agent's metadata and name, or None where it offers no NIXL
        # (asked again after a failure); and the metadata loaded into this agent,
        # one per member (a member that restarted replaces its own).
        self._agents: dict[str, tuple[bytes, str] | None] = {}
        self._loaded: dict[str, bytes] = {}
        self.traffic = PeerTraffic()
        self._paths: dict[str, PeerPaths] = {}
        self._grpc_logged: set[str] = set()
        # Reads of one owner asked in the same turn of the loop: one batch,
        # over NIXL or over the owner's bulk port.
        self.gather = Gather(self._read_nixl_many)
        self.bulk_gather = Gather(self._read_bulk_many)
        # Told of each value published here from its owner, before anything
        # else runs (the router holds it for its get); set by the router.
        self.landed: Landed = _nothing

    def describe(self) -> str:
        """The transport in use and, where it differs, the one asked for and why."""
        why = f": {self.nixl_missing}" if self.nixl_missing else ""
        if self.asked in (self.transport, "auto") and not why:
            return self.transport
        return f"{self.transport} ({self.asked} asked{why})"

    def retain(self, members: tuple[str, ...]) -> None:
        for member in [m for m in self._paths if m not in members]:
            del self._paths[member]
        for member in [m for m in self._agents if m not in members]:
            del self._agents[member]
        for member in [m for m in self._loaded if m not in members]:
            if self.nixl is not None:
                self.nixl.forget(self._loaded.pop(member))
        self.bulk.retain(members)
        self.traffic.retain(members)

    def tasks(self) -> list[asyncio.Task[None]]:
        """Batches of reads under way (NIXL and bulk)."""
        return [*self.gather.tasks(), *self.bulk_gather.tasks()]

    def close(self) -> None:
        self.bulk.close()
        if self.nixl is not None:
            self.nixl.close()

    async def read(self, member: str, namespace: str, key: bytes, timeout_s: float) -> str:
        """Bring ``key``'s value from ``member`` into L1 within ``timeout_s``:
        ``HIT``, ``MISS`` or ``NOT_KEPT``; any failure is a ``PeerError``."""
        deadline = time.monotonic() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                way = await self._way(member, timeout_s)
                if way is None:
                    return await self._read_grpc(member, namespace, key, timeout_s)
                try:
                    reads = self.gather if self.nixl is not None else self.bulk_gather
                    return await reads.read(member, namespace, key, timeout_s)
                except BulkUnreachable as error:
                    self._unreachable(member, error)
                    left_s = deadline - time.monotonic()
                    return await self._read_grpc(member, namespace, key, left_s)
        except TimeoutError:
            self._paths.pop(member, None)
            self._agents.pop(member, None)
            raise PeerError(
                f"{member}: value read took more than {timeout_s * 1000:.0f} ms", "timeout"
            ) from None
        except PeerError as error:
            if error.kind != "checksum":  # asked again: it may have restarted elsewhere
                self._paths.pop(member, None)
                self._agents.pop(member, None)
            raise

    async def exists(
        self, member: str, namespace: str, keys: list[bytes], timeout_s: float,
        chain: ChainShare | None,
    ) -> bytes | None:  # fmt: skip
        """Which of ``keys`` the member holds, asked on its bulk port (one
        PEER_EXISTS frame each way) within ``timeout_s``, a byte each
        (``BulkConnection.exists``); None where it is to
        be asked over gRPC: the ``grpc`` transport, no bulk port this daemon
        reaches, a member that does not take the op (DescribePaths'
        ``bulk_ops``), keys of different widths. A failure is a ``PeerError``."""
        joined = join_keys(keys)
        if joined is None:
            return None
        width, key_bytes = joined
        return await self._peer_op(
            member, "exists", timeout_s,
            lambda connection: connection.exists(namespace, width, key_bytes, chain),
        )  # fmt: skip

    async def tell(
        self, member: str, namespace: str, shares: list[tuple[list[bytes], ChainShare]],
        timeout_s: float,
    ) -> bool:  # fmt: skip
        """Send lookups' chain shares to the member's bulk port in one
        PEER_TELL (no answer) within ``timeout_s``; False where it is to be
        told otherwise (one Exists each): as ``exists`` returns None, or a
        member that does not take the op. A failure is a ``PeerError``."""
        joined = []
        for keys, chain in shares:
            one = join_keys(keys)
            if one is None:
                return False
            joined.append((*one, chain))

        async def call(connection: BulkConnection) -> bool:
            await connection.tell(namespace, joined)
            return True

        return bool(await self._peer_op(member, "tell", timeout_s, call))

    async def put_many(
        self, member: str, readers: list[Reader], timeout_s: float,
        histories: Sequence[bytes | None] | None = None, keep: bool = False,
    ) -> list[bool] | None:  # fmt: skip
        """Hand puts on to their owner on its bulk port, in order, on one
        connection (``BulkConnection.put_many``, the bytes sent from the
        readers' pages) within ``timeout_s``: whether it took each; None
        where they are to go over gRPC: no bulk port this daemon reaches, or
        a member that does not take the op. ``histories``: each value's in
        this daemon's eviction policy, sent where the member takes them
        (``bulk_ops`` "history"); ``keep``: the member keeps them as its own
        (this one is leaving). A failure is a ``PeerError``."""

        async def call(connection: BulkConnection) -> list[bool]:
            # A value over the member's max_value_bytes is not sent: there the
            # PUT would close the connection, and the batch's others with it.
            paths = self._paths[member]
            largest = paths.max_value_bytes or None
            fits = [largest is None or reader.size <= largest for reader in readers]
            carried = histories if histories and "history" in paths.bulk_ops else None
            puts = [
                (reader.entry.ns.name, reader.entry.key, reader, history)
                for reader, history, fit in zip(
                    readers, carried or [None] * len(readers), fits, strict=True
                )
                if fit
            ]
            taken = iter(await connection.put_many(puts, keep) if puts else [])
            return [ok and next(taken) for ok in fits]

        return await self._peer_op(member, "put", timeout_s, call)

    async def plan(self, member: str, timeout_s: float) -> tuple[str, bytes] | None:
        """The member's eviction policy's name and plan, asked on its bulk
        port within ``timeout_s``; None where it has none or offers none (no
        bulk port this daemon reaches, no ``plan`` op). A failure is a
        ``PeerError``."""
        return await self._peer_op(member, "plan", timeout_s, BulkConnection.plan)

    async def _peer_op(
        self, member: str, op: str, timeout_s: float,
        call: Callable[[BulkConnection], Awaitable[_T]],
    ) -> _T | None:  # fmt: skip
        """``call``'s answer, on a connection to the member's bulk port
        within ``timeout_s``; None where the member takes no ``op`` there
        (DescribePaths' ``bulk_ops``) or this daemon reaches no bulk port of
        it. A failure is a ``PeerError``."""
        try:
            async with asyncio.timeout(timeout_s):
                way = await self._way(member, timeout_s)
                if way is None or op not in self._paths[member].bulk_ops:
                    return None
                try:
                    async with self.bulk.connection(member, *way) as connection:
                        return await call(connection)
                except BulkUnreachable as error:
                    self._unreachable(member, error)
                    return None
        except TimeoutError:
            self._paths.pop(member, None)
            raise PeerError(
                f"{member}: {op} took more than {timeout_s * 1000:.0f} ms", "timeout"
            ) from None
        except PeerError:
            self._paths.pop(member, None)  # asked again: it may have restarted
            raise

    def _unreachable(self, member: str, error: BulkUnreachable) -> None:
        """A member whose bulk_listen is loopback (the default) names a port
        no other node reaches: it is asked over gRPC."""
        log.warning(
            "peer's bulk TCP port is unreachable from here; its values are read over gRPC",
            extra={"peer": member, "error": str(error)},
        )
        self._paths[member] = PeerPaths(0, BULK_VERSION)
        self._grpc_logged.add(member)

    async def _way(self, member: str, timeout_s: float) -> tuple[str, int] | None:
        """The member's bulk address, or None to read over gRPC; a
        ``PeerError`` ("version") for a member whose pool calls are another
        version's (asked once, then again after any failure)."""
        paths = self._paths.get(member)
        if paths is None:
            paths = await self.peers.describe(member, timeout_s)
            if paths.pool_version != POOL_VERSION:
                raise PeerError(
                    f"{member}: speaks pool protocol version {paths.pool_version}, "
                    f"this daemon speaks {POOL_VERSION}; refused",
                    "version",
                )
            over_bulk = self.transport != "grpc" and paths.bulk_port
            if over_bulk and paths.bulk_version != BULK_VERSION:
                raise PeerError(
                    f"{member}: speaks bulk protocol version {paths.bulk_version}, "
                    f"this daemon speaks {BULK_VERSION}; refused",
                    "version",
                )
            self._paths[member] = paths
        if self.transport == "grpc":
            return None
        why = ""
        if not paths.bulk_port:
            why = "it has no bulk TCP port"
        elif paths.bulk_tls and self.bulk.tls is None:
            why = "its bulk port takes TLS only, and this daemon has no pool_tls_ca_file"
        elif self.bulk.tls is not None and not paths.bulk_tls:
            why = "its bulk port is in clear (no bulk_tls), and the pool's calls use TLS"
        if why:
            if member not in self._grpc_logged:
                self._grpc_logged.add(member)
                log.warning(
                    "peer's values are read over gRPC", extra={"peer": member, "reason": why}
                )
            return None
        host, _ = parse_address(member)
        return host, paths.bulk_port

    async def _read_bulk_many(
        self, member: str, namespace: str, keys: list[bytes], timeout_s: float, report: Report
    ) -> list[Outcome]:
        """The values over the member's bulk port: spread over up to
        ``CONNECTIONS_MAX`` connections, each asking for its share of the keys
        with GET frames back to back (``_get_bulk_many``); each key's outcome."""
        way = await self._known_way(member, timeout_s)
        count = min(len(keys), CONNECTIONS_MAX)
        starts = [len(keys) * i // count for i in range(count + 1)]
        parts = [keys[starts[i] : starts[i + 1]] for i in range(count)]

        async def read(i: int) -> list[Outcome]:
            async with self.bulk.connection(member, *way) as connection:
                return await self._get_bulk_many(
                    member, connection, namespace, parts[i], lambda j, o: report(starts[i] + j, o)
                )

        done = await asyncio.gather(*(read(i) for i in range(count)), return_exceptions=True)
        outcomes: list[Outcome] = []
        for part, result in zip(parts, done, strict=True):
            outcomes += result if isinstance(result, list) else [result] * len(part)
        return outcomes

    async def _get_bulk_many(
        self, member: str, connection: BulkConnection, namespace: str, keys: list[bytes],
        report: Report,
    ) -> list[Outcome]:  # fmt: skip
        """Each key's value over one connection, its GETs sent back to back
        and the answers read in order. A refusal, a miss or a checksum failure
        is that value's outcome; a connection that fails fails the rest (and
        is closed), as does the last value left unread (not kept here)."""
        max_value_bytes = self.store.limits.max_value_bytes
        outcomes: list[Outcome] = []
        try:
            rids = await connection.ask(namespace, keys)
            for i, (key, rid) in enumerate(zip(keys, rids, strict=True)):
                try:
                    answer = await connection.answer_get(rid, max_value_bytes)
                    if answer is None:
                        self.traffic.called(member, "bulk", 0)
                        outcomes.append(MISS)
                    else:
                        outcomes.append(await self._land(member, namespace, key, answer.size,
                                                         answer.meta, answer.checksum, connection,
                                                         whole=i < len(keys) - 1))  # fmt: skip
                        self.traffic.called(member, "bulk", answer.size)
                except PeerError as error:
                    if error.kind not in ("refused", "auth", "checksum"):
                        raise
                    outcomes.append(error)  # this value's alone: the next answer follows
                report(i, outcomes[-1])  # its caller goes on while the others arrive
        except PeerError as error:
            connection.reusable = False
            outcomes += [error] * (len(keys) - len(outcomes))
        return outcomes

    async def _read_nixl_many(
        self, member: str, namespace: str, keys: list[bytes], timeout_s: float, report: Report
    ) -> list[Outcome]:
        """Pin the values on the member (bulk connection), READ their pages
        into reserved local pages in one transfer, release the pins
        together (``kvd.cluster.nixl_reads``); each key's outcome, or its
        failure. A member that offers no NIXL is read with plain bulk GETs."""
        assert self.nixl is not None
        way = await self._known_way(member, timeout_s)
        async with self.bulk.connection(member, *way) as connection:
            offer = await self._offer(member, connection)
            if offer is not None:
                max_value_bytes = self.store.limits.max_value_bytes
                pins = await connection.nixl_pin_many(namespace, keys, max_value_bytes)
                held = [(i, Pinned(key, *pin)) for i, (key, pin) in
                        enumerate(zip(keys, pins, strict=True)) if pin is not None]  # fmt: skip
                outcomes: list[Outcome] = [MISS] * len(keys)
                landed = await land_many(self.store, self.nixl, member, offer[1], namespace,
                                         [value for _, value in held], self.landed)  # fmt: skip
                await connection.nixl_release_many([value.lease for _, value in held])
                for (i, value), outcome in zip(held, landed, strict=True):
                    outcomes[i] = outcome
                    if not isinstance(outcome, BaseException):  # as a read alone counts
                        self.traffic.called(member, "nixl", value.answer.size)
                for _ in range(len(keys) - len(held)):
                    self.traffic.called(member, "nixl", 0)
                return outcomes
            # The member offers no NIXL: bulk GETs on the same connection.
            return await self._get_bulk_many(member, connection, namespace, keys, report)

    async def _known_way(self, member: str, timeout_s: float) -> tuple[str, int]:
        """The member's bulk port (known: ``read`` asked for it first)."""
        way = await self._way(member, timeout_s)
        if way is None:  # forgotten meanwhile (a failed read): the caller reads over gRPC
            raise BulkUnreachable(f"{member}: no bulk port known")
        return way

    async def _offer(self, member: str, connection: BulkConnection) -> tuple[bytes, str] | None:
        """The member's agent (metadata, name), asked once and loaded into this
        agent; None where it offers no NIXL."""
        assert self.nixl is not None
        if member in self._agents:
            return self._agents[member]
        metadata = await connection.nixl_meta()
        if metadata is None:
            log.warning(
                "peer offers no NIXL; its values are read over bulk TCP", extra={"peer": member}
            )
            self._agents[member] = None
            return None
        old = self._loaded.get(member)
        if old is not None and old != metadata:
            self.nixl.forget(old)
        self._loaded[member] = metadata
        try:
            offer = (metadata, self.nixl.remote(metadata))
        except NixlError as error:
            raise PeerError(f"{member}: {error}", "transfer") from None
        self._agents[member] = offer
        return offer

    async def _land(
        self,
        member: str,
        namespace: str,
        key: bytes,
        size: int,
        meta: bytes,
        sum_sent: int,
        connection: BulkConnection,
        whole: bool = False,
    ) -> str:
        """Reserve pages for the value, receive it into them, publish it if
        its bytes match ``sum_sent``; the pages go back on any failure. With
        ``whole`` (more answers follow on the connection) a value not
        received is read and dropped; else its connection is closed."""
        with scope.as_hop():  # the owner has it: not handed back
            try:
                ticket = await self.store.begin_put(namespace, key, size, meta, None, sum_sent)
            except KvdError as error:
                not_kept(member, error)
                if whole:
                    await connection.skip(size)
                return NOT_KEPT  # else the connection, its value unread, is closed
            if isinstance(ticket, PutResult):
                self.landed(namespace, key)
                if whole:
                    await connection.skip(size)
                return HIT  # stored here meanwhile, with these bytes
            try:
                hasher = Hasher()
                await connection.receive(ticket.views, hasher)
                try:
                    self.store.publish_now(ticket, hasher.value())
                    self.landed(namespace, key)
                except DataLoss:
                    raise PeerError(
                        f"{member}: value of {size} bytes failed its checksum", "checksum"
                    ) from None
                except KvdError as error:
                    not_kept(member, error)
                    return NOT_KEPT
            finally:
                self.store.abort_put(ticket)  # a no-op once published
        return HIT

    async def _read_grpc(self, member: str, namespace: str, key: bytes, timeout_s: float) -> str:
        value = await self.peers.get(member, namespace, key, timeout_s)
        self.traffic.called(member, "grpc", len(value.data) if value is not None else 0)
        if value is None:
            return MISS
        if checksum(value.data) != value.checksum:
            raise PeerError(
                f"{member}: value of {len(value.data)} bytes failed its checksum", "checksum"
            )
        try:
            with scope.as_hop():  # the owner has it: not handed back
                await self.store.put(
                    namespace, key, value.data, value.meta, None, value.checksum, hasher=checksum
                )
        except KvdError as error:
            not_kept(member, error)
            return NOT_KEPT
        self.landed(namespace, key)
        return HIT


def _nothing(namespace: str, key: bytes) -> None:
    """``PeerReads.landed`` where no router listens."""
