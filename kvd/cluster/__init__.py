"""The pool across nodes: every node's daemon answers lookups and gets for
the whole pool (docs/pool.md).

The ``pool_members`` grammar (``static:`` and ``etcd://``) is a setting's
syntax, so it lives with the settings: ``kvd.config.pool_members``.

- ``rendezvous``: which member owns a key (highest-random-weight hashing).
- ``membership``: the current member list and the checks on it.
- ``etcd``: membership from etcd (a lease-held registration and a watch).
- ``scope``: the deadline and hop of the call a pool operation serves.
- ``peers``: gRPC calls to other members (Exists, Get, BatchPut).
- ``router``: the pool's lookup, remote get and put forwarding.

Only ``peers`` speaks grpc and nothing here imports metrics: the server wires
the router into the store and service and exports its counters.
"""
