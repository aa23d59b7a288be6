"""KV events in vLLM's format from a real daemon: a subscriber that binds
(as llm-d's indexer does) receives BlockStored / BlockRemoved /
AllBlocksCleared for puts, write-back to L2, eviction and delete, numbered
without gaps, and a replay request returns the batches it missed. The
payloads decode into vLLM's structs, declared here as vLLM declares them
(and, where the engine environment is built, into vLLM's own classes). A
publisher whose queue is full drops and counts, and never waits; with
``kv_events_namespaces`` only those namespaces' blocks are published."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvd.client import Client
from kvd.cluster.events import KvEventPublisher
from kvd.config.settings import ConfigError
from kvd.tools.bench.engine_proc import ENGINE_VENV
from tests.cluster.cluster import bound_subscriber, free_ports
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

VALUE_BYTES = 64 << 10
TOPIC = b"kv@node-a@kvd"
WAIT_S = 15.0


# ---- vLLM's structs (vllm/distributed/kv_events.py), as vLLM declares them ----
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass
class Stream:
    """What a subscriber saw: live messages and a replay from 0, by seq."""

    live: list[tuple[bytes, int, bytes]]
    replayed: dict[int, bytes]
    keys: list[bytes]
    deleted: bytes
    metrics_port: int
    evictions: float


def replay(endpoint: str, start: int, ctx: zmq.Context[Any]) -> dict[int, bytes]:
    """vLLM's replay protocol: send the start seq, read (seq, payload) until seq -1."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got: dict[int, bytes] = {}
        while dealer.poll(int(WAIT_S * 1000)):
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return got
            got[seq] = payload
        raise AssertionError("replay did not end with seq -1")
    finally:
        dealer.close()


def events_of(payloads: list[bytes]) -> list[Any]:
    return [event for payload in payloads for event in DECODER.decode(payload).events]


def stored_hashes(events: list[Any], medium: str) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockStored) and e.medium == medium
            for h in e.block_hashes]  # fmt: skip


def removed_hashes(events: list[Any], medium: str) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes]  # fmt: skip


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stream]:
    ctx: zmq.Context[Any] = zmq.Context()
    sub, endpoint = bound_subscriber(ctx, b"kv@")  # the daemon connects (llm-d's way)
    (replay_port,) = free_ports(1)
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    daemon = DaemonProcess(
        tmp_path_factory.mktemp("events"),
        ["--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay_endpoint,
         "--kv-events-topic", TOPIC.decode(), "--kv-events-block-size", "16"],
        dram="4MiB", max_value="1MiB",
    )  # fmt: skip
    live: list[tuple[bytes, int, bytes]] = []

    def receive(until_s: float) -> None:
        while sub.poll(int(max(0.0, until_s - time.monotonic()) * 1000)):
            topic, seq, payload = sub.recv_multipart()
            live.append((topic, int.from_bytes(seq, "big"), payload))
            if time.monotonic() > until_s:
                return

    try:
        client = Client(daemon.target, timeout_s=10)
        # The subscription reaches the daemon's PUB socket some ms after it
        # connects (ZMQ's slow joiner): put probes until one is seen live.
        deadline = time.monotonic() + WAIT_S
        probes = 0
        while not live and time.monotonic() < deadline:
            client.put("events", b"probe-%d" % probes, b"p" * 100)
            probes += 1
            receive(time.monotonic() + 0.2)
        keys = [f"chain-{i:03d}".encode() for i in range(120)]
        parent = None
        for key in keys:  # 120 x 64 KiB through a 4 MiB L1: evictions once on L2
            client.put("events", key, key * (VALUE_BYTES // len(key)), parent=parent)
            parent = key
        deleted = keys[2]
        assert client.delete("events", [deleted]) == 1
        # Wait until the delete's L2 removal and the last key's write-back
        # (write-back goes in put order) have been seen live.
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            receive(time.monotonic() + 0.2)
            seen = events_of([p for _, _, p in live])
            if deleted in removed_hashes(seen, "STORAGE") and keys[-1] in stored_hashes(
                seen, "STORAGE"
            ):
                break
        client.close()
        replayed = replay(replay_endpoint, 0, ctx)
        evictions = metric(daemon.metrics_port, "kvd_evictions_total")
        yield Stream(live, replayed, keys, deleted, daemon.metrics_port, evictions)
    finally:
        daemon.discard()
        sub.close()
        ctx.term()


def test_live_messages_are_numbered_without_gaps_and_match_the_replay(stream: Stream) -> None:
    assert stream.live, "no event message received"
    seqs = [seq for _, seq, _ in stream.live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert {topic for topic, _, _ in stream.live} == {TOPIC}
    assert sorted(stream.replayed) == list(range(len(stream.replayed)))
    for _, seq, payload in stream.live:
        assert stream.replayed[seq] == payload
    # What the slow joiner missed live, the replay gave: the batch of seq 0
    # opens with AllBlocksCleared (the daemon held nothing it had announced).
    first = DECODER.decode(stream.replayed[0]).events
    assert isinstance(first[0], AllBlocksCleared)


def test_puts_write_back_eviction_and_delete_are_reported(stream: Stream) -> None:
    events = events_of([stream.replayed[seq] for seq in sorted(stream.replayed)])
    l1_stored = stored_hashes(events, "CPU")
    assert set(stream.keys) <= set(l1_stored)
    assert set(stream.keys) <= set(stored_hashes(events, "STORAGE"))  # written back
    l1_removed = removed_hashes(events, "CPU")
    assert stream.deleted in l1_removed and stream.deleted in removed_hashes(events, "STORAGE")
    evicted = set(l1_removed) - {stream.deleted}
    assert stream.evictions > 0 and evicted, "no eviction reported"
    assert not evicted & set(removed_hashes(events, "STORAGE"))  # evicted from L1, kept on L2
    parent_of: dict[bytes | int, bytes | int | None] = {}
    for event in events:
        if isinstance(event, BlockStored):
            assert event.token_ids == [] and event.block_size == 16
            assert event.lora_id is None and event.lora_name is None
            parent_of[event.block_hashes[0]] = event.parent_block_hash
            for before, after in zip(event.block_hashes, event.block_hashes[1:], strict=False):
                parent_of[after] = before
    assert parent_of[stream.keys[0]] is None
    for before, after in zip(stream.keys, stream.keys[1:], strict=False):
        assert parent_of[after] == before


def test_metrics_count_what_was_sent(stream: Stream) -> None:
    sent = metric(stream.metrics_port, "kvd_kv_events_sent_total")
    assert sent >= len(events_of(list(stream.replayed.values())))
    assert metric(stream.metrics_port, "kvd_kv_events_dropped_total") == 0


@pytest.mark.slow  # importing vLLM takes 10-40 s
@pytest.mark.timeout(300)
def test_payloads_decode_with_vllms_own_classes(stream: Stream, tmp_path: Path) -> None:
    python = ENGINE_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no engine environment at {ENGINE_VENV} (make engine-env builds it)")
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps([stream.replayed[s].hex() for s in sorted(stream.replayed)]))
    script = (
        "import json, sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "decoder = msgspec.msgpack.Decoder(KVEventBatch)\n"
        "kinds = {}\n"
        "for text in json.load(open(sys.argv[1])):\n"
        "    for event in decoder.decode(bytes.fromhex(text)).events:\n"
        "        kinds[type(event).__name__] = kinds.get(type(event).__name__, 0) + 1\n"
        "print(json.dumps(kinds))\n"
    )
    done = subprocess.run([str(python), "-c", script, str(payloads)], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = json.loads(done.stdout.strip().splitlines()[-1])
    assert kinds.get("BlockStored") and kinds.get("BlockRemoved") and kinds.get("AllBlocksCleared")


def test_only_the_namespaces_named_are_published(tmp_path: Path) -> None:
    """With ``kv_events_namespaces``, a router sees the blocks of those
    namespaces only: another tenant's keys never appear in the events."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub, endpoint = bound_subscriber(ctx)
    daemon = DaemonProcess(tmp_path, ["--kv-events-endpoint", endpoint,
                                      "--kv-events-namespaces", "team-a/*",
                                      "--kv-events-namespaces", "shared"])  # fmt: skip
    seen: list[bytes] = []

    def receive_until(key: bytes) -> bool:
        deadline = time.monotonic() + WAIT_S
        while key not in seen and sub.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            _, _, payload = sub.recv_multipart()
            seen.extend(stored_hashes(events_of([payload]), "CPU"))
        return key in seen

    try:
        with Client(daemon.target, timeout_s=10) as client:
            probes = 0  # until the subscription reached the daemon (ZMQ's slow joiner)
            while not seen and probes < 100:
                client.put("team-a/x", b"probe-%d" % probes, b"p" * 100)
                probes += 1
                receive_until(b"probe-%d" % (probes - 1))
            assert seen, "no event message received"
            others = [b"b-%d" % i for i in range(20)]
            for key in others:
                client.put("team-b/x", key, b"v" * 100)  # not named
                client.put("team-a", key + b"-prefix", b"v" * 100)  # "team-a/*" is a prefix
            client.put("shared", b"s-0", b"v" * 100)
            client.put("team-a/y", b"a-last", b"v" * 100)
            assert receive_until(b"a-last") and b"s-0" in seen
        assert not [key for key in seen if key.startswith(b"b-")], seen
    finally:
        daemon.discard()
        sub.close()
        ctx.term()


def test_a_full_queue_drops_and_counts_and_replay_ignores_garbage() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    (pub_port, replay_port) = free_ports(2)
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{pub_port}", replay_endpoint, "t",
                                 encoding="array", queue_batches=2)  # fmt: skip
    try:
        # No sender thread yet: the queue takes two batches, the rest are
        # dropped at once (the loop never waits for a subscriber).
        began = time.monotonic()
        for i in range(5):
            publisher.stored(b"k%d" % i, None, "CPU")
            publisher.removed(b"old%d" % i, "CPU")
            publisher.flush()
        assert time.monotonic() - began < 1.0
        assert publisher.stats()["events_dropped"] == 6 and publisher.stats()["queue_batches"] == 2
        publisher.start()
        # The sender answers a replay between two batches: the replay below
        # is of both once both are sent (the machine may be slow to send).
        assert wait_until(lambda: publisher.stats()["batches_sent"] == 2)
        garbage = ctx.socket(zmq.DEALER)
        garbage.setsockopt(zmq.LINGER, 0)
        garbage.connect(replay_endpoint)
        garbage.send_multipart((b"", b"not a seq"))
        got = replay(replay_endpoint, 0, ctx)
        garbage.close()
        assert sorted(got) == [0, 1]
        # "array": each event a positional array opening with its tag, as older vLLM sent.
        batch = msgspec.msgpack.decode(got[1])
        assert batch[1] == [
            ["BlockStored", [b"k1"], None, [], 0, None, "CPU", None],
            ["BlockRemoved", [b"old1"], "CPU"],
        ]
        # A chain stored in one batch is one BlockStored, as vLLM reports a chain;
        # removals of one medium in a row are one BlockRemoved.
        publisher.stored(b"c0", None, "CPU")
        publisher.stored(b"c1", b"c0", "CPU")
        publisher.stored(b"c2", b"c1", "CPU")
        publisher.stored(b"x", b"elsewhere", "CPU")
        publisher.removed(b"c0", "STORAGE")
        publisher.removed(b"c1", "STORAGE")
        publisher.cleared()
        publisher.flush()
        deadline = time.monotonic() + WAIT_S
        while 2 not in (got := replay(replay_endpoint, 2, ctx)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert msgspec.msgpack.decode(got[2])[1] == [
            ["BlockStored", [b"c0", b"c1", b"c2"], None, [], 0, None, "CPU", None],
            ["BlockStored", [b"x"], b"elsewhere", [], 0, None, "CPU", None],
            ["BlockRemoved", [b"c0", b"c1"], "STORAGE"],
            ["AllBlocksCleared"],
        ]
        assert publisher.stats()["replays"] >= 2
    finally:
        publisher.close()
        ctx.term()


def test_an_endpoint_zmq_cannot_open_is_a_config_error() -> None:
    publisher = KvEventPublisher("tcp-but-not-an-endpoint")
    with pytest.raises(ConfigError, match="kv_events_endpoint: cannot open"):
        publisher.start()
    publisher.close()
