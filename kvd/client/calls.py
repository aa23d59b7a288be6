"""Wire helpers of the client library: request building, response
checking (checksums, stream assembly) and error mapping, shared by the
blocking ``Client`` and the ``AsyncClient`` in ``kvd.client.clients``.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from kvd.util.memfile import load_chain
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.checksum import checksum
from kvd.wire.errors import (
    BY_CODE_NAME,
    DataLoss,
    InvalidArgument,
    KvdError,
    ResourceExhausted,
    code_name,
    error_class,
)
from kvd.wire.lookup import LookupResult

DEFAULT_TIMEOUT_S = 5.0
# Streamed puts send 1 MiB messages: gRPC Python's sweet spot here
# (~0.9 GB/s, against ~0.1 GB/s at 64 KiB and ~0.16 GB/s at 32 MiB).
CHUNK_BYTES = 1 << 20
# Values up to this size travel in BatchPut/BatchGet, up to this many per call.
BATCH_VALUE_BYTES_MAX = 1 << 20
# get() asks for values up to this size in one unary call and streams larger
# ones: a unary call costs ~half a stream's fixed overhead (64 KiB: ~0.13 vs
# ~0.08 GB/s here), while above 1 MiB streamed messages win.
INLINE_GET_BYTES_MAX = 1 << 20
BATCH_BYTES_MAX = 8 << 20
# A put_many goes over the bulk TCP port (when the daemon has one) if any of
# its values is this large. Single puts and gets always do: a 1 KiB put took
# 0.27 ms there against 0.88 ms as a gRPC call on the 2-CPU VM. But one
# BatchPut of 64 values of 1 KiB took 3.2 ms against 6.2 ms as bulk frames
# (16 KiB: 7.9 against 5.9 ms), so small values stay in gRPC batches.
BULK_THRESHOLD_BYTES = 64 << 10
BATCH_ITEMS_MAX = 256
MESSAGE_BYTES_MAX = 1 << 30
# gRPC's default reconnect backoff grows to 120 s: a client that called a
# daemon while it restarted would then fail fast for up to two minutes after
# it came back. Capped at 1 s, a restarted daemon is reached again within a
# second, for one connection attempt a second while it is down. (Not
# grpc.min_reconnect_backoff_ms: gRPC takes it as each connection attempt's
# timeout, 20 s by default; at 100 ms a briefly stopped daemon failed calls
# after it came back.)
RECONNECT_BACKOFF_MS_MAX = 1000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
    ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS_MAX),
]

Buffer = bytes | bytearray | memoryview
PutItemLike = tuple[bytes, Buffer] | tuple[bytes, Buffer, bytes]


@dataclass(frozen=True)
class Tls:
    """TLS to a daemon's gRPC TCP listener (the daemon's ``tls_cert_file``): the
    CA bundle to trust (None: the system's roots) and, where the daemon asks
    for client certificates (``tls_client_ca_file``), this client's
    certificate chain and key, PEM files all."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def _check_pair(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("tls: cert_file and key_file go together")

    def context(self) -> ssl.SSLContext:
        """The same files for the bulk TCP port, where the daemon's takes TLS
        (``bulk_tls``): its certificate checked against ``ca_file`` (the
        system's roots without one) and the host's name."""
        ca, cert, key = self._files()
        try:
            context = ssl.create_default_context(
                cadata=None if ca is None else ca.decode("latin-1")
            )
        except (ValueError, ssl.SSLError) as exc:
            raise InvalidArgument(f"tls ca_file {self.ca_file}: {exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert is not None and key is not None:
            load_chain(context, cert, key)  # the bytes _files checked
        return context

    def credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self._files()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def _files(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The CA bundle, certificate chain and key, each read once; the chain
        and key checked together, so gRPC never gets a key without the
        certificate it goes with (a file caught half-rewritten: gRPC aborts
        the process on that)."""
        self._check_pair()
        ca, cert, key = (_pem(path, name) for path, name in
                         ((self.ca_file, "ca_file"), (self.cert_file, "cert_file"),
                          (self.key_file, "key_file")))  # fmt: skip
        if cert is not None and key is not None:
            try:
                load_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert, key)
            except (OSError, ssl.SSLError) as exc:
                raise InvalidArgument(
                    f"tls cert_file {self.cert_file} with key_file {self.key_file}: {exc}"
                ) from None
        return ca, cert, key


def _pem(path: str | None, name: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"tls {name} {path}: {exc.strerror}") from None


def open_channel(target: str, tls: Tls | None, *, aio: bool = False) -> Any:
    """A gRPC channel to ``target``: plain, or TLS (TCP targets only: a Unix
    socket is served without TLS, it never leaves the node)."""
    address = grpc_target(target)
    if tls is None:
        plain = grpc.aio.insecure_channel if aio else grpc.insecure_channel
        return plain(address, options=CHANNEL_OPTIONS)
    if address.startswith("unix:"):
        raise InvalidArgument("tls is for TCP targets: the Unix socket is served without TLS")
    secure = grpc.aio.secure_channel if aio else grpc.secure_channel
    return secure(address, tls.credentials(), options=CHANNEL_OPTIONS)


def grpc_target(target: str) -> str:
    if target.startswith("kvd://"):
        return target[len("kvd://") :]
    return target


def raise_for(error: grpc.RpcError) -> NoReturn:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    cls = BY_CODE_NAME.get(name, KvdError)
    raise cls(f"{name}: {details}") from None


def metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def put_requests(
    ns: str, key: bytes, value: Buffer, meta: bytes, parent: bytes | None, durable: bool
) -> Iterator[pb.PutRequest]:
    view = memoryview(value).cast("B")
    header = pb.PutHeader(
        namespace=ns,
        key=key,
        size=len(view),
        checksum=checksum(view),
        meta=meta,
        parent=parent or b"",
        durable=durable,
    )
    if len(view) <= CHUNK_BYTES:
        data = value if isinstance(value, bytes) else bytes(view)
        yield pb.PutRequest(header=header, data=data)
        return
    yield pb.PutRequest(header=header, data=bytes(view[:CHUNK_BYTES]))
    for offset in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        yield pb.PutRequest(data=bytes(view[offset : offset + CHUNK_BYTES]))


class GetAssembler:
    """Collects a Get stream into bytes, or into the caller's buffer."""

    def __init__(self, into: memoryview | None = None) -> None:
        self.header: pb.GetHeader | None = None
        self._into = into
        self._parts: list[bytes] = []
        self.received = 0

    def feed(self, response: pb.GetResponse) -> bool:
        """Take one message; False once the header says miss."""
        if self.header is None:
            if not response.HasField("header"):
                raise DataLoss("Get stream without a header")
            self.header = response.header
            if not self.header.found:
                return False
            if self._into is not None and self.header.size > len(self._into):
                raise InvalidArgument(
                    f"buffer of {len(self._into)} bytes is too small for {self.header.size}"
                )
        data = response.data
        if self.received + len(data) > self.header.size:
            raise DataLoss("Get stream longer than its header")
        if self._into is not None:
            self._into[self.received : self.received + len(data)] = data
        else:
            self._parts.append(data)
        self.received += len(data)
        return True

    def _check(self, data: Buffer) -> None:
        assert self.header is not None
        if self.received != self.header.size:
            raise DataLoss(f"Get stream ended at {self.received} of {self.header.size} bytes")
        if checksum(data) != self.header.checksum:
            raise DataLoss("value does not match its checksum")

    def value(self) -> bytes | None:
        if self.header is None or not self.header.found:
            return None
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._check(data)
        return data

    def size_into(self) -> int | None:
        if self.header is None or not self.header.found:
            return None
        assert self._into is not None
        self._check(self._into[: self.received])
        return self.received


def put_items(items: Iterable[PutItemLike]) -> list[tuple[bytes, memoryview, bytes]]:
    out = []
    for item in items:
        meta = item[2] if len(item) == 3 else b""
        out.append((item[0], memoryview(item[1]).cast("B"), meta))
    return out


def batches(
    items: list[tuple[bytes, memoryview, bytes]],
) -> Iterator[tuple[int, list[tuple[bytes, memoryview, bytes]]]]:
    """(first index, items) groups for BatchPut; big values come alone, to be streamed."""
    start, group_bytes = 0, 0
    group: list[tuple[bytes, memoryview, bytes]] = []
    for i, item in enumerate(items):
        size = len(item[1])
        if (
            size > BATCH_VALUE_BYTES_MAX
            or len(group) >= BATCH_ITEMS_MAX
            or (group and group_bytes + size > BATCH_BYTES_MAX)
        ):
            if group:
                yield start, group
            start, group, group_bytes = i, [], 0
        group.append(item)
        group_bytes += size
        if size > BATCH_VALUE_BYTES_MAX:
            yield start, group
            start, group, group_bytes = i + 1, [], 0
    if group:
        yield start, group


def batch_put_request(
    ns: str, group: list[tuple[bytes, memoryview, bytes]], parent: bytes | None, chained: bool
) -> pb.BatchPutRequest:
    items = []
    for i, (key, value, meta) in enumerate(group):
        item_parent = parent if (chained and i == 0 and parent) else b""
        items.append(
            pb.PutItem(
                key=key, value=bytes(value), meta=meta, parent=item_parent, checksum=checksum(value)
            )
        )
    return pb.BatchPutRequest(namespace=ns, items=items, chained=chained)


def batch_put_result(response: pb.BatchPutResponse, first: int) -> list[bool]:
    existed = []
    for i, status in enumerate(response.statuses):
        if status.code != 0:
            name = code_name(status.code)
            raise error_class(status.code)(f"item {first + i}: {name}: {status.message}")
        existed.append(status.existed)
    return existed


def batch_get_item(item: pb.GetItem) -> bytes | type[ResourceExhausted] | None:
    if item.code != 0:
        return ResourceExhausted  # too large for one response: fetch it alone
    if not item.found:
        return None
    if checksum(item.value) != item.checksum:
        raise DataLoss("value does not match its checksum")
    return item.value


def single_get_request(ns: str, key: bytes) -> pb.BatchGetRequest:
    return pb.BatchGetRequest(namespace=ns, keys=[key], inline_bytes_max=INLINE_GET_BYTES_MAX)


def copy_into(value: bytes | None, buffer: Buffer) -> int | None:
    if value is None:
        return None
    view = memoryview(buffer).cast("B")
    if len(value) > len(view):
        raise InvalidArgument(f"buffer of {len(view)} bytes is too small for {len(value)}")
    view[: len(value)] = value
    return len(value)


def small_put_request(
    ns: str, key: bytes, value: Buffer, meta: bytes, parent: bytes | None, durable: bool
) -> pb.BatchPutRequest | None:
    """A one-item BatchPut for a small value (one unary call), else None."""
    view = memoryview(value).cast("B")
    if len(view) > BATCH_VALUE_BYTES_MAX:
        return None
    data = value if isinstance(value, bytes) else bytes(view)
    item = pb.PutItem(key=key, value=data, meta=meta, parent=parent or b"", checksum=checksum(view))
    return pb.BatchPutRequest(namespace=ns, items=[item], durable=durable)


def lookup_result(response: pb.LookupResponse) -> LookupResult:
    return LookupResult(
        response.prefix_len,
        response.l1_hits,
        response.l2_hits,
        response.lease_id,
        response.lease_expires_ms,
    )


def stats_dict(response: pb.StatsResponse) -> dict[str, Any]:
    out: dict[str, Any] = dict(response.values)
    out["version"] = response.version
    out["namespaces_detail"] = [
        {"name": n.name, "entries": n.entries, "bytes": n.bytes, "hits": n.hits, "misses": n.misses}
        for n in response.namespaces
    ]
    return out
