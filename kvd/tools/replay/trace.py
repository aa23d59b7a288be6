"""Request traces for workload replay: parse a JSONL trace into flat arrays.

The format is the Mooncake FAST'25 trace release's: one JSON object per line
with ``timestamp`` (ms since the first request), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` (the request's prefix blocks,
``block_tokens`` tokens each; equal ids mean the same prefix KV).

A trace becomes a few numpy arrays (one row per request, plus one flat array
of block references with per-request offsets), so the simulator walks 300k
references without a Python object per block. Block ids are remapped to
dense indices ``0 .. n_unique-1`` in order of first appearance.

Validation, each failure a ``TraceError`` naming the 1-based line: bad JSON,
not an object, a missing field, a non-integer or negative value, a timestamp
earlier than the previous line's (equal is allowed: the conversation trace
has many requests in the same millisecond), an empty or over-long chain, a
block repeated within a chain, a chain length that does not match
``ceil(input_length / block_tokens)``, and a block seen before with a
different parent (ids encode their prefix, so a block has one parent).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

BLOCK_TOKENS_DEFAULT = 512
# Limits: a 1M-token context at 512 tokens/block is 2048 blocks; 1 MiB per
# line holds 2048 ids with room to spare; 10M requests is ~40x the largest
# public trace (the Mooncake toolagent trace has ~24k).
CHAIN_BLOCKS_MAX = 1 << 16
LINE_BYTES_MAX = 1 << 22
REQUESTS_MAX = 10_000_000

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

IntArray = npt.NDArray[np.int64]


class TraceError(ValueError):
    """A malformed trace; ``line`` is 1-based (0 when not tied to a line)."""

    def __init__(self, line: int, message: str, source: str = "") -> None:
        where = f"line {line}: " if line else ""
        super().__init__(f"{source}: {where}{message}" if source else f"{where}{message}")
        self.line = line
        self.message = message


@dataclass(frozen=True)
class Trace:
    """A parsed trace; all arrays are int64 and read-only by convention."""

    timestamps_ms: IntArray  # (n_requests,)
    input_tokens: IntArray  # (n_requests,)
    output_tokens: IntArray  # (n_requests,)
    offsets: IntArray  # (n_requests + 1,): chain i is blocks[offsets[i]:offsets[i+1]]
    blocks: IntArray  # (n_refs,) dense block indices
    parents: IntArray  # (n_unique,) parent block index, -1 for a chain head
    block_tokens: int = BLOCK_TOKENS_DEFAULT

    def __len__(self) -> int:
        return int(self.timestamps_ms.shape[0])

    @property
    def n_refs(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def n_unique(self) -> int:
        return int(self.parents.shape[0])

    def chain(self, request: int) -> IntArray:
        return self.blocks[self.offsets[request] : self.offsets[request + 1]]


def _int_field(obj: dict[str, object], name: str, line: int) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(line, f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise TraceError(line, f"{name} must be >= 0, got {value}")
    return value


def parse_trace(lines: Iterable[str | bytes], *, block_tokens: int = BLOCK_TOKENS_DEFAULT) -> Trace:
    """Parse JSONL lines (blank lines are skipped) into a Trace."""
    if not 1 <= block_tokens <= 1 << 20:
        raise TraceError(0, f"block_tokens must be in 1..{1 << 20}, got {block_tokens}")
    timestamps: list[int] = []
    inputs: list[int] = []
    outputs: list[int] = []
    offsets: list[int] = [0]
    blocks: list[int] = []
    dense: dict[int, int] = {}
    parents: list[int] = []
    previous_ms = -1
    for line_no, raw in enumerate(lines, start=1):
        if len(raw) > LINE_BYTES_MAX:
            raise TraceError(line_no, f"line longer than {LINE_BYTES_MAX} bytes")
        if not raw.strip():
            continue
        if len(timestamps) >= REQUESTS_MAX:
            raise TraceError(line_no, f"more than {REQUESTS_MAX} requests")
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(line_no, f"bad JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceError(line_no, f"expected a JSON object, got {type(obj).__name__}")
        for name in _FIELDS:
            if name not in obj:
                raise TraceError(line_no, f"missing field {name!r}")
        timestamp_ms = _int_field(obj, "timestamp", line_no)
        input_tokens = _int_field(obj, "input_length", line_no)
        output_tokens = _int_field(obj, "output_length", line_no)
        if timestamp_ms < previous_ms:
            raise TraceError(
                line_no, f"timestamp {timestamp_ms} is earlier than the previous {previous_ms}"
            )
        previous_ms = timestamp_ms
        chain = obj["hash_ids"]
        if not isinstance(chain, list):
            raise TraceError(line_no, f"hash_ids must be a list, got {type(chain).__name__}")
        if not 1 <= len(chain) <= CHAIN_BLOCKS_MAX:
            raise TraceError(
                line_no, f"hash_ids must hold 1..{CHAIN_BLOCKS_MAX} ids, got {len(chain)}"
            )
        expected = -(-input_tokens // block_tokens)
        if len(chain) != expected:
            raise TraceError(
                line_no,
                f"{len(chain)} hash_ids for input_length {input_tokens}; expected {expected} "
                f"blocks of {block_tokens} tokens",
            )
        parent = -1
        seen_here: set[int] = set()
        for position, block_id in enumerate(chain):
            if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
                raise TraceError(
                    line_no, f"hash_ids[{position}] must be an integer >= 0, got {block_id!r}"
                )
            if block_id in seen_here:
                raise TraceError(
                    line_no, f"hash_ids[{position}] = {block_id} repeats within the chain"
                )
            seen_here.add(block_id)
            index = dense.get(block_id)
            if index is None:
                index = len(parents)
                dense[block_id] = index
                parents.append(parent)
            elif parents[index] != parent:
                raise TraceError(
                    line_no,
                    f"hash_ids[{position}] = {block_id} follows a different block than where it "
                    "appeared before (a block id must encode its whole prefix)",
                )
            blocks.append(index)
            parent = index
        timestamps.append(timestamp_ms)
        inputs.append(input_tokens)
        outputs.append(output_tokens)
        offsets.append(len(blocks))
    if not timestamps:
        raise TraceError(0, "trace holds no requests")
    return Trace(
        timestamps_ms=np.asarray(timestamps, dtype=np.int64),
        input_tokens=np.asarray(inputs, dtype=np.int64),
        output_tokens=np.asarray(outputs, dtype=np.int64),
        offsets=np.asarray(offsets, dtype=np.int64),
        blocks=np.asarray(blocks, dtype=np.int64),
        parents=np.asarray(parents, dtype=np.int64),
        block_tokens=block_tokens,
    )


def load_trace(path: str | Path, *, block_tokens: int = BLOCK_TOKENS_DEFAULT) -> Trace:
    """Parse a JSONL trace file; errors name the file and the line."""
    path = Path(path)
    with path.open("rb") as stream:
        try:
            return parse_trace(stream, block_tokens=block_tokens)
        except TraceError as exc:
            raise TraceError(exc.line, exc.message, source=str(path)) from None
