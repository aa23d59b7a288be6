"""The bulk TCP protocol's frames (docs/bulk-protocol.md): what the daemon
(``kvd.paths.bulk.server``, ``kvd.paths.shm.channel``) and the client (``kvd.client.bulk``)
agree on. Header layouts, ops, flags, codes, field limits, and the codec.
No field is ever deserialized into anything but bytes and integers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvd.wire.errors import CODE_NAMES, CODE_NUMBERS, error_number
from kvd.wire.limits import KEY_BYTES_MAX, META_BYTES_MAX, NAMESPACE_BYTES_MAX
from kvd.wire.lookup import ChainShare
from kvd.wire.shm import split_keys

VERSION = 1
REQUEST_MAGIC = b"KVDQ"
RESPONSE_MAGIC = b"KVDR"
# magic, version, op, flags, request_id, ns_len, key_len, parent_len, meta_len, length, checksum
REQUEST = struct.Struct("<4sBBHQHHHHQQ")
# magic, version, op, flags, request_id, code, meta_len, msg_len, length, checksum
RESPONSE = struct.Struct("<4sBBHQiHHQQ")
assert REQUEST.size == 40 and RESPONSE.size == 40

OP_HELLO = 1
OP_PUT = 2
OP_GET = 3
OPS = frozenset({OP_HELLO, OP_PUT, OP_GET})
# Pool peer ops, on the TCP port (kvd.paths.bulk.peer_ops; docs/bulk-protocol.md):
# the control step of a NIXL read between members.
OP_NIXL_META = 7  # answer payload: the daemon's NIXL agent metadata
OP_NIXL_PIN = 8  # ns, key: pin the value; answer payload NIXL_PIN then its segments
OP_NIXL_RELEASE = 9  # checksum field: the pin's lease id
# ns; payload EXISTS_REF, the keys, their chain positions: which keys the
# member holds (an Exists between members, without gRPC). Meta, optional:
# EXISTS_UNTOLD, the lookups untold before this chain (ChainShare.untold).
OP_PEER_EXISTS = 10
# No fields: the daemon's eviction plan, for the pool's members to keep
# blocks by (kvd.cluster.plans). Answer: meta the policy's name, payload the
# plan (at most PLAN_BYTES_MAX); NOT_FOUND while it has none.
OP_PEER_PLAN = 11
# ns; payload TELL_COUNT, then per share TELL_SHARE and a PEER_EXISTS payload
# of a chain's share: lookups of chains another member made, for this
# member's eviction policy to learn from in order. Never answered.
OP_PEER_TELL = 12
# ns, key; meta: the value's history in the sender's eviction policy
# (EvictionPolicy.history), for the PUT with FLAG_HOP of the same key that
# follows on the connection (kvd.cluster.rebalance). Never answered.
OP_PEER_HISTORY = 13
PEER_OPS = frozenset(
    {OP_NIXL_META, OP_NIXL_PIN, OP_NIXL_RELEASE, OP_PEER_EXISTS, OP_PEER_PLAN, OP_PEER_TELL,
     OP_PEER_HISTORY}
)  # fmt: skip
# DescribePathsResponse.bulk_ops of a daemon: the peer ops beyond the NIXL ones
# ("put": a PUT with FLAG_HOP is stored here and never handed on; "history":
# PEER_HISTORY).
BULK_OPS = ("exists", "plan", "tell", "put", "history")
TCP_OPS = OPS | PEER_OPS
# NIXL_PIN answer payload: value size, lease id, segment count; then per
# segment its address and length in the owner's registered pool arena.
NIXL_PIN = struct.Struct("<QQI")
NIXL_SEGMENT = struct.Struct("<QQ")
NIXL_SEGMENTS_MAX = 2048  # a 32 MiB value in 64 KiB pages is at most 512 runs
NIXL_META_BYTES_MAX = 1 << 20
# PEER_EXISTS payload: key width, key count, chain length (0: the keys are no
# chain's share); then the keys, each of the width, concatenated; then, with
# a chain length, each key's position in the chain (u32, increasing). The
# answer's payload: a byte per key, 0 where the member does not hold it, 1
# where it does, 2 where it does and keeps it for the asker's lookup hints
# (kvd.cluster.promises); a member older than 2 answers 1.
EXISTS_NOT_HELD, EXISTS_HELD, EXISTS_KEPT = 0, 1, 2
EXISTS_REF = struct.Struct("<III")
EXISTS_POSITION = struct.Struct("<I")
EXISTS_UNTOLD = struct.Struct("<I")
# PEER_TELL payload: the share count; per share the lookups untold before it
# (ChainShare.untold) and the length of its PEER_EXISTS payload, then that.
TELL_COUNT = struct.Struct("<I")
TELL_SHARE = struct.Struct("<II")
TELL_SHARES_MAX = 64  # shares in one PEER_TELL
# density's plan is 300 bytes; a plan is read into memory whole.
PLAN_BYTES_MAX = 1 << 16
# Region ops: only on the shm socket (kvd.paths.shm.channel), never on the TCP port.
OP_REGION_GET = 4
OP_REGION_PUT = 5

FLAG_DURABLE = 1  # request: acknowledge a put once it is on L2
FLAG_CHECKSUM = 2  # request: the checksum field is set; verify the payload against it
FLAG_EXISTED = 1  # response: the put's key already held these bytes
# Request: sent by another member of the pool (kvd.cluster.peer_bulk); the
# daemon answers it from what it holds and never asks a peer in turn. Bit 2
# is the shm socket's DEADLINE (kvd.wire.shm).
FLAG_HOP = 8
# Request, a PUT with FLAG_HOP: kept as this daemon's own, whichever member
# its placement names (a member leaving the pool hands its values on with
# it; the receiver owns them once the member is gone). Bit 4 is the shm
# socket's NO_ANSWER.
FLAG_KEEP = 32

TOKEN_BYTES_MAX = 4096
MESSAGE_BYTES_MAX = 1024
# Codes: the gRPC status numbers, from the one registry (kvd.wire.errors);
# the gRPC path reports the same ones.
CODE_BY_NAME = CODE_NUMBERS
NAME_BY_CODE = CODE_NAMES
CODE_OK = CODE_NUMBERS["OK"]
CODE_NOT_FOUND = CODE_NUMBERS["NOT_FOUND"]
CODE_RESOURCE_EXHAUSTED = CODE_NUMBERS["RESOURCE_EXHAUSTED"]
CODE_INTERNAL = CODE_NUMBERS["INTERNAL"]
error_code = error_number  # the status number an error is answered with


class ProtocolError(Exception):
    """The peer broke the framing; the connection is closed with this reason."""


@dataclass(frozen=True, slots=True)
class Request:
    op: int
    flags: int
    request_id: int
    ns_len: int
    key_len: int
    parent_len: int
    meta_len: int
    length: int
    checksum: int

    @property
    def tail_bytes(self) -> int:
        return self.ns_len + self.key_len + self.parent_len + self.meta_len


def encode_request(
    op: int,
    request_id: int,
    ns: bytes = b"",
    key: bytes = b"",
    *,
    parent: bytes = b"",
    meta: bytes = b"",
    length: int = 0,
    checksum: int | None = None,
    durable: bool = False,
    flags: int = 0,
) -> bytes:
    """Header and the variable fields; the payload (``length`` bytes) follows.
    ``flags``: more flags (the shm socket's), beside durable and checksum."""
    flags |= (FLAG_DURABLE if durable else 0) | (FLAG_CHECKSUM if checksum is not None else 0)
    fields = (ns, key, parent, meta)
    head = (REQUEST_MAGIC, VERSION, op, flags, request_id, *map(len, fields))
    return b"".join((REQUEST.pack(*head, length, checksum or 0), *fields))


def decode_request(
    data: bytes | bytearray | memoryview, max_value_bytes: int, ops: frozenset[int] = OPS
) -> Request:
    magic, version, op, flags, rid, ns_len, key_len, parent_len, meta_len, length, checksum = (
        REQUEST.unpack(data)
    )
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this daemon speaks {VERSION}")
    if op not in ops:
        raise ProtocolError(f"unknown op {op}")
    if ns_len > NAMESPACE_BYTES_MAX or key_len > KEY_BYTES_MAX or parent_len > KEY_BYTES_MAX:
        raise ProtocolError("namespace, key or parent longer than its limit")
    if meta_len > META_BYTES_MAX:
        raise ProtocolError(f"meta of {meta_len} bytes is over {META_BYTES_MAX}")
    if op in (OP_PUT, OP_REGION_PUT) and length > max_value_bytes:
        raise ProtocolError(f"value of {length} bytes is over max_value_bytes={max_value_bytes}")
    if op == OP_HELLO and length > TOKEN_BYTES_MAX:
        raise ProtocolError(f"hello token of {length} bytes is over {TOKEN_BYTES_MAX}")
    return Request(op, flags, rid, ns_len, key_len, parent_len, meta_len, length, checksum)


def encode_response(
    op: int,
    request_id: int,
    code: int = CODE_OK,
    *,
    flags: int = 0,
    meta: bytes = b"",
    message: str = "",
    length: int = 0,
    checksum: int = 0,
) -> bytes:
    text = message.encode()[:MESSAGE_BYTES_MAX]
    header = RESPONSE.pack(
        RESPONSE_MAGIC, VERSION, op, flags, request_id, code, len(meta), len(text), length, checksum
    )
    return b"".join((header, meta, text))


def split_tail(request: Request, tail: bytes) -> tuple[str, bytes, bytes, bytes]:
    """(namespace, key, parent, meta) from a request's variable fields."""
    a = request.ns_len
    b = a + request.key_len
    c = b + request.parent_len
    try:
        ns = tail[:a].decode()
    except UnicodeDecodeError:
        raise ProtocolError("namespace is not UTF-8") from None
    return ns, tail[a:b], tail[b:c], tail[c:]


def exists_payload_bytes_max(max_keys: int) -> int:
    """The most bytes a PEER_EXISTS payload of ``max_keys`` keys takes."""
    return EXISTS_REF.size + max_keys * (KEY_BYTES_MAX + EXISTS_POSITION.size)


def encode_exists(width: int, keys: bytes, chain: ChainShare | None) -> bytes:
    """A PEER_EXISTS payload: keys of ``width`` bytes, concatenated in
    ``keys`` (``kvd.wire.shm.join_keys``); ``chain`` where they are a chain's share."""
    length, positions = (chain.length, chain.positions) if chain is not None else (0, [])
    tail = struct.pack(f"<{len(positions)}I", *positions)
    return b"".join((EXISTS_REF.pack(width, len(keys) // width, length), keys, tail))


def exists_meta(chain: ChainShare | None) -> bytes:
    """A PEER_EXISTS request's meta: the untold lookups, where there are any."""
    return EXISTS_UNTOLD.pack(chain.untold) if chain is not None and chain.untold else b""


def decode_exists(payload: bytes, meta: bytes = b"") -> tuple[list[bytes], ChainShare | None]:
    """The keys of a PEER_EXISTS payload and, for a chain's share, where they
    lie in it and the lookups untold before it (``meta``); ValueError where
    its parts do not add up."""
    if meta and len(meta) != EXISTS_UNTOLD.size:
        raise ValueError(f"an exists meta of {len(meta)} bytes, not {EXISTS_UNTOLD.size}")
    untold = EXISTS_UNTOLD.unpack(meta)[0] if meta else 0
    if len(payload) < EXISTS_REF.size:
        raise ValueError(f"an exists payload of {len(payload)} bytes")
    width, count, length = EXISTS_REF.unpack_from(payload)
    if not 0 < width <= KEY_BYTES_MAX:
        raise ValueError(f"key width {width}, not 1..{KEY_BYTES_MAX}")
    keys_end = EXISTS_REF.size + width * count
    if len(payload) != keys_end + (EXISTS_POSITION.size * count if length else 0):
        raise ValueError(f"{count} keys of {width} bytes are not the payload's {len(payload)}")
    keys = split_keys(payload[EXISTS_REF.size : keys_end], width)
    if not length:
        return keys, None
    positions = list(struct.unpack_from(f"<{count}I", payload, keys_end))
    return keys, ChainShare(length, positions, untold)


def tell_payload_bytes_max(max_keys: int) -> int:
    """The most bytes a PEER_TELL payload of ``max_keys`` keys in all takes."""
    share_bytes = TELL_SHARE.size + EXISTS_REF.size
    return TELL_COUNT.size + TELL_SHARES_MAX * share_bytes + exists_payload_bytes_max(max_keys)


def encode_tell(shares: list[tuple[int, bytes, ChainShare]]) -> bytes:
    """A PEER_TELL payload: per share its key width, its keys concatenated
    (``kvd.wire.shm.join_keys``) and where they lie in their chain."""
    parts = [TELL_COUNT.pack(len(shares))]
    for width, keys, chain in shares:
        body = encode_exists(width, keys, chain)
        parts += [TELL_SHARE.pack(chain.untold, len(body)), body]
    return b"".join(parts)


def decode_tell(payload: bytes) -> list[tuple[list[bytes], ChainShare]]:
    """The chain shares of a PEER_TELL payload, in order; ValueError where
    its parts do not add up or a share is no chain's."""
    if len(payload) < TELL_COUNT.size:
        raise ValueError(f"a tell payload of {len(payload)} bytes")
    (count,) = TELL_COUNT.unpack_from(payload)
    if not 0 < count <= TELL_SHARES_MAX:
        raise ValueError(f"a tell of {count} shares, not 1..{TELL_SHARES_MAX}")
    shares = []
    at = TELL_COUNT.size
    for _ in range(count):
        if len(payload) < at + TELL_SHARE.size:
            raise ValueError("a tell payload cut short")
        untold, size = TELL_SHARE.unpack_from(payload, at)
        at += TELL_SHARE.size
        if len(payload) < at + size:
            raise ValueError("a tell payload cut short")
        keys, chain = decode_exists(payload[at : at + size], EXISTS_UNTOLD.pack(untold))
        if chain is None:
            raise ValueError("a tell's share is no chain's")
        shares.append((keys, chain))
        at += size
    if at != len(payload):
        raise ValueError(f"{len(payload) - at} bytes after a tell's shares")
    return shares
