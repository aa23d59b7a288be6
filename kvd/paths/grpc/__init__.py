"""The KVStore gRPC service."""
