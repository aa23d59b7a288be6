"""``kvd bench lookup`` at small sizes: every path answers every lookup in
full, and the rows, the table and the targets come out."""

from __future__ import annotations

from pathlib import Path

from kvd.tools.bench import lookup, main


def test_every_path_times_full_lookups() -> None:
    rows = lookup.run(lambda _: None, (1, 300), calls={1: 20, 300: 20})
    assert [(r.path, r.keys) for r in rows] == [
        (path, keys) for path in lookup.PATHS for keys in (1, 300)
    ]
    for row in rows:
        assert row.calls == 20
        assert 0 < row.p50_ms <= row.p90_ms <= row.p99_ms <= row.max_ms
        assert row.daemon_cpu_us > 0 and row.client_cpu_us > 0
    assert "| shm-socket | 300 | 20 |" in lookup.markdown(rows)
    assert lookup.targets(rows) == {}  # no row of a targeted length


def test_the_command_writes_its_results(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "lookup", "--keys", "1000", "--paths", "shm-socket"]) == 0
    (result,) = tmp_path.glob("*-lookup.json")
    assert '"lookup_1000_p99_ms"' in result.read_text()
