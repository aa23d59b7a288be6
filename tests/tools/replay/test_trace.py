"""Parsing of JSONL request traces (kvd.tools.replay.trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvd.tools.replay.trace import TraceError, load_trace, parse_trace


def line(timestamp: int = 10, input_length: int = 1000, hash_ids: object = (1, 2)) -> str:
    ids = list(hash_ids) if isinstance(hash_ids, tuple) else hash_ids
    return json.dumps(
        {"timestamp": timestamp, "input_length": input_length, "output_length": 5, "hash_ids": ids}
    )


def test_parses_into_dense_arrays() -> None:
    trace = parse_trace([line(0, 1000, (7, 9)), "", line(0, 1500, (7, 9, 4)), line(3, 10, (8,))])
    assert len(trace) == 3
    assert trace.n_refs == 6
    assert trace.n_unique == 4
    assert trace.chain(1).tolist() == [0, 1, 2]
    assert trace.chain(2).tolist() == [3]
    assert trace.parents.tolist() == [-1, 0, 1, -1]
    assert trace.timestamps_ms.tolist() == [0, 0, 3]
    assert trace.input_tokens.tolist() == [1000, 1500, 10]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "bad JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}),
            "missing field 'hash_ids'",
        ),
        (line(timestamp=-1), "timestamp must be >= 0"),
        (line(input_length="5"), "input_length must be an integer"),  # type: ignore[arg-type]
        (line(input_length=True), "input_length must be an integer"),
        (line(hash_ids="1,2"), "hash_ids must be a list"),
        (line(hash_ids=[]), "hash_ids must hold"),
        (line(hash_ids=[1, -2]), r"hash_ids\[1\] must be an integer >= 0"),
        (line(hash_ids=[1, 1.5]), r"hash_ids\[1\] must be an integer"),
        (line(input_length=2000, hash_ids=[1, 3]), "expected 4 blocks"),
        (line(hash_ids=[3, 3]), "repeats within the chain"),
        (line(hash_ids=[5, 2]), "follows a different block"),
        (line(timestamp=1), "earlier than the previous 2"),
    ],
)
def test_malformed_line_names_its_number(bad: str, message: str) -> None:
    good = [line(0, 1000, (1, 2)), line(2, 512, (1,))]
    with pytest.raises(TraceError, match=message) as info:
        parse_trace([*good, "", bad])
    assert info.value.line == 4
    assert str(info.value).startswith("line 4: ")


def test_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "])


def test_block_tokens_changes_the_chain_length_check() -> None:
    trace = parse_trace([line(0, 1000, (1, 2, 3, 4))], block_tokens=256)
    assert trace.block_tokens == 256
    with pytest.raises(TraceError, match="block_tokens"):
        parse_trace([line()], block_tokens=0)


def test_load_trace_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n" + "oops\n")
    with pytest.raises(TraceError, match=r"t\.jsonl: line 2: bad JSON") as info:
        load_trace(path)
    assert info.value.line == 2
    path.write_text(line() + "\n")
    assert len(load_trace(path)) == 1
