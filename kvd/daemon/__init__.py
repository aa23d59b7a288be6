"""The daemon process: wiring the store, paths and pool together, TLS, signals."""
