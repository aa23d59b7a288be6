"""What the daemon and its clients agree on: error codes, frame layouts, the gRPC
service's method table, the value checksum. Imports nothing else of kvd."""
