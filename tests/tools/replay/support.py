"""What the replay tests share: the conversation trace's path, and tiny
traces built from lists of chains or of words."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

from kvd.tools.replay.trace import Trace, parse_trace

TRACE_PATH = (
    Path(__file__).resolve().parents[3]
    / ".."
    / "shared"
    / "traces"
    / "mooncake_conversation_trace.jsonl"
)


def make_trace(requests: list[tuple[list[int], int]]) -> Trace:
    return parse_trace(
        json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids})
        for i, (ids, n) in enumerate(requests)
    )


words = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=40)


def trace_from_words(requests: list[list[int]]) -> Trace:
    """Each request is a word; block i of it stands for the word's prefix of length i+1."""
    ids: dict[tuple[int, ...], int] = {}
    chains = []
    for word in requests:
        chains.append(
            (
                [ids.setdefault(tuple(word[: i + 1]), len(ids)) for i in range(len(word))],
                512 * len(word) - 7,
            )
        )
    return make_trace(chains)
