"""Publishes the store's changes as vLLM KV events over ZMQ, never holding
up the event loop.

The store's L1 index and L2 tier call the publisher's hooks on the loop
(``watch``): each change of a namespace ``kv_events_namespaces`` names (all,
by default) is appended to the open batch, and the batch is
closed at the end of the loop iteration (``call_soon``) or at
``EVENTS_PER_BATCH_MAX`` changes, so one burst of puts is one message. A
closed batch goes into a queue of ``kv_events_queue_batches``; when it is
full the batch is dropped and counted (``kvd_kv_events_dropped``), never
waited for.

One thread owns the ZMQ sockets (they are not thread-safe): it encodes a
batch (``kvd.cluster.events.wire``), numbers it (0, 1, 2, ... with no gap:
a dropped batch never got a number), sends ``(topic, seq, payload)`` on the
PUB socket and keeps the last ``kv_events_replay_batches`` for replay. A PUB
socket never blocks: a slow or absent subscriber loses messages past the
socket's high-water mark, which is ZMQ's contract and vLLM's. The ROUTER
replay socket answers a request ``(identity, b"", start seq as 8 bytes
big-endian)`` with every buffered ``(seq, payload)`` from ``start`` on,
then ``(-1, b"")``, as vLLM's publisher does.

Endpoints follow vLLM's rule: one with ``*``, ``::``, ``ipc://`` or
``inproc://`` is bound, any other connected to (a subscriber that binds,
as llm-d's indexer does).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvd.cluster.events.wire import (
    CLEARED,
    MEDIUM_L1,
    MEDIUM_L2,
    REMOVED,
    STORED,
    Change,
    EventBatch,
    EventTypes,
)
from kvd.config.settings import Config, ConfigError
from kvd.util.namespaces import matches

if TYPE_CHECKING:
    from kvd.l2.records import L2Record
    from kvd.store.index import Entry
    from kvd.store.store import Store

log = logging.getLogger("kvd.cluster.events")

# A BlockStored of one 32-byte key packs to ~110 bytes as a map: 256 changes
# make a message of ~28 KiB, and the default replay buffer (1,000 batches)
# holds at most ~28 MiB.
EVENTS_PER_BATCH_MAX = 256
# Messages the PUB socket queues per subscriber before it drops (ZMQ's
# SNDHWM): ~28 MiB of full batches per slow subscriber.
PUB_HWM = 1_000
# How long start waits for the sockets, and close for the thread to send
# what is queued.
START_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0
# The sender thread looks at the replay socket at least this often.
POLL_S = 0.05
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Namespaces whose match against kv_events_namespaces is remembered; past
# it the answers are forgotten and worked out again.
NAMED_MAX = 4096

KV_EVENTS_GAUGES = {
    "queue_batches": ("kvd_kv_events_queue", "KV event batches waiting to be sent"),
}
KV_EVENTS_COUNTERS = {
    "events_sent": ("kvd_kv_events_sent", "KV events sent (BlockStored, BlockRemoved, ...)"),
    "batches_sent": ("kvd_kv_events_batches_sent", "KV event messages sent"),
    "events_dropped": (
        "kvd_kv_events_dropped",
        "KV events dropped: the send queue was full (the subscriber never sees them)",
    ),
    "replays": ("kvd_kv_events_replays", "Replay requests answered"),
}


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc or inproc endpoint; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """The open batch and the queue (loop side); the sockets (thread side)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        encoding: str = "map",
        block_size: int = 0,
        queue_batches: int = 1_024,
        replay_batches: int = 1_000,
        namespaces: tuple[str, ...] = (),
    ) -> None:
        """``namespaces``: the patterns of the namespaces whose blocks the
        events name (``kvd.util.namespaces``); empty: every namespace."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.types = EventTypes(encoding)
        self.block_size = block_size
        self.replay_batches = replay_batches
        self.namespaces = namespaces
        self._named: dict[str, bool] = {}  # whether each namespace seen is named
        self._queue: queue.Queue[list[Change] | None] = queue.Queue(maxsize=queue_batches)
        self._open: list[Change] = []
        self._flush_due = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self.events_dropped = 0
        self.batches_dropped = 0
        # Written by the thread only; read by the metrics thread.
        self.events_sent = 0
        self.batches_sent = 0
        self.replays = 0

    @classmethod
    def from_config(cls, config: Config) -> KvEventPublisher:
        return cls(
            config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic,
            config.kv_events_encoding, config.kv_events_block_size,
            config.kv_events_queue_batches, config.kv_events_replay_batches,
            config.kv_events_namespaces,
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        return {
            "queue_batches": self._queue.qsize(),
            "events_sent": self.events_sent,
            "batches_sent": self.batches_sent,
            "events_dropped": self.events_dropped,
            "replays": self.replays,
        }

    # ---- the loop's side -------------------------------------------------------
    def stored(self, key: bytes, parent: bytes | None, medium: str) -> None:
        self._note((STORED, key, parent or None, medium))

    def removed(self, key: bytes, medium: str) -> None:
        self._note((REMOVED, key, None, medium))

    def cleared(self) -> None:
        self._note((CLEARED, b"", None, ""))

    def _note(self, change: Change) -> None:
        self._open.append(change)
        if len(self._open) >= EVENTS_PER_BATCH_MAX:
            self.flush()
        elif not self._flush_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # before the loop runs: start() flushes
                return
            self._flush_due = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Close the open batch: queue it, or drop and count it when the queue is full."""
        self._flush_due = False
        if not self._open:
            return
        batch, self._open = self._open, []
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.batches_dropped += 1
            self.events_dropped += len(batch)

    # ---- the store's hooks -----------------------------------------------------
    def watch(self, store: Store) -> None:
        """Hook into the store's L1 index and L2 tier, after an ``AllBlocksCleared``
        (a consumer forgets what this daemon held before it started)."""
        self.cleared()
        store.entries.on_link = self._linked
        store.entries.on_unlink = self._unlinked
        if store.l2 is not None:
            store.l2.on_record = self._recorded

    def _linked(self, entry: Entry) -> None:
        if not self.namespaces or self._is_named(entry.ns.name):
            self.stored(entry.key, entry.parent, MEDIUM_L1)

    def _unlinked(self, entry: Entry) -> None:
        if not self.namespaces or self._is_named(entry.ns.name):
            self.removed(entry.key, MEDIUM_L1)

    def _recorded(self, record: L2Record, present: bool) -> None:
        if self.namespaces and not self._is_named(record.namespace):
            return
        if present:
            self.stored(record.key, record.parent, MEDIUM_L2)
        else:
            self.removed(record.key, MEDIUM_L2)

    def _is_named(self, namespace: str) -> bool:
        """Whether ``kv_events_namespaces`` names ``namespace`` (remembered,
        for up to ``NAMED_MAX`` namespaces)."""
        named = self._named.get(namespace)
        if named is None:
            if len(self._named) >= NAMED_MAX:
                self._named.clear()
            named = self._named[namespace] = matches(self.namespaces, namespace)
        return named

    # ---- the thread ------------------------------------------------------------
    def start(self) -> None:
        """Open the sockets in the sender thread; ConfigError when they cannot be."""
        self.flush()
        self._thread = threading.Thread(target=self._run, name="kvd-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            self._stop.set()
            raise ConfigError(
                f"kv_events_endpoint: cannot open {self.endpoint} / "
                f"{self.replay_endpoint or '-'}: {self._error or 'no answer'}",
                key="kv_events_endpoint",
            )
        log.info(
            "KV events publishing",
            extra={
                "endpoint": self.endpoint, "mode": "bind" if binds(self.endpoint) else "connect",
                "replay": self.replay_endpoint, "topic": self.topic.decode(),
            },
        )  # fmt: skip

    def close(self) -> None:
        """Send what is queued (up to ``CLOSE_TIMEOUT_S``), then close the sockets."""
        self.flush()
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S + START_TIMEOUT_S)

    def _run(self) -> None:
        context = zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        try:
            pub = context.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint) if binds(self.endpoint) else pub.connect(self.endpoint)
            replay: zmq.Socket[bytes] | None = None
            if self.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            for sock in sockets:
                sock.close(linger=0)
            context.term()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        finally:
            for sock in sockets:
                sock.close(linger=0)
            context.term()

    def _serve(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        encoder = msgspec.msgpack.Encoder()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.replay_batches)
        seqs = itertools.count()
        stop_at: float | None = None
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._answer_replay(replay, buffer)
            if self._stop.is_set() and stop_at is None:
                stop_at = time.monotonic() + CLOSE_TIMEOUT_S
            if stop_at is not None and time.monotonic() > stop_at:
                return
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if stop_at is not None:
                    return
                continue
            if batch is None:
                return
            events = self.types.events(batch, self.block_size)
            payload = encoder.encode(EventBatch(ts=time.time(), events=events))
            seq = next(seqs)
            try:
                pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            except zmq.Again:  # at the high-water mark: ZMQ's PUB drops it for that subscriber
                pass
            buffer.append((seq, payload))
            self.batches_sent += 1
            self.events_sent += len(events)

    def _answer_replay(
        self, replay: zmq.Socket[bytes], buffer: Sequence[tuple[int, bytes]]
    ) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning(
                "KV events replay request not (identity, empty, 8-byte seq); ignored",
                extra={"frames": len(frames)},
            )
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self.replays += 1
        with contextlib.suppress(zmq.Again):
            for seq, payload in list(buffer):
                if seq >= start:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload),
                                          zmq.NOBLOCK)  # fmt: skip
            replay.send_multipart((client, b"", END_SEQ, b""), zmq.NOBLOCK)


def start_kv_events(config: Config, store: Store) -> KvEventPublisher | None:
    """The publisher ``kv_events_endpoint`` asks for, hooked into ``store`` and
    sending; None when off. Called before L2 recovery: the records it finds
    are announced as they are found."""
    if not config.kv_events_endpoint:
        return None
    publisher = KvEventPublisher.from_config(config)
    publisher.watch(store)
    publisher.start()
    return publisher
