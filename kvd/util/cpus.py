"""How many CPUs the daemon may use, and what that allows its data paths.

Copies between shared-memory regions and pool pages, and the kernel's copies
of bulk GET answers into sockets, can run on worker threads (the GIL is
released while they run). That pays only where cores are left over: on a
small machine the clients need the other cores, and a hand-off to a worker
adds latency without adding parallelism. Measured with ``kvd bench paths``,
16 clients getting 4 MiB values over shared memory: on 2 CPUs, 8.5 GB/s
with every copy on the event loop against 5.7 GB/s with copies handed to
threads; on 16 CPUs with 8 copy threads, 9.4 GB/s, 2.4x one client.
"""

from __future__ import annotations

import os

CPUS = len(os.sched_getaffinity(0))
# Worker threads for copies and for sends: one per two CPUs, 2 to 8.
WORKER_THREADS = max(2, min(8, CPUS // 2))
# From this many CPUs, work that waits behind other requests goes to workers.
OFFLOAD_MIN_CPUS = 6
OFFLOAD = CPUS >= OFFLOAD_MIN_CPUS
