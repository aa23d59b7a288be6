"""KV-cache events of kvd's vLLM connector (``kvd.connectors.vllm``).

With ``kv_events_config.enable_kv_cache_events`` on, vLLM publishes what
its KV caches hold (``BlockStored``, ``BlockRemoved``) so that a router can
send a prompt where its prefix already is. The connector adds the blocks it
stored in kvd: each worker reports a ``BlockStored`` per saved batch once
its put succeeded (``get_kv_connector_kv_cache_events``), the scheduler
gathers the workers' reports (``update_connector_output``) and hands vLLM
those every worker reported (``take_events``): with tensor parallelism a
block is in kvd only once every rank stored its shard.

The event's ``block_hashes`` are kvd's block keys (``block_keys``: SHA-256
chained over the tokens, the LoRA name and the cache salt), ``token_ids``
the blocks' tokens, so a consumer can check them; ``medium`` is ``CPU``
(kvd's DRAM tier; a block may later move to its SSD tier or be evicted,
which is not reported: a router that trusts an old event gets a miss,
never a wrong block). Events wait in a bounded list (``EVENTS_MAX``, the
oldest dropped) between two collections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from vllm.distributed.kv_events import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        MEDIUM_CPU,
        BlockStored,
        KVConnectorKVEvents,
        KVEventAggregator,
    )

    HAVE_EVENTS = True
except ImportError:  # vLLM without KV-cache events, or none
    HAVE_EVENTS = False
    KVConnectorKVEvents = object
    MEDIUM_CPU = "CPU"

# Events one worker or the scheduler keeps between two collections.
EVENTS_MAX = 10_000


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (and this vLLM has them)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return HAVE_EVENTS and bool(getattr(events, "enable_kv_cache_events", False))


def stored_event(
    keys: Sequence[bytes],
    parent: bytes | None,
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str,
) -> Any:
    """The ``BlockStored`` of blocks ``keys`` (after ``parent``) that kvd now holds."""
    return BlockStored(
        block_hashes=list(keys),
        parent_block_hash=parent,
        token_ids=list(token_ids),
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=lora_name or None,
    )


class KvdKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """The events of one or more workers; ``aggregate`` keeps those all of them sent."""

    def __init__(self, num_workers: int) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[Any]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KvdKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        events: list[Any] = self._aggregator.get_all_events()
        return events

    def get_number_of_workers(self) -> int:
        return int(self._aggregator.get_number_of_workers())

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


class WorkerEvents:
    """A worker's events since vLLM last collected them."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def add(self, event: Any) -> None:
        self._events.append(event)
        if len(self._events) > EVENTS_MAX:
            del self._events[: len(self._events) - EVENTS_MAX]

    def collect(self) -> KvdKVEvents | None:
        if not self._events:
            return None
        events, self._events = self._events, []
        collected = KvdKVEvents(num_workers=1)
        collected.add_events(events)
        return collected


class SchedulerEvents:
    """The workers' reports, gathered on the scheduler until vLLM takes them.
    A report holds every worker's events of one step: what all of them sent
    is kept, the rest (a rank whose put failed) dropped."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def gather(self, reported: Any) -> None:
        if not isinstance(reported, KvdKVEvents):
            return
        self._events.extend(reported.aggregate().get_all_events())
        if len(self._events) > EVENTS_MAX:
            del self._events[: len(self._events) - EVENTS_MAX]

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events
