"""kvd: a per-node KV-cache storage daemon for LLM inference.

The package splits by concern: ``config`` (the settings table), ``pool``
(the L1 DRAM arena), ``eviction`` (replacement policies), ``store`` (index,
leases, placement), ``server`` (gRPC), ``client`` (the thin client library),
``cli`` (the ``kvd`` command) and ``metrics`` (Prometheus).
"""

__version__ = "0.1.0"
