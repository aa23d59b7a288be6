"""Fuzzing: generated and mutated input to every RPC, to the bulk TCP port,
and to the frame parsers in-process. The daemon must not crash, not hang,
and answer only with the documented codes.

- Every gRPC method gets hypothesis-generated messages, built from the
  proto descriptors (so a method added later is fuzzed too): odd strings,
  long and empty keys, edge-case integers, repeated fields up to a few
  items. Put gets a generated stream.
- Every unary method also gets mutated protobuf: valid requests, serialized,
  then bytes flipped, inserted, deleted, truncated, sent raw.
- The bulk port gets a HELLO then generated and mutated frames; so does
  the shm socket, with region ops naming a real region and wrong ones.
- In-process: the bulk request decoder, the L2 record header decoder and
  the client's Get stream assembler get mutated input at full speed.

``KVD_TEST_FUZZ_N`` is the total number of inputs (3000 in ``make test``,
10^6 in ``make test-fault``); most go to the in-process parsers, which run
~100x faster than a round trip.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.client import Client
from kvd.client.calls import GetAssembler
from kvd.l2 import format as l2format
from kvd.paths.bulk import server as bulk
from kvd.paths.shm.channel import REGION_REF
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import KvdError
from kvd.wire.grpc import KVStoreStub
from tests.paths.shm.support import RawRegion
from tests.support import DaemonProcess

FUZZ_N = int(os.environ.get("KVD_TEST_FUZZ_N", "3000"))
# Shares of FUZZ_N: round trips cost ~1 ms, in-process parses ~10 us.
GRPC_GENERATED = max(200, FUZZ_N // 50)
GRPC_MUTATED = max(200, FUZZ_N // 50)
BULK_FRAMES = max(100, FUZZ_N // 100)
SHM_FRAMES = max(100, FUZZ_N // 100)
IN_PROCESS = max(1000, FUZZ_N - GRPC_GENERATED - GRPC_MUTATED - BULK_FRAMES - SHM_FRAMES)
CALL_TIMEOUT_S = 5.0
# A mutated bulk frame may declare more bytes than it carries: the daemon
# then rightly waits for them (up to bulk_frame_timeout_ms), so the fuzzer
# gives such a connection up after this long and opens another.
ANSWER_WAIT_S = 0.25

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
}
ALLOWED_BULK = {bulk.CODE_BY_NAME[c.name] for c in ALLOWED if c.name in bulk.CODE_BY_NAME}
ALLOWED_BULK.add(bulk.CODE_OK)
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
UNARY = [m for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]
# 10^6 inputs take ~15 minutes on two cores; the suite's 5-minute default is for 3000.
pytestmark = [pytest.mark.fault, pytest.mark.timeout(300 + FUZZ_N // 500)]
HYPOTHESIS = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


# ---- strategies from descriptors ------------------------------------------------
EDGE_INTS = [0, 1, 2, 63, 64, 65, 4095, 4096, 65535, 65536, 2**31 - 1, 2**32 - 1, 2**63 - 1]
NAMESPACES = st.one_of(
    st.sampled_from(["fuzz", "", "a" * 256, "a" * 257, "x/y", "\x00", "ns\n", "é" * 200]),
    st.text(max_size=40),
)
KEYS = st.one_of(st.sampled_from([b"", b"k", b"\x00" * 64, b"k" * 65]), st.binary(max_size=80))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if field.name == "namespace":
        return NAMESPACES
    if t == FieldDescriptor.TYPE_BYTES:
        return KEYS if "key" in field.name or field.name == "parent" else st.binary(max_size=600)
    if t == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=80)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return st.sampled_from([v.number for v in field.enum_type.values])
    bits = 32 if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_INT32) else 64
    signed = t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64)
    top = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
    low = -(2 ** (bits - 1)) if signed else 0
    return st.one_of(st.sampled_from([v for v in EDGE_INTS if v <= top]), st.integers(low, top))


def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    cls: Any = pb.__dict__[descriptor.name]
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            assert field.message_type is not None
            if field.message_type.GetOptions().map_entry or depth > 2:
                continue
            inner = message_strategy(field.message_type, depth + 1)
            value: st.SearchStrategy[Any] = (
                st.lists(inner, max_size=4) if _repeated(field) else inner
            )
        else:
            value = _scalar(field)
            if _repeated(field):
                value = st.lists(value, max_size=6)
        fields[field.name] = st.none() | value

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Message:
        message = cls()
        for name, strategy in fields.items():
            value = draw(strategy)
            if value is None:
                continue
            target: Any = getattr(message, name)
            if isinstance(value, list):
                if value and isinstance(value[0], Message):
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif isinstance(value, Message):
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message  # type: ignore[no-any-return]

    return build()


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


# ---- mutation -------------------------------------------------------------------------
def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        action = rng.randrange(5)
        pos = rng.randrange(len(buf) + 1)
        if action == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif action == 1:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif action == 2 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        elif action == 3:
            del buf[pos:]
        elif buf:
            buf[min(pos, len(buf) - 1)] = rng.choice([0x00, 0x7F, 0x80, 0xFF])
    return bytes(buf)


# ---- gRPC -------------------------------------------------------------------------------
class Calls:
    """Counts answers by code; anything outside ALLOWED is kept for the failure message."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.bad: list[str] = []

    def record(self, method: str, code: grpc.StatusCode, details: str = "") -> None:
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        if code not in ALLOWED and len(self.bad) < 10:
            self.bad.append(f"{method}: {code.name} {details[:200]}")

    def call(self, method: str, invoke: Callable[[], Any]) -> None:
        try:
            result = invoke()
            if isinstance(result, Iterator):
                for _ in result:
                    pass
        except grpc.RpcError as exc:
            self.record(method, exc.code(), exc.details() or "")
            return
        self.record(method, grpc.StatusCode.OK)


def raw_method(channel: grpc.Channel, name: str) -> Callable[..., Any]:
    return channel.unary_unary(  # type: ignore[no-any-return]
        f"/kvd.v1.KVStore/{name}",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )


def check_alive(daemon: DaemonProcess) -> dict[str, Any]:
    assert daemon.alive(), "the daemon died:\n" + "\n".join(daemon.log[-30:])
    with Client(daemon.target, timeout_s=CALL_TIMEOUT_S) as client:
        client.put("fuzz-check", b"k", b"v" * 70_000)
        assert client.get("fuzz-check", b"k") == b"v" * 70_000
        return client.stats()


def fuzzer(
    calls: Calls, stub: Any, name: str, messages: st.SearchStrategy[Any], examples: int
) -> Callable[[], None]:
    @settings(HYPOTHESIS, max_examples=examples)
    @given(request=messages)
    def fuzz(request: Any) -> None:
        arg = iter(request) if isinstance(request, list) else request
        calls.call(name, lambda: stub(arg, timeout=CALL_TIMEOUT_S))

    return fuzz


def test_generated_requests_to_every_rpc(shared_daemon: DaemonProcess) -> None:
    calls = Calls()
    per_method = max(10, GRPC_GENERATED // (len(SERVICE.methods)))
    started = time.monotonic()
    with grpc.insecure_channel(shared_daemon.target) as channel:
        for method in SERVICE.methods:
            path = f"/kvd.v1.KVStore/{method.name}"
            input_type = method.input_type
            req_cls: Any = pb.__dict__[input_type.name]
            out_cls: Any = pb.__dict__[method.output_type.name]
            if method.client_streaming:
                stub = channel.stream_unary(path, req_cls.SerializeToString, out_cls.FromString)
                messages: st.SearchStrategy[Any] = st.lists(
                    message_strategy(input_type), min_size=0, max_size=4
                )
            elif method.server_streaming:
                stub = channel.unary_stream(path, req_cls.SerializeToString, out_cls.FromString)
                messages = message_strategy(input_type)
            else:
                stub = channel.unary_unary(path, req_cls.SerializeToString, out_cls.FromString)
                messages = message_strategy(input_type)

            fuzzer(calls, stub, method.name, messages, per_method)()
    stats = check_alive(shared_daemon)
    total = sum(calls.codes.values())
    print(f"\ngRPC generated: {total} calls in {time.monotonic() - started:.1f} s, {calls.codes}")
    assert not calls.bad, calls.bad
    assert calls.codes.get("DEADLINE_EXCEEDED", 0) == 0, "a cheap request hung"
    assert stats["inflight_bytes"] == 0


def valid_requests() -> dict[str, list[bytes]]:
    """A few valid serialized requests per unary method: the seeds to mutate."""
    ns, key = "fuzz", b"k" * 32
    seeds: dict[str, list[Message]] = {
        "BatchPut": [pb.BatchPutRequest(namespace=ns, items=[
            pb.PutItem(key=key, value=b"v" * 100, meta=b"m", parent=b"p", checksum=5),
            pb.PutItem(key=b"k2", value=b"w" * 10)], chained=True)],
        "BatchGet": [pb.BatchGetRequest(namespace=ns, keys=[key, b"x"], inline_bytes_max=9)],
        "Exists": [pb.ExistsRequest(namespace=ns, keys=[key, b"y"])],
        "Lookup": [pb.LookupRequest(namespace=ns, keys=[key, b"z"], lease_ms=100)],
        "Release": [pb.ReleaseRequest(namespace=ns, lease_id=1)],
        "Delete": [pb.DeleteRequest(namespace=ns, keys=[b"gone"]),
                   pb.DeleteRequest(namespace=ns + "-x", all_keys=True)],
        "Stats": [pb.StatsRequest(namespace=ns)],
        "AttachRegion": [pb.AttachRegionRequest(name="r1", size=1 << 20)],
        "DetachRegion": [pb.DetachRegionRequest(region_id=1, token=b"t" * 16)],
        "PutFromRegion": [pb.PutFromRegionRequest(region_id=1, namespace=ns, token=b"t",
                          items=[pb.RegionItem(key=key, offset=0, length=10)])],
        "GetIntoRegion": [pb.GetIntoRegionRequest(region_id=1, namespace=ns, token=b"t",
                          items=[pb.RegionItem(key=key, offset=4096, length=10)])],
        "DescribePaths": [pb.DescribePathsRequest()],
    }  # fmt: skip
    missing = {m.name for m in UNARY} - set(seeds)
    assert not missing, f"no seed request for {missing}"
    return {name: [m.SerializeToString() for m in msgs] for name, msgs in seeds.items()}


def send_mutated(daemon: DaemonProcess, count: int, decodable: bool) -> Calls:
    """``count`` mutated requests that do (or do not) parse as their message type."""
    rng = random.Random(7 + decodable)
    calls = Calls()
    seeds = valid_requests()
    names = sorted(seeds)
    sent = 0
    with grpc.insecure_channel(daemon.target) as channel:
        methods = {name: raw_method(channel, name) for name in names}
        for i in range(50 * count):
            if sent == count:
                break
            name = names[i % len(names)]
            data = mutate(rng.choice(seeds[name]), rng)
            try:
                pb.__dict__[f"{name}Request"].FromString(data)
                parses = True
            except DecodeError:
                parses = False
            if parses != decodable:
                continue
            sent += 1
            calls.call(name, partial(methods[name], data, timeout=CALL_TIMEOUT_S))
    assert sent == count
    return calls


def test_mutated_protobuf_to_every_unary_rpc(shared_daemon: DaemonProcess) -> None:
    calls = send_mutated(shared_daemon, GRPC_MUTATED, decodable=True)
    stats = check_alive(shared_daemon)
    print(f"\ngRPC mutated (still protobuf): {GRPC_MUTATED} calls, {calls.codes}")
    assert not calls.bad, calls.bad
    assert stats["inflight_bytes"] == 0


def test_undecodable_protobuf_is_invalid_argument(shared_daemon: DaemonProcess) -> None:
    calls = send_mutated(shared_daemon, max(50, GRPC_MUTATED // 4), decodable=False)
    check_alive(shared_daemon)
    assert set(calls.codes) == {"INVALID_ARGUMENT"}, calls.codes


# ---- bulk TCP -------------------------------------------------------------------------
def bulk_frames(rng: random.Random) -> bytes:
    ns = rng.choice([b"fuzz", b"", b"\xff\xfe", b"a" * 256, b"a" * 257])
    key = rng.choice([b"", b"k", b"k" * 64, b"k" * 65, rng.randbytes(8)])
    op = rng.choice([bulk.OP_GET, bulk.OP_PUT, bulk.OP_HELLO, 0, 9])
    length = (
        rng.choice([0, 1, 100, 5000, 1 << 40])
        if op != bulk.OP_PUT
        else rng.choice([0, 1, 100, 5000])
    )
    frame = bulk.encode_request(
        op, rng.randrange(1 << 64), ns, key, parent=rng.choice([b"", b"p"]),
        meta=rng.choice([b"", b"m" * 10]), length=length,
        checksum=rng.choice([None, 0, 12345]), durable=rng.random() < 0.2,
    )  # fmt: skip
    if op == bulk.OP_PUT:
        frame += rng.randbytes(length)
    return mutate(frame, rng) if rng.random() < 0.3 else frame


def test_bulk_frames(shared_daemon: DaemonProcess) -> None:
    rng = random.Random(11)
    sent, codes, closed = send_frames(
        lambda: socket.create_connection(("127.0.0.1", shared_daemon.bulk_port), 5),
        lambda: bulk_frames(rng),
        BULK_FRAMES,
        rng,
        shutdown_share=0.05,
    )
    stats = check_alive(shared_daemon)
    print(f"\nbulk frames: {sent} sent, answers by code {codes}, {closed} connections closed")
    assert stats["inflight_bytes"] == 0


def send_frames(
    connect: Callable[[], socket.socket],
    frame: Callable[[], bytes],
    count: int,
    rng: random.Random,
    shutdown_share: float = 0.0,
) -> tuple[int, dict[int, int], int]:
    """Send ``count`` frames after a HELLO per connection, reconnecting when the
    daemon closes one; every answer must carry a documented code. Returns
    (frames sent, answers by code, connections closed)."""
    codes: dict[int, int] = {}
    closed = sent = 0
    while sent < count:
        with connect() as sock:
            sock.settimeout(ANSWER_WAIT_S)
            sock.sendall(bulk.encode_request(bulk.OP_HELLO, 0))
            assert read_answer(sock) == bulk.CODE_OK
            for _ in range(20):  # frames per connection, until the daemon closes it
                sent += 1
                try:
                    sock.sendall(frame())
                    if shutdown_share and rng.random() < shutdown_share:
                        sock.shutdown(socket.SHUT_WR)
                    code = read_answer(sock)
                except (ConnectionError, TimeoutError, OSError):
                    code = None
                if code is None:
                    closed += 1
                    break
                codes[code] = codes.get(code, 0) + 1
                assert code in ALLOWED_BULK, f"answered code {code}"
    return sent, codes, closed


# ---- shm socket -----------------------------------------------------------------------
SHM_LENGTHS = (0, 1, 100, 5000, 1 << 20, 1 << 40, (1 << 64) - 1)


def shm_frames(rng: random.Random, region_id: int, token: bytes) -> bytes:
    """Region ops (and strays) with real and wrong region references."""
    strays = [bulk.OP_HELLO, bulk.OP_GET, 0, 9]  # each closes the connection
    ops = [bulk.OP_REGION_GET, bulk.OP_REGION_PUT]
    op = rng.choice(strays) if rng.random() < 0.1 else rng.choice(ops)
    frame = bulk.encode_request(
        op, rng.randrange(1 << 64), rng.choice([b"fuzz"] * 6 + [b"", b"\xff\xfe", b"a" * 257]),
        rng.choice([b"k", rng.randbytes(8)] * 3 + [b"", b"k" * 65]), parent=rng.choice([b"", b"p"]),
        meta=rng.choice([b"", b"m" * 10]), length=rng.choice(SHM_LENGTHS),
        checksum=rng.choice([None, 0, 12345]), durable=rng.random() < 0.2,
    )  # fmt: skip
    ref = REGION_REF.pack(
        rng.choice([region_id, region_id + 1, 0, (1 << 64) - 1]),
        rng.choice([0, 4096, (1 << 20) - 1, 1 << 40, (1 << 64) - 1]),
        rng.choice([token, b"x" * 16]),
    )
    frame = frame[: bulk.REQUEST.size] + ref + frame[bulk.REQUEST.size :]
    return mutate(frame, rng) if rng.random() < 0.3 else frame


def test_shm_socket_frames(shared_daemon: DaemonProcess) -> None:
    rng = random.Random(13)
    with grpc.insecure_channel(shared_daemon.socket_target) as channel:
        stub = KVStoreStub(channel)
        paths = stub.DescribePaths(pb.DescribePathsRequest())
        region = RawRegion(stub, paths.shm_dir, "fuzz-region", 1 << 20)

        def connect() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(paths.shm_socket)
            return sock

        sent, codes, closed = send_frames(
            connect, lambda: shm_frames(rng, region.region_id, region.token), SHM_FRAMES, rng
        )
        region.map[:4] = b"live"
        assert region.put(stub, b"after-fuzz", 0, 4) == 0  # the region still works
    stats = check_alive(shared_daemon)
    print(f"\nshm frames: {sent} sent, answers by code {codes}, {closed} connections closed")
    assert stats["inflight_bytes"] == 0


def read_answer(sock: socket.socket) -> int | None:
    """The next answer's code (its tail and payload read away); None when closed.

    A frame the daemon is still waiting on (a mutated length) times out here:
    the connection is then given up, like a client would."""
    header = _recv(sock, bulk.RESPONSE.size)
    if header is None:
        return None
    fields = bulk.RESPONSE.unpack(header)
    assert fields[0] == bulk.RESPONSE_MAGIC
    code, meta_len, msg_len, length = fields[5], fields[6], fields[7], fields[8]
    body = meta_len + msg_len + (length if code == bulk.CODE_OK and fields[2] == 3 else 0)
    if _recv(sock, body) is None:
        return None
    return int(code)


def _recv(sock: socket.socket, nbytes: int) -> bytes | None:
    out = bytearray()
    try:
        while len(out) < nbytes:
            chunk = sock.recv(nbytes - len(out))
            if not chunk:
                return None
            out += chunk
    except TimeoutError:
        return None
    return bytes(out)


# ---- in-process parsers -------------------------------------------------------------------
def test_frame_parsers_in_process() -> None:
    rng = random.Random(3)
    counts = {"bulk": 0, "l2": 0, "get_stream": 0}
    good_frame = bulk.encode_request(
        bulk.OP_PUT, 7, b"ns", b"key", parent=b"p", meta=b"m", length=10, checksum=1
    )[: bulk.REQUEST.size]
    header = l2format.RecordHeader("ns", b"key", b"parent", b"meta", 99, 5, 70_000, 1234)
    good_record = header.encode().ljust(l2format.HEADER_BYTES_MAX, b"\0")
    stream = [
        pb.GetResponse(header=pb.GetHeader(found=True, size=6, checksum=1), data=b"abc"),
        pb.GetResponse(data=b"def"),
    ]
    for i in range(IN_PROCESS):
        which = i % 3
        if which == 0:
            frame = mutate(good_frame, rng)[: bulk.REQUEST.size].ljust(bulk.REQUEST.size, b"\0")
            try:
                request = bulk.decode_request(frame, 1 << 20)
            except bulk.ProtocolError:
                pass
            else:
                assert request.op in bulk.OPS and request.tail_bytes <= 256 + 64 + 64 + 4096
            counts["bulk"] += 1
        elif which == 1:
            data = mutate(good_record, rng).ljust(l2format.HEADER_BYTES_MAX, b"\0")
            try:
                decoded = l2format.decode(data[: l2format.HEADER_BYTES_MAX])
            except l2format.HeaderError:
                pass
            else:
                assert decoded.header_bytes <= l2format.HEADER_BYTES_MAX
            counts["l2"] += 1
        else:
            assembler = GetAssembler(
                memoryview(bytearray(rng.choice([0, 3, 6, 64]))) if rng.random() < 0.5 else None
            )
            try:
                for message in stream[: rng.randint(0, 2)]:
                    raw = mutate(message.SerializeToString(), rng)
                    try:
                        parsed = pb.GetResponse.FromString(raw)
                    except DecodeError:
                        continue
                    if not assembler.feed(parsed):
                        break
                if assembler._into is None:
                    assembler.value()
                else:
                    assembler.size_into()
            except KvdError as exc:
                assert exc.code_name in {"DATA_LOSS", "INVALID_ARGUMENT"}, exc
            counts["get_stream"] += 1
    print(f"\nin-process parser inputs: {counts}")
    assert sum(counts.values()) == IN_PROCESS
