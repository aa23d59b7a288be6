"""What the shm socket's two sides agree on, beyond the bulk protocol's
frames (``kvd.paths.bulk.server``): the region ops' extra fields and the attach frame.

A region op (REGION_GET, REGION_PUT) carries ``REGION_REF`` right after
its 40-byte header, and with ``FLAG_DEADLINE`` a ``DEADLINE`` after it: the
daemon's CLOCK_MONOTONIC past which the client no longer waits and may reuse
the bytes, so no copy into the region starts and no copy out of it is
stored past it. A client sends it only to a daemon that gave its clock
(``DescribePathsResponse.daemon_clock_ns``). A REGION_ATTACH is the first and only frame of a
connection: the header's length is the region's size, its meta the bearer
token, and one descriptor (the region's sealed memfd) rides with it as
SCM_RIGHTS; the answer's meta is ``ATTACHED``.
"""

from __future__ import annotations

import os
import struct

OP_REGION_ATTACH = 6  # after kvd.wire.bulk's HELLO 1, PUT 2, GET 3, REGION_GET 4, REGION_PUT 5
ATTACHED = struct.Struct("<Q16s")  # region id, region token
# After the header of a region op: region id, offset in the region, region token.
REGION_REF = struct.Struct("<QQ16s")
DEADLINE = struct.Struct("<Q")
FLAG_DEADLINE = 4  # request flag, after kvd.wire.bulk's DURABLE 1 and CHECKSUM 2
# struct ucred of SO_PEERCRED: pid, uid, gid.
PEERCRED = struct.Struct("3i")
SOCKET_NAME = "kvd.sock"
# Answer flags above the protocol's: the tier a get was served from.
TIER_SHIFT = 8
# Frames one client sends before reading answers: 16 × (72-byte header and
# ref + ≤ 4.5 KiB of names and meta) stays below a Unix socket's buffer.
PIPELINE_FRAMES = 16


def socket_path(shm_dir: str, configured: str) -> str:
    return configured or os.path.join(shm_dir, SOCKET_NAME)


def pid_namespace() -> int:
    """The inode of this process's pid namespace; 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
