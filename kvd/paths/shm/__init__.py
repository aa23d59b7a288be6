"""The same-node shared-memory path: regions, their handlers and the shm socket."""
