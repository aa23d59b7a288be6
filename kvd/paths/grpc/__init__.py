"""The KVStore gRPC service, and the gRPC faces of auth and of the error codes."""
