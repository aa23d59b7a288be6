"""``kvd bench paths`` report: the targets as ratios, the markdown table and
the chart of GB/s per size per path with the ceilings drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvd.bench.paths import Row, size_label


def _find(rows: list[Row], path: str, op: str, size: int, clients: int = 1) -> float | None:
    for row in rows:
        if (row.path, row.op, row.size_bytes, row.clients) == (path, op, size, clients):
            return row.gbps
    return None


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """The targets, each as measured ratio against its threshold."""
    mib = 1 << 20

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    out = []
    for op in ("get", "get-batch"):
        for size in (4 * mib, 32 * mib):
            out.append(
                {
                    "target": f"shm {op} {size_label(size)} / memcpy",
                    "ratio": ratio(
                        _find(rows, "shm", op, size), _find(rows, "memcpy", "copy", size)
                    ),
                    "threshold": 0.8,
                }
            )
    bulk4 = _find(rows, "bulk", "get", 4 * mib)
    out += [
        {
            "target": "bulk get 4 MiB / loopback TCP",
            "ratio": ratio(bulk4, _find(rows, "tcp", "get", 4 * mib)),
            "threshold": 0.8,
        },
        {
            "target": "bulk get 4 MiB / redis get",
            "ratio": ratio(bulk4, _find(rows, "redis", "get", 4 * mib)),
            "threshold": 3.0,
        },
        {
            "target": "bulk get 4 MiB / mooncake get_into",
            "ratio": ratio(bulk4, _find(rows, "mooncake", "get", 4 * mib)),
            "threshold": 1.2,
        },
    ]
    for path in ("shm", "bulk", "grpc"):
        out.append(
            {
                "target": f"{path} get 4 MiB: 16 clients / 1 client",
                "ratio": ratio(
                    _find(rows, path, "get", 4 * mib, 16), _find(rows, path, "get", 4 * mib)
                ),
                "threshold": 1.0,
            }
        )
    for item in out:
        r, threshold = item["ratio"], item["threshold"]
        item["met"] = None if not isinstance(r, float) else r >= float(threshold)  # type: ignore[arg-type]
    return out


def markdown(rows: list[Row]) -> str:
    sizes = sorted({r.size_bytes for r in rows})
    head = "| path | op | clients | " + " | ".join(size_label(s) for s in sizes) + " |"
    lines = [head, "|" + "---|" * (len(sizes) + 3)]
    seen: list[tuple[str, str, int]] = []
    for r in rows:
        if (r.path, r.op, r.clients) not in seen:
            seen.append((r.path, r.op, r.clients))
    for path, op, clients in seen:
        cells = []
        for size in sizes:
            match = [
                r
                for r in rows
                if (r.path, r.op, r.clients, r.size_bytes) == (path, op, clients, size)
            ]
            if not match:
                cells.append("")
            elif match[0].gbps is None:
                cells.append(match[0].note)
            else:
                cells.append(f"{match[0].gbps:.2f}")
        lines.append(f"| {path} | {op} | {clients} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "GB/s, aggregate over the clients. Targets:",
        "",
        "| target | ratio | needs | met |",
        "|---|---|---|---|",
    ]
    for item in ratios(rows):
        r = item["ratio"]
        shown = "n/a" if r is None else f"{r:.2f}"
        lines.append(f"| {item['target']} | {shown} | >= {item['threshold']} | {item['met']} |")
    return "\n".join(lines)


def chart(rows: list[Row], path: Path) -> bool:
    """GB/s per size per path (gets, one client), ceilings dashed; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({r.size_bytes for r in rows})
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, op, style in (
        ("memcpy", "copy", "k--"),
        ("tcp", "get", "k:"),
        ("shm", "get", "o-"),
        ("bulk", "get", "s-"),
        ("grpc", "get", "^-"),
        ("redis", "get", "x-"),
        ("mooncake", "get", "d-"),
    ):
        points = [(s, _find(rows, name, op, s)) for s in sizes]
        xs = [s / (1 << 20) for s, g in points if g is not None]
        ys = [g for _, g in points if g is not None]
        if xs:
            label = {"memcpy": "memcpy ceiling", "tcp": "loopback TCP ceiling"}.get(
                name, f"{name} get"
            )
            ax.plot(xs, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("value size (MiB)")
    ax.set_ylabel("GB/s (one client)")
    ax.set_title("kvd data paths, L1-resident gets")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
