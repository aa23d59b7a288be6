"""vLLM's KV-event format (``vllm/distributed/kv_events.py``), field for
field, and the turning of the store's changes into its events.

A message is three ZMQ frames: the topic, the sequence number as 8 bytes
big-endian, and a msgpack ``KVEventBatch``: the positional array
``[ts, events, data_parallel_rank]``. Each event is a msgspec struct tagged
by its class name: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.
vLLM encodes an event as a map of named fields with the tag under
``"type"`` (``encoding = "map"``); before that it sent positional arrays
``[tag, field, ...]`` (``"array"``), which older consumers still read: it
carries the fields up to ``lora_name`` (``BlockRemoved``: up to ``medium``).
Maps leave out the fields at their default (``omit_defaults``).

What kvd fills (docs/pool.md): ``block_hashes`` are the kvd keys, bytes as
stored (the vLLM connector's keys are SHA-256 chained over the tokens, as
vLLM's own block hashes are); ``parent_block_hash`` the parent key of the
first block, or None; ``token_ids`` empty (the daemon never sees tokens);
``block_size`` the ``kv_events_block_size`` setting; ``medium`` ``CPU`` for
L1 and ``STORAGE`` for L2 (vLLM's ``MEDIUM_CPU`` and ``MEDIUM_STORAGE``);
``lora_id`` and ``lora_name`` None (a LoRA is already in the key). Nothing
here imports zmq or the store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

# vLLM's ExternalBlockHash.
BlockHash = bytes | int

MEDIUM_L1 = "CPU"
MEDIUM_L2 = "STORAGE"
ENCODINGS = ("map", "array")

# One change of the store: (kind, key, parent, medium).
STORED, REMOVED, CLEARED = 0, 1, 2
Change = tuple[int, bytes, bytes | None, str]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch`` (its ``KVEventBatch`` narrows ``events``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_STORED_FIELDS: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("block_hashes", list[BlockHash]),
    ("parent_block_hash", BlockHash | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[tuple[Any, ...] | None] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
    ("session_id", str | None, None),
]
_REMOVED_FIELDS: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("block_hashes", list[BlockHash]),
    ("medium", str | None),
    ("group_idx", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
]


# The positional form's fields: BlockStored up to lora_name, BlockRemoved up
# to medium (what llm-d's positional decoder reads).
ARRAY_STORED_FIELDS = 7
ARRAY_REMOVED_FIELDS = 2


class EventTypes:
    """vLLM's three event structs, encoded as maps or as positional arrays."""

    def __init__(self, encoding: str) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding {encoding!r}: one of {', '.join(ENCODINGS)}")
        array = encoding == "array"
        options: dict[str, Any] = {
            "omit_defaults": True, "gc": False, "tag": True, "array_like": array,
        }  # fmt: skip
        # msgspec writes every field of an array, defaults included: the
        # positional form keeps the fields its consumers read by position.
        stored = _STORED_FIELDS[:ARRAY_STORED_FIELDS] if array else _STORED_FIELDS
        removed = _REMOVED_FIELDS[:ARRAY_REMOVED_FIELDS] if array else _REMOVED_FIELDS
        self.stored: Any = msgspec.defstruct("BlockStored", stored, **options)
        self.removed: Any = msgspec.defstruct("BlockRemoved", removed, **options)
        self.cleared: Any = msgspec.defstruct("AllBlocksCleared", [], **options)

    def events(self, changes: Iterable[Change], block_size: int) -> list[Any]:
        """The events of ``changes`` in order. A run of stores of one medium
        where each key's parent is the key before is one ``BlockStored`` (a
        chain, as vLLM reports one); a run of removals of one medium is one
        ``BlockRemoved``."""
        events: list[Any] = []
        run_kind, run_medium, run_hashes = -1, "", list[BlockHash]()
        last_key = b""
        for kind, key, parent, medium in changes:
            chained = kind == STORED and parent is not None and parent == last_key
            if kind == run_kind and medium == run_medium and (kind == REMOVED or chained):
                run_hashes.append(key)
            elif kind == CLEARED:
                events.append(self.cleared())
                run_kind = -1
            else:
                run_kind, run_medium, run_hashes = kind, medium, [key]
                if kind == STORED:
                    events.append(self.stored(
                        block_hashes=run_hashes, parent_block_hash=parent, token_ids=[],
                        block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                    ))  # fmt: skip
                else:
                    events.append(self.removed(block_hashes=run_hashes, medium=medium))
            last_key = key
        return events
