"""The event loop's state: namespaces, the index, leases, uploads, placement across
L1 and L2, write-back, prefetch, and the eviction policies (``eviction/``).
Knows nothing of gRPC or metrics: transports read its plain counters."""
