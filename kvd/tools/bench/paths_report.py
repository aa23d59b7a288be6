"""``kvd bench paths`` report: the targets as ratios, the markdown table and
the chart of GB/s per size per path with the ceilings drawn."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd.tools.bench.paths import POOL_PATHS, Row, size_label


def _find(rows: list[Row], path: str, op: str, size: int, clients: int = 1) -> float | None:
    for row in rows:
        if (row.path, row.op, row.size_bytes, row.clients) == (path, op, size, clients):
            return row.gbps
    return None


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """The targets, each as measured ratio against its threshold, then the
    L2-cold gets against fio at the same concurrency (no threshold)."""
    mib = 1 << 20

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    kib64 = 64 << 10
    out: list[dict[str, Any]] = []
    # The shm targets for region gets, then for gets the client copies out
    # of the pool (checked, and unchecked).
    for shm in ("shm", *POOL_PATHS):
        if _find(rows, shm, "get", kib64) is None and shm != "shm":
            continue
        out += [
            {
                "target": f"{shm} get 64 KiB / redis get",
                "ratio": ratio(_find(rows, shm, "get", kib64), _find(rows, "redis", "get", kib64)),
                "threshold": 2.0,
            },
            {
                "target": f"{shm} get-batch 64 KiB / memcpy",
                "ratio": ratio(
                    _find(rows, shm, "get-batch", kib64), _find(rows, "memcpy", "copy", kib64)
                ),
                "threshold": 0.2,
            },
            {
                "target": f"{shm} get-chain 64 KiB / memcpy",
                "ratio": ratio(
                    _find(rows, shm, "get-chain", kib64), _find(rows, "memcpy", "copy", kib64)
                ),
                "threshold": 0.2,
            },
        ]
        for op in ("get", "get-batch"):
            for size in (4 * mib, 32 * mib):
                out.append(
                    {
                        "target": f"{shm} {op} {size_label(size)} / memcpy",
                        "ratio": ratio(
                            _find(rows, shm, op, size), _find(rows, "memcpy", "copy", size)
                        ),
                        "threshold": 0.9,
                    }
                )
    bulk4 = _find(rows, "bulk", "get", 4 * mib)
    out += [
        {
            "target": "bulk get 4 MiB / loopback TCP",
            "ratio": ratio(bulk4, _find(rows, "tcp", "get", 4 * mib)),
            "threshold": 0.9,
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
    for path in ("shm", *POOL_PATHS, "bulk", "grpc"):
        if _find(rows, path, "get", 4 * mib) is None:
            continue
        out.append(
            {
                "target": f"{path} get 4 MiB: 16 clients / 1 client",
                "ratio": ratio(
                    _find(rows, path, "get", 4 * mib, 16), _find(rows, path, "get", 4 * mib)
                ),
                "threshold": 1.0,
            }
        )
    for path in ("shm", "bulk"):
        for size in (4 * mib, 32 * mib):
            cold = _find(rows, path, "get-cold", size)
            out.append(
                {
                    "target": f"{path} get-cold {size_label(size)} / fio QD1",
                    "ratio": ratio(cold, _find(rows, "fio", "read QD1", size)),
                    "threshold": None,
                }
            )
    for item in out:
        r, threshold = item["ratio"], item["threshold"]
        item["met"] = (
            None if not isinstance(r, float) or threshold is None else r >= float(threshold)
        )
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
    lines += ["", "GB/s, aggregate over the clients. One client's mean time per op, in µs:", ""]
    lines += latency_lines(rows, sizes)
    cpu = cpu_lines(rows, sizes)
    if cpu:
        lines += [
            "",
            "CPU per value, the client processes' and the server's together (user and "
            "kernel), in µs, one client:",
            "",
            *cpu,
        ]
    lines += [
        "",
        "Targets, then L2-cold gets against fio:",
        "",
        "| target | ratio | needs | met |",
        "|---|---|---|---|",
    ]
    for item in ratios(rows):
        r = item["ratio"]
        shown = "n/a" if r is None else f"{r:.2f}"
        needs = "" if item["threshold"] is None else f">= {item['threshold']}"
        met = "" if item["met"] is None else item["met"]
        lines.append(f"| {item['target']} | {shown} | {needs} | {met} |")
    return "\n".join(lines)


def latency_lines(rows: list[Row], sizes: list[int]) -> list[str]:
    """A table of one client's mean µs per op (size / GB/s), per path and op."""
    kvd_and_peers = [r for r in rows if r.clients == 1 and r.path not in ("memcpy", "fio")]
    return _per_op_table(
        kvd_and_peers, sizes, lambda r: f"{r.size_bytes / r.gbps / 1e3:.1f}" if r.gbps else ""
    )


def _per_op_table(rows: list[Row], sizes: list[int], cell: Callable[[Row], str]) -> list[str]:
    """A table of ``cell`` of each row, a line per path and op (in the rows'
    order), a column per size; ``rows`` are one client's."""
    lines = ["| path | op | " + " | ".join(size_label(s) for s in sizes) + " |",
             "|" + "---|" * (len(sizes) + 2)]  # fmt: skip
    by_case = {(r.path, r.op, r.size_bytes): r for r in reversed(rows)}  # the first wins
    for path, op in dict.fromkeys((r.path, r.op) for r in rows):
        cells = [by_case.get((path, op, size)) for size in sizes]
        lines.append(
            f"| {path} | {op} | " + " | ".join("" if r is None else cell(r) for r in cells) + " |"
        )
    return lines


# Lines of the chart's panels: (path, op, matplotlib style, label).
_L1_LINES = (
    ("memcpy", "copy", "k--", "memcpy ceiling"),
    ("tcp", "get", "k:", "loopback TCP ceiling"),
    ("shm", "get", "o-", "shm get"),
    ("shm-pool", "get", "v-", "shm get, pool read"),
    ("shm-pool-direct", "get", "P-", "shm get, pool directory"),
    ("bulk", "get", "s-", "bulk get"),
    ("grpc", "get", "^-", "grpc get"),
    ("redis", "get", "x-", "redis get"),
    ("mooncake", "get", "d-", "mooncake get"),
)
_COLD_LINES = (
    ("fio", "read QD1", "k--", "fio ceiling, QD1"),
    ("fio", "read QD32", "k:", "fio ceiling, QD32"),
    ("shm", "get-cold", "o-", "shm get"),
    ("bulk", "get-cold", "s-", "bulk get"),
    ("grpc", "get-cold", "^-", "grpc get"),
)


def chart(rows: list[Row], path: Path) -> bool:
    """GB/s per size per path (gets, one client), ceilings dashed, L2-cold gets in a
    second panel when measured; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({r.size_bytes for r in rows})
    cold = any(r.op == "get-cold" for r in rows)
    fig, axes = plt.subplots(1, 2 if cold else 1, figsize=(14 if cold else 8, 5), squeeze=False)
    panels = [("L1-resident gets", _L1_LINES)] + ([("L2-cold gets", _COLD_LINES)] if cold else [])
    for ax, (title, lines) in zip(axes[0], panels, strict=True):
        for name, op, style, label in lines:
            points = [(s, _find(rows, name, op, s)) for s in sizes]
            xs = [s / (1 << 20) for s, g in points if g is not None]
            ys = [g for _, g in points if g is not None]
            if xs:
                ax.plot(xs, ys, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (MiB)")
        ax.set_ylabel("GB/s (one client)")
        ax.set_title(f"kvd data paths, {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cpu_lines(rows: list[Row], sizes: list[int]) -> list[str]:
    """A table of the clients' and server's CPU µs per value, one client, per
    path and op; empty when no row has it."""
    measured = [r for r in rows if r.clients == 1 and r.cpu_us_per_value is not None]
    if not measured:
        return []
    return _per_op_table(measured, sizes, lambda r: f"{r.cpu_us_per_value:.1f}")
