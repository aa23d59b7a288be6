"""The op layer under every transport: what a request does once a transport
has parsed it into plain values, with no protobuf and no grpc.

- ``kvd.paths.ops.calls``: what every request shares: the service limits,
  the in-flight byte counter, and ``Tally``, the one wrapper that times and
  counts a request and turns its typed error into a metric and a code.
- ``kvd.paths.ops.items``: a region item and its result, a region batch,
  a whole value to put or fetched inline, as plain dataclasses.
- ``kvd.paths.ops.values``: ``ValueOps``, the value ops every transport
  shares (fetch, the put steps, batch get and put, lookup, exists, delete,
  release, stats) and their hit, miss, fetch-time and byte counts.
- ``kvd.paths.ops.region_ops``: the region batch get and put, and the
  one-item ``get_now`` / ``put_now`` the shm socket answers at once, over
  ``ValueOps``' fetches.

The transports above it (``kvd.paths.grpc.service``, ``kvd.paths.shm.channel``,
``kvd.paths.bulk.server``) parse, call and encode; nothing here imports them.
"""
