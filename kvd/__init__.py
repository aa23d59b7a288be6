"""kvd: a per-node KV-cache storage daemon for LLM inference.

Folders follow a value's way (docs/architecture.md): ``client`` and
``connectors`` run in the engine; ``wire`` is what both sides agree on;
in the daemon, ``paths`` (gRPC, shm, bulk) call ``store``, which keeps
values in ``l1`` and ``l2`` through ``io``; ``cluster`` is the pool across
nodes; ``daemon`` wires the process, ``config`` holds the settings table;
``tools`` has the bench, the replay simulator, fsck and the demo.
"""

__version__ = "0.1.0"
