"""Client side of the shm socket: region attaches, region ops, and the
index ops an engine's scheduler waits on (LOOKUP, RELEASE).

``RegionOps`` turns the gRPC-shaped batch requests of ``kvd.client.shm``
into frames (``kvd.wire.shm``) over ``BulkClient``'s connection pool, and
attaches a region by passing its memfd with SCM_RIGHTS on a connection of
its own. Before anything is sent on a connection, ``DaemonIdentity``
checks that its peer is the daemon: the uid (and, within the daemon's pid
namespace, the pid) that ``DescribePaths`` reported over gRPC. A socket
put there by anyone else gets no token.
"""

from __future__ import annotations

import array
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.client.bulk import Answer, BulkClient, Connection
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.bulk import (
    FLAG_EXISTED,
    OP_REGION_GET,
    OP_REGION_PUT,
    REQUEST,
    RESPONSE,
    RESPONSE_MAGIC,
    VERSION,
    encode_request,
)
from kvd.wire.errors import DeadlineExceeded, PermissionDenied, Unavailable, error_for
from kvd.wire.lookup import LookupResult
from kvd.wire.shm import (
    ATTACHED,
    DEADLINE,
    FLAG_DEADLINE,
    FLAG_RELEASED,
    LOOKUP_ANSWER,
    LOOKUP_REF,
    MANY_ITEM,
    MANY_REF,
    MANY_RESULT,
    OP_LOOKUP,
    OP_POOL_ATTACH,
    OP_REGION_ATTACH,
    OP_REGION_GET_MANY,
    OP_RELEASE,
    PEERCRED,
    PIPELINE_FRAMES,
    POOL_ATTACHED,
    POOL_DIRECTORY,
    REGION_REF,
    RELEASE_REF,
    TIER_SHIFT,
    join_keys,
    pid_namespace,
)


@dataclass(frozen=True, slots=True)
class ItemAnswer:
    """One item's answer of a region batch over the socket: the fields of
    ``pb.RegionItemResult``, in a plain object (a protobuf message per item
    cost ~2.5 µs of a 64-value batch's ~20 µs per value here)."""

    code: int = 0
    message: str = ""
    size: int = 0
    checksum: int = 0
    existed: bool = False
    meta: bytes = b""
    tier: int = 0


@dataclass(frozen=True, slots=True)
class Answers:
    """A region batch's answers over the socket, as ``pb.RegionBatchResponse``
    holds them over gRPC (``results``, in item order)."""

    results: list[ItemAnswer]


RegionResult = pb.RegionItemResult | ItemAnswer
BatchAnswer = pb.RegionBatchResponse | Answers


@dataclass(frozen=True)
class DaemonIdentity:
    """Who serves the shm socket, as the daemon said over its gRPC channel."""

    uid: int
    pid: int
    pid_ns: int

    def check(self, sock: socket.socket) -> None:
        """PermissionDenied unless ``sock``'s peer is the daemon: the same uid,
        and the same pid where the client shares the daemon's pid namespace
        (in another one, as in a pod of its own, the kernel shows another pid)."""
        pid, uid, _ = PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
        )
        same_ns = self.pid_ns != 0 and self.pid_ns == pid_namespace()
        if uid != self.uid or (same_ns and pid != self.pid):
            raise PermissionDenied(
                f"the shm socket is served by uid {uid} pid {pid}, "
                f"not by the daemon (uid {self.uid} pid {self.pid}): nothing sent to it"
            )


class RegionOps:
    """Region attaches, and ``GetIntoRegion``/``PutFromRegion`` batches, over
    the shm socket: each batch on one connection (the daemon runs its frames
    concurrently; spreading it over connections only added client threads),
    the pool's others for other threads. Every connection checks its peer
    is the daemon (``DaemonIdentity``) before it sends anything."""

    def __init__(
        self,
        path: str,
        token: str | None,
        timeout_s: float,
        connections: int = 2,
        daemon: DaemonIdentity | None = None,
        clock_offset_ns: int | None = None,
        offered: frozenset[str] = frozenset(),
    ):
        """``clock_offset_ns``: the daemon's CLOCK_MONOTONIC less this process's,
        as ``of`` estimated it; None for a daemon that takes no deadlines.
        ``offered``: the ops it takes beyond the region ops (``SHM_OPS``)."""
        self.path = path
        self.daemon = daemon
        self.clock_offset_ns = clock_offset_ns
        self.offered = offered
        self._token = token
        check = daemon.check if daemon is not None else None
        self.client = BulkClient(
            path, 0, token=token, connections=connections, timeout_s=timeout_s, check_peer=check
        )

    @classmethod
    def of(
        cls, paths: pb.DescribePathsResponse, token: str | None, timeout_s: float
    ) -> RegionOps | None:
        """Region ops on the socket ``DescribePaths`` named; None when it named
        none, or not who serves it (then the peer cannot be checked)."""
        if not paths.shm_socket or not paths.daemon_pid:
            return None
        identity = DaemonIdentity(paths.daemon_uid, paths.daemon_pid, paths.daemon_pid_ns)
        # The daemon read its clock before this answer arrived, so this
        # offset is at most the true one, and a deadline moved by it falls
        # no later on the daemon's clock than on this process's: the daemon
        # never works past the moment the client stops waiting.
        offset = paths.daemon_clock_ns - time.monotonic_ns() if paths.daemon_clock_ns else None
        return cls(
            paths.shm_socket, token, timeout_s, daemon=identity, clock_offset_ns=offset,
            offered=frozenset(paths.shm_ops),
        )  # fmt: skip

    def close(self) -> None:
        self.client.close()

    def deadline(self) -> tuple[int, int]:
        """A call starting now: when this process stops waiting for it (its
        CLOCK_MONOTONIC, ns), and the same moment on the daemon's clock
        (0 where the daemon takes no deadline)."""
        mine = time.monotonic_ns() + int(self.client.timeout_s * 1e9)
        offset = self.clock_offset_ns
        return mine, (max(1, mine + offset) if offset is not None else 0)

    def attach(self, fd: int, size: int) -> tuple[int, bytes]:
        """Attach the sealed memfd ``fd`` of ``size`` bytes: (region id, token)."""
        timeout_s = self.client.timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(self.path)
            if self.daemon is not None:
                self.daemon.check(sock)
            frame = encode_request(
                OP_REGION_ATTACH, 0, meta=(self._token or "").encode(), length=size
            )
            descriptor = array.array("i", [fd])
            sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, descriptor)])
            answer = _read_answer(sock)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"shm socket {self.path}: {exc}") from None
        except OSError as exc:
            raise Unavailable(f"shm socket {self.path}: {exc}") from None
        finally:
            sock.close()
        if answer.op != OP_REGION_ATTACH or answer.code != 0:
            raise error_for(answer.code, answer.message)
        if len(answer.meta) != ATTACHED.size:
            raise Unavailable("shm socket: a REGION_ATTACH answer without a region")
        region_id, token = ATTACHED.unpack(answer.meta)
        return region_id, token

    def attach_pool(
        self,
    ) -> tuple[int, int, tuple[int, int, int, int] | None, socket.socket | None]:
        """Ask for the daemon's L1 pool (``POOL_ATTACH``): its read-only
        descriptor (the caller's to close), its size, where its directory
        lies (``POOL_DIRECTORY``'s fields; None without one) and, with a
        directory, the attach's connection, which the daemon keeps open while
        it lives (the caller's to close; None otherwise). A refusal raises
        (FailedPrecondition: pool reads off; PermissionDenied: not for this token)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        keep = False
        try:
            try:
                sock.settimeout(self.client.timeout_s)
                sock.connect(self.path)
                if self.daemon is not None:
                    self.daemon.check(sock)
                sock.sendall(encode_request(OP_POOL_ATTACH, 0, meta=(self._token or "").encode()))
                answer = _read_answer(sock, fds)
            except TimeoutError as exc:
                _close_fds(fds)
                raise DeadlineExceeded(f"shm socket {self.path}: {exc}") from None
            except OSError as exc:
                _close_fds(fds)
                raise Unavailable(f"shm socket {self.path}: {exc}") from None
            sizes = (POOL_ATTACHED.size, POOL_ATTACHED.size + POOL_DIRECTORY.size)
            if (
                answer.code != 0
                or answer.op != OP_POOL_ATTACH
                or len(answer.meta) not in sizes
                or len(fds) != 1
            ):
                _close_fds(fds)
                if answer.code != 0:
                    raise error_for(answer.code, answer.message)
                raise Unavailable("shm socket: a POOL_ATTACH answer without the pool")
            (size,) = POOL_ATTACHED.unpack_from(answer.meta)
            directory = None
            if len(answer.meta) > POOL_ATTACHED.size:
                directory = POOL_DIRECTORY.unpack_from(answer.meta, POOL_ATTACHED.size)
                keep = True
            return fds[0], size, directory, sock if keep else None
        finally:
            if not keep:
                sock.close()

    def get_into_region(self, request: pb.GetIntoRegionRequest) -> Answers:
        if "get_many" in self.offered and len(request.items) > 1:
            many = _get_many_frame(request)
            if many is not None:
                results = self.client.with_connection(
                    lambda conn: _exchange_many(conn, many, len(request.items))
                )
                return Answers(results)
        ns = request.namespace.encode()
        late = _deadline_flag(request.deadline_ns)
        frames = [
            _with_ref(
                encode_request(OP_REGION_GET, i, ns, item.key, length=item.length, flags=late),
                _ref(request.region_id, item.offset, request.token, request.deadline_ns),
            )
            for i, item in enumerate(request.items)
        ]
        return self._exchange(frames)

    def get_one(
        self,
        region_id: int,
        token: bytes,
        ns: str,
        key: bytes,
        offset: int,
        room: int,
        deadline_ns: int = 0,
    ) -> ItemAnswer:
        """One get into a region: ``get_into_region`` of one item, with one frame."""
        late = _deadline_flag(deadline_ns)
        frame = _with_ref(
            encode_request(OP_REGION_GET, 0, ns.encode(), key, length=room, flags=late),
            _ref(region_id, offset, token, deadline_ns),
        )
        return _result(self.client.with_connection(lambda conn: _exchange_one(conn, frame)))

    def put_from_region(self, request: pb.PutFromRegionRequest) -> Answers:
        ns = request.namespace.encode()
        frames = []
        previous = b""
        for i, item in enumerate(request.items):
            parent = item.parent or (previous if request.chained else b"")
            previous = item.key
            frames.append(
                _with_ref(
                    encode_request(
                        OP_REGION_PUT,
                        i,
                        ns,
                        item.key,
                        parent=parent,
                        meta=item.meta,
                        length=item.length,
                        checksum=item.checksum if item.HasField("checksum") else None,
                        durable=request.durable,
                        flags=_deadline_flag(request.deadline_ns),
                    ),
                    _ref(request.region_id, item.offset, request.token, request.deadline_ns),
                )
            )
        return self._exchange(frames)

    def lookup(self, ns: str, keys: Sequence[bytes], lease_ms: int) -> Answer | None:
        """A LOOKUP's answer (``lookup_answer`` reads it); None when the keys
        differ in width (or there are none): the chain then goes over gRPC.
        A lost connection raises (``Unavailable``, ``PermissionDenied``)."""
        joined = join_keys(keys)
        if joined is None or "lookup" not in self.offered:
            return None
        width, data = joined
        head = encode_request(OP_LOOKUP, 0, ns.encode(), length=len(data))
        frame = _with_ref(head, LOOKUP_REF.pack(lease_ms, width))
        return self.client.with_connection(lambda conn: _exchange_one(conn, frame, data))

    def release(self, ns: str, lease_id: int) -> Answer | None:
        """A RELEASE's answer (``released`` reads it); None from a daemon
        that takes none (then over gRPC)."""
        if "release" not in self.offered:
            return None
        frame = _with_ref(encode_request(OP_RELEASE, 0, ns.encode()), RELEASE_REF.pack(lease_id))
        return self.client.with_connection(lambda conn: _exchange_one(conn, frame))

    def _exchange(self, frames: list[bytes]) -> Answers:
        answers: list[Answer | None] = [None] * len(frames)
        self.client.with_connection(lambda conn: _window(conn, frames, 0, len(frames), answers))
        results = []
        for answer in answers:
            assert answer is not None, "every frame was answered"
            results.append(_result(answer))
        return Answers(results)


def _read_answer(sock: socket.socket, fds: list[int] | None = None) -> Answer:
    """One answer frame from a blocking socket; with ``fds``, the descriptors
    that come with it are added there (room for one)."""

    def exactly(nbytes: int) -> bytes:
        data = bytearray()
        while len(data) < nbytes:
            if fds is None:
                got = sock.recv(nbytes - len(data))
            else:
                got, ancillary, _, _ = sock.recvmsg(nbytes - len(data), socket.CMSG_SPACE(4))
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        passed = array.array("i")
                        passed.frombytes(payload[: len(payload) - len(payload) % passed.itemsize])
                        fds.extend(passed)
            if not got:
                raise ConnectionError("daemon closed the shm socket")
            data += got
        return bytes(data)

    magic, version, op, flags, rid, code, meta_len, msg_len, length, csum = RESPONSE.unpack(
        exactly(RESPONSE.size)
    )
    if magic != RESPONSE_MAGIC or version != VERSION:
        raise ConnectionError(f"not a kvd answer (magic {bytes(magic)!r} v{version})")
    tail = exactly(meta_len + msg_len)
    message = tail[meta_len:].decode(errors="replace")
    return Answer(op, flags, rid, code, tail[:meta_len], message, length, csum)


def _close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _result(answer: Answer) -> ItemAnswer:
    return ItemAnswer(
        code=answer.code,
        message=answer.message,
        size=answer.length,
        checksum=answer.checksum,
        existed=bool(answer.flags & FLAG_EXISTED),
        meta=answer.meta,
        tier=answer.flags >> TIER_SHIFT,
    )


def lookup_answer(answer: Answer) -> LookupResult:
    """The result a LOOKUP answered, or its refusal raised."""
    if answer.code != 0:
        raise error_for(answer.code, answer.message)
    if answer.op != OP_LOOKUP or len(answer.meta) != LOOKUP_ANSWER.size:
        raise Unavailable("shm socket: a LOOKUP answer without its result")
    prefix_len, l1_hits, l2_hits, lease_ms, lease_id = LOOKUP_ANSWER.unpack(answer.meta)
    return LookupResult(prefix_len, l1_hits, l2_hits, lease_id, lease_ms)


def released(answer: Answer) -> bool:
    """Whether a RELEASE dropped a lease, or its refusal raised."""
    if answer.code != 0:
        raise error_for(answer.code, answer.message)
    return bool(answer.flags & FLAG_RELEASED)


def _exchange_one(conn: Connection, frame: bytes, payload: bytes = b"") -> Answer:
    conn.send([memoryview(frame), memoryview(payload)] if payload else [memoryview(frame)])
    answer = conn.answer()
    if answer.request_id != 0:
        raise ConnectionError(f"answer {answer.request_id} to request 0: out of order")
    return answer


def _get_many_frame(request: pb.GetIntoRegionRequest) -> bytes | None:
    """A batch get as one REGION_GET_MANY frame; None when its keys differ in width."""
    items = request.items
    joined = join_keys([item.key for item in items])
    if joined is None:
        return None
    width, keys = joined
    table = b"".join(MANY_ITEM.pack(item.offset, item.length) for item in items)
    payload = table + keys
    head = encode_request(
        OP_REGION_GET_MANY, 0, request.namespace.encode(), length=len(payload),
        flags=_deadline_flag(request.deadline_ns),
    )  # fmt: skip
    refs = _ref(request.region_id, 0, request.token, request.deadline_ns)
    return _with_ref(head, refs + MANY_REF.pack(len(items), width)) + payload


def exchange_batch(conn: Connection, frame: bytes, op: int) -> Answer:
    """Send one batch frame of ``op`` (request 0) and read its answer's
    header; a refusal of the whole frame raises."""
    conn.send([memoryview(frame)])
    answer = conn.answer()
    if answer.request_id != 0 or answer.op != op:
        raise ConnectionError(f"answer to op {answer.op} request {answer.request_id}: not ours")
    if answer.code != 0:
        raise error_for(answer.code, answer.message)
    return answer


def _exchange_many(conn: Connection, frame: bytes, count: int) -> list[ItemAnswer]:
    """Send one REGION_GET_MANY and read its answer's ``count`` results."""
    answer = exchange_batch(conn, frame, OP_REGION_GET_MANY)
    payload = bytearray(answer.length)
    conn.recv_into(memoryview(payload))
    results = []
    pos = 0
    for _ in range(count):
        code, flags, size, checksum, meta_len, msg_len = MANY_RESULT.unpack_from(payload, pos)
        pos += MANY_RESULT.size
        meta = bytes(payload[pos : pos + meta_len])
        message = payload[pos + meta_len : pos + meta_len + msg_len].decode(errors="replace")
        pos += meta_len + msg_len
        result = ItemAnswer(
            code, message, size, checksum, bool(flags & FLAG_EXISTED), meta, flags >> TIER_SHIFT
        )
        results.append(result)
    if pos != len(payload):
        raise ConnectionError(f"a batch answer of {len(payload)} bytes for {pos} of results")
    return results


def _deadline_flag(deadline_ns: int) -> int:
    return FLAG_DEADLINE if deadline_ns else 0


def _ref(region_id: int, offset: int, token: bytes, deadline_ns: int) -> bytes:
    """What follows a region op's header: its region, and its deadline if any."""
    ref = REGION_REF.pack(region_id, offset, token)
    return ref + DEADLINE.pack(deadline_ns) if deadline_ns else ref


def _with_ref(frame: bytes, ref: bytes) -> bytes:
    """The region reference goes right after the 40-byte header, before the names."""
    return frame[: REQUEST.size] + ref + frame[REQUEST.size :]


def _window(
    conn: Connection, frames: Sequence[bytes], start: int, end: int, out: list[Answer | None]
) -> None:
    sent = start
    for done in range(start, end):
        if sent < end and sent - done < PIPELINE_FRAMES:
            # A window in one send: the daemon reads the frames together and
            # starts their ops at once, so their copies run in parallel.
            top = min(end, done + PIPELINE_FRAMES)
            conn.send([memoryview(frame) for frame in frames[sent:top]])
            sent = top
        answer = conn.answer()
        if answer.request_id != done:
            raise ConnectionError(f"answer {answer.request_id} to request {done}: out of order")
        out[done] = answer
