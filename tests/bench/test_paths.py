"""A tiny `kvd bench paths` run: every kvd path and ceiling produces a number,
and the results land as JSON and markdown (peers left out: they are optional)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvd.bench import main, paths


def test_paths_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "CASE_SECONDS", 0.05)
    monkeypatch.setattr(paths, "CLIENTS", (1, 2))
    monkeypatch.setattr(paths, "FILL_BYTES", 1 << 20)
    assert main(["--out", str(tmp_path), "paths", "--sizes", "65536", "--no-peers"]) == 0
    [result] = tmp_path.glob("*-paths.json")
    data = json.loads(result.read_text())
    measured = {(r["path"], r["op"], r["clients"]): r["gbps"] for r in data["rows"]}
    for path in ("shm", "bulk", "grpc"):
        for op in ("get", "put"):
            for clients in (1, 2):
                assert measured[(path, op, clients)] > 0
        assert measured[(path, "get-batch", 1)] > 0  # get_many_into of 8 values a call
    assert measured[("memcpy", "copy", 1)] > 0 and measured[("tcp", "get", 1)] > 0
    assert "| shm | get | 1 |" in result.with_suffix(".md").read_text()
    assert {t["target"] for t in data["targets"]} >= {
        "bulk get 4 MiB / loopback TCP",
        "shm get-batch 4 MiB / memcpy",
    }
