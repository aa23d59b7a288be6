"""L1 replacement policies: LRU, chain-aware LRU, S3-FIFO, hazard and density."""
