"""The same-node shared-memory path: regions, their copies and the shm socket
(its ops are ``kvd.paths.ops.region_ops``)."""
