"""The limits the daemon and its clients agree on: how long a key, a value's
meta and a namespace name may be, and how many namespaces a daemon holds.
The store checks them (``kvd.store.index``), the bulk frames bound their
fields by them (``kvd.wire.bulk``), and the client and the connectors build
names and keys within them. Imports nothing."""

# A key is a digest of a block's tokens (and its parent's key): 64 bytes
# holds a SHA-512 or two chained 256-bit hashes.
KEY_BYTES_MAX = 64
# A value's meta is a small JSON blob (shape, dtype, format); 4 KiB bounds
# what the index keeps per entry beside the pages.
META_BYTES_MAX = 4096
NAMESPACE_BYTES_MAX = 256
# Bounds the index's per-namespace structures; a namespace is one model
# layout of one tenant, so thousands is already a large fleet.
NAMESPACES_MAX = 65536
