"""The daemon's transports: ``grpc/`` (the KVStore service), ``shm/`` (shared-memory
regions and their Unix socket), ``bulk/`` (the bulk TCP protocol), all calling
one op layer with plain values (``ops/``), with the auth, metrics and socket
directories they share."""
