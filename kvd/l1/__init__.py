"""The L1 DRAM pool: one pre-allocated arena of 64 KiB pages."""
