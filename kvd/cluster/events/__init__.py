"""KV events in vLLM's format: which blocks this daemon holds, for KV-aware
routers (llm-d's indexer, Dynamo). ``wire`` is the format (vLLM's structs
and their msgpack encoding), ``publisher`` the bounded queue, the ZMQ
sockets and the thread that sends, and the hooks into the store."""

from kvd.cluster.events.publisher import (
    KV_EVENTS_COUNTERS,
    KV_EVENTS_GAUGES,
    KvEventPublisher,
    start_kv_events,
)

__all__ = ["KV_EVENTS_COUNTERS", "KV_EVENTS_GAUGES", "KvEventPublisher", "start_kv_events"]
