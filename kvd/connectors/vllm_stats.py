"""The vLLM connector's counters (``kvd.connectors.vllm``): blocks moved,
failures and time spent, which vLLM's stats logger gathers from workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        KVConnectorStats,
    )
except ImportError:  # the connector's logic runs without vLLM
    KVConnectorStats = object

# Counters a worker reports to vLLM's stats logger (get_kv_connector_stats).
# save_conflicts: batches that met a key another engine had stored first.
STAT_NAMES = (
    "loaded_blocks",
    "load_errors",
    "saved_blocks",
    "save_failures",
    "save_conflicts",
    "load_s",
    "save_s",
)


@dataclass
class KvdConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Blocks moved, failures and time spent, summed over an interval."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: Any) -> KvdConnectorStats:
        for name, value in dict(getattr(other, "data", {}) or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in STAT_NAMES}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in STAT_NAMES)
