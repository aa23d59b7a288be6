"""The bulk port's pool peer ops: the control step of a NIXL read by another
member of the pool (docs/bulk-protocol.md, "Pool peer ops").

- ``NIXL_META``: this daemon's NIXL agent metadata (UNIMPLEMENTED where the
  daemon has no agent: the member then reads with a plain GET).
- ``NIXL_PIN`` (namespace, key; from a member, answered from this daemon
  alone): the value is pinned where it lies in the registered L1 arena
  (read from L2 into L1 first if need be), and the answer gives its size,
  meta, checksum, a lease id and the (address, length) of its pages; the
  member then READs them one-sided.
- Only a connection whose HELLO said the pool token may use them (with
  auth): NIXL metadata lets its holder READ the whole registered arena, so
  an engine's token, which reads only its own namespaces, gets
  PERMISSION_DENIED.
- ``NIXL_RELEASE`` (the lease id in the checksum field): the member is done;
  the pin ends. A pin not released within ``LEASE_S`` ends anyway, and so do
  a connection's pins when it closes: a member that stopped cannot hold pages.
- ``PEER_EXISTS`` (namespace; keys, and their positions in a chain): the
  gRPC ``Exists`` a member asks while it looks a chain up (the same answers,
  limits, learning and metrics of op ``exists``), one frame each way: on the
  development VM a gRPC call cost an owner about half of its CPU per lookup.
  Its meta may say how many of the member's lookups held none of this
  daemon's keys since it last told it of one (``ChainShare.untold``). The
  answer's byte for a key may say it is kept for the member's lookup hints
  (``EXISTS_KEPT``, kvd.cluster.promises).
- ``PEER_TELL`` (namespace; chain shares): lookups another member made,
  which it did not need this daemon's answer for (kvd.cluster.router),
  several in one frame; this daemon's policy learns of each in order, as
  from a PEER_EXISTS's share (op ``tell``), and nothing is answered. A frame
  that does not add up, or one on a connection without the pool token,
  closes the connection: there is no answer to refuse it with.
- ``PEER_HISTORY`` (namespace, key; the history as meta): the value a
  member hands on next (its PUT with ``FLAG_HOP`` follows), as its old
  owner's eviction policy knew it (kvd.cluster.rebalance); the policy takes
  it for that put (``EvictionPolicy.expect``) or ignores bytes it does not
  know. Never answered: one on a connection without the pool token, with a
  payload, or of a namespace or key the daemon refuses closes the
  connection.
- ``PEER_PLAN``: this daemon's eviction plan (the policy's name in the
  answer's meta, the plan as payload; NOT_FOUND while it has none), which
  the other members keep their blocks by (kvd.cluster.plans).

A pin that ended before a late READ finished could let the member read
bytes of a newer value: its checksum check turns that into a miss, never
wrong bytes. A connection holds at most ``PINS_MAX`` pins
(RESOURCE_EXHAUSTED past it).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvd.cluster import scope
from kvd.cluster.nixl_node import segments
from kvd.paths.ops.calls import Tally, refused
from kvd.store.index import TIER_NAMES
from kvd.wire.bulk import (
    CODE_NOT_FOUND,
    CODE_RESOURCE_EXHAUSTED,
    NIXL_PIN,
    NIXL_SEGMENT,
    OP_NIXL_META,
    OP_NIXL_PIN,
    OP_NIXL_RELEASE,
    OP_PEER_EXISTS,
    OP_PEER_HISTORY,
    OP_PEER_PLAN,
    OP_PEER_TELL,
    PLAN_BYTES_MAX,
    ProtocolError,
    Request,
    decode_exists,
    decode_tell,
    encode_response,
    split_tail,
)
from kvd.wire.errors import CODE_NUMBERS, InvalidArgument, KvdError, error_number

if TYPE_CHECKING:
    from kvd.cluster.nixl_node import NixlNode
    from kvd.paths.ops.values import ValueOps
    from kvd.store.index import Reader

# A pin ends this long after it began if the member never releases it: far
# past any pool_peer_timeout_ms a read would use (200 ms by default).
LEASE_S = 5.0
# Pins one connection holds at once: a member keeps at most 32 reads in
# flight per batch, spread over its connections.
PINS_MAX = 64
CODE_UNIMPLEMENTED = CODE_NUMBERS["UNIMPLEMENTED"]


class PeerOps:
    """One connection's pins and the answers to its peer ops."""

    def __init__(
        self,
        values: ValueOps,
        nixl: NixlNode | None,
        pool_token: bytes,
        authorize: Callable[[str], None],
        answer: Callable[[bytes], Awaitable[None]],
    ) -> None:
        self.values = values
        self.nixl = nixl
        self._pool_token = pool_token
        # Without auth every connection may (the port is loopback, and serves
        # any namespace anyway); with auth, only one that said the pool token.
        self.pool_peer = True
        self._authorize = authorize
        self._answer = answer
        self._pins: dict[int, tuple[Reader, asyncio.TimerHandle]] = {}
        self._ids = itertools.count(1)

    def is_pool_token(self, token: bytes) -> bool:
        return bool(self._pool_token) and hmac.compare_digest(token, self._pool_token)

    async def handle(self, request: Request, tail: bytes, payload: bytes = b"") -> None:
        rid = request.request_id
        if request.op == OP_PEER_TELL:
            self._tell(request, tail, payload)
            return
        if request.op == OP_PEER_HISTORY:
            self._history(request, tail)
            return
        if not self.pool_peer:
            # An engine's token may read its own namespaces, but an agent's
            # metadata lets its holder READ the whole registered arena.
            message = "pool peer ops take the pool token"
            code = CODE_NUMBERS["PERMISSION_DENIED"]
            await self._answer(encode_response(request.op, rid, code, message=message))
            return
        if request.op == OP_PEER_EXISTS:
            await self._answer(await self._exists(request, tail, payload))
            return
        if request.op == OP_PEER_PLAN:
            await self._answer(self._plan(request))
            return
        if request.op == OP_NIXL_RELEASE:
            self.release(request.checksum)
            await self._answer(encode_response(OP_NIXL_RELEASE, rid))
            return
        if self.nixl is None:
            message = "this daemon has no NIXL agent"
            await self._answer(
                encode_response(request.op, rid, CODE_UNIMPLEMENTED, message=message)
            )
            return
        if request.op == OP_NIXL_META:
            metadata = self.nixl.metadata
            head = encode_response(OP_NIXL_META, rid, length=len(metadata))
            await self._answer(head + metadata)
            return
        assert request.op == OP_NIXL_PIN
        await self._pin(self.nixl, request, tail)

    async def _pin(self, nixl: NixlNode, request: Request, tail: bytes) -> None:
        ns, key, _, _ = split_tail(request, tail)
        rid = request.request_id
        if len(self._pins) >= PINS_MAX:
            message = f"{PINS_MAX} pins held on this connection"
            await self._answer(
                encode_response(OP_NIXL_PIN, rid, CODE_RESOURCE_EXHAUSTED, message=message)
            )
            return
        try:
            self._authorize(ns)
            with scope.as_hop():  # a member's read: from here alone
                reader = await self.values.fetch("bulk_get", ns, key)
        except KvdError as exc:
            code = refused(self.values.metrics, "bulk_get", exc)
            await self._answer(encode_response(OP_NIXL_PIN, rid, code, message=str(exc)))
            return
        if reader is None:
            await self._answer(encode_response(OP_NIXL_PIN, rid, CODE_NOT_FOUND))
            return
        lease = next(self._ids)
        timer = asyncio.get_running_loop().call_later(LEASE_S, self.release, lease)
        self._pins[lease] = (reader, timer)
        nixl.hold()  # this side progresses while the member reads
        pages = segments(reader.views)
        payload = b"".join(
            [NIXL_PIN.pack(reader.size, lease, len(pages))]
            + [NIXL_SEGMENT.pack(address, length) for address, length in pages]
        )
        head = encode_response(
            OP_NIXL_PIN, rid, meta=reader.meta, length=len(payload), checksum=reader.checksum
        )
        await self._answer(head + payload)
        self.values.served("bulk_get", TIER_NAMES[reader.tier], reader.size)

    async def _exists(self, request: Request, tail: bytes, payload: bytes) -> bytes:
        """A PEER_EXISTS's answer: a byte per key, 1 where held here."""
        ns, _, _, meta = split_tail(request, tail)
        try:
            with Tally(self.values.metrics, "exists"):
                self._authorize(ns)
                try:
                    keys, chain = decode_exists(payload, meta)
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
                with scope.as_hop():  # a member's question: from here alone
                    found = await self.values.exists(ns, keys, chain=chain)
        except KvdError as exc:
            return encode_response(OP_PEER_EXISTS, request.request_id, error_number(exc),
                                   message=str(exc))  # fmt: skip
        pool = self.values.pool  # keeps what it says it holds for the member's hints
        answer = bytes(found) if pool is None else pool.answer_exists(ns, keys, found)
        return encode_response(OP_PEER_EXISTS, request.request_id, length=len(answer)) + answer

    def _tell(self, request: Request, tail: bytes, payload: bytes) -> None:
        """A PEER_TELL: each share's lookup, for the eviction policy; no answer."""
        if not self.pool_peer:
            raise ProtocolError("pool peer ops take the pool token")
        ns, _, _, _ = split_tail(request, tail)
        with Tally(self.values.metrics, "tell"):
            try:
                self._authorize(ns)
                shares = decode_tell(payload)
                pool = self.values.pool
                if pool is not None:  # a daemon outside a pool has no share to learn
                    for keys, chain in shares:
                        pool.learn(ns, keys, chain)
            except (ValueError, KvdError) as exc:
                raise ProtocolError(f"a tell refused: {exc}") from None

    def _history(self, request: Request, tail: bytes) -> None:
        """A PEER_HISTORY: the history of the value the member hands on next,
        for the policy (one it does not take is ignored); no answer."""
        if not self.pool_peer:
            raise ProtocolError("pool peer ops take the pool token")
        if request.length:
            raise ProtocolError(f"a history with a payload of {request.length} bytes")
        ns, key, _, history = split_tail(request, tail)
        try:
            self._authorize(ns)
            pool = self.values.pool
            if pool is not None:  # a daemon outside a pool is handed nothing
                pool.expect(ns, key, history)
        except KvdError as exc:
            raise ProtocolError(f"a history refused: {exc}") from None

    def _plan(self, request: Request) -> bytes:
        """A PEER_PLAN's answer: the policy's name and its plan."""
        learning = self.values.store.learning
        plan = learning.shared_plan()
        if plan is None:
            return encode_response(OP_PEER_PLAN, request.request_id, CODE_NOT_FOUND)
        assert len(plan) <= PLAN_BYTES_MAX, "a policy's plan outgrew the frame's bound"
        head = encode_response(
            OP_PEER_PLAN, request.request_id, meta=learning.name.encode(), length=len(plan)
        )
        return head + plan

    def release(self, lease: int) -> None:
        """End a pin (idempotent: the member's release and the lease may both come)."""
        pin = self._pins.pop(lease, None)
        if pin is not None:
            reader, timer = pin
            timer.cancel()
            reader.close()
            assert self.nixl is not None, "pins are taken only with an agent"
            self.nixl.unhold()

    def close(self) -> None:
        """The connection ended: every pin it held ends."""
        for lease in list(self._pins):
            self.release(lease)
