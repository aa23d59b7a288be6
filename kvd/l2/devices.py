"""The SSD paths under L2, striped like RAID0, and aligned I/O buffers.

Each configured path (a regular file on XFS/ext4, or a block device such as
an NVMe / NVMe-oF namespace or an md RAID0) is opened with O_DIRECT and cut
into segments of ``segment_bytes``. A logical segment is segment *i* of
every path, and its bytes are dealt round-robin over the paths in stripes of
``stripe_bytes`` (``kvd.io.ops.StripeLayout``, which the native record reads
follow too): any logical range is at most one op per path, and a large
record is read from every device in parallel.

A regular file is created and preallocated to ``bytes_per_path`` (refused,
and the file removed, when its file system has less free space); a block
device uses its size, bounded by ``bytes_per_path`` when that is smaller. A
read-only device or file system is refused at start.
Filesystems without O_DIRECT (tmpfs) are opened buffered, with a warning:
the format and checks are the same, the page cache just sits in between.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.io.ops import IoOp, OpKind, StripeLayout

log = logging.getLogger("kvd.l2")


class DeviceError(OSError):
    """An SSD path that cannot be used as configured."""


@dataclass(frozen=True, slots=True)
class Device:
    path: str
    fd: int
    usable_bytes: int
    direct: bool
    block_device: bool
    created: bool  # a file this start created (removed again if the start fails)


# ioctl(BLKROGET) from <linux/fs.h>: _IO(0x12, 94), an int, 1 when read-only.
BLKROGET = 0x125E


def _check_writable(path: str, fd: int, is_block: bool) -> None:
    """Refuse a read-only device or file system: every L2 write would fail
    (a block device set read-only still opens O_RDWR; its writes get EPERM)."""
    if is_block:
        flag = fcntl.ioctl(fd, BLKROGET, b"\0\0\0\0")
        read_only = int.from_bytes(flag, "little") != 0
    else:
        read_only = bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    if read_only:
        raise DeviceError(
            errno.EROFS, f"SSD path {path} is read-only: L2 needs a writable device or file"
        )


def _reserve(path: str, fd: int, bytes_per_path: int) -> None:
    """Allocate a file to ``bytes_per_path``; on failure its old size is restored.

    A failed ``posix_fallocate`` on ext4 keeps what it allocated (a 200 MiB
    request on a 64 MiB file system left a 56 MB file), so the free space is
    checked first and the file is cut back when the allocation fails anyway
    (metadata blocks are not in the estimate).
    """
    st = os.fstat(fd)
    if st.st_size >= bytes_per_path:
        return
    fs = os.fstatvfs(fd)
    free_bytes = fs.f_bavail * fs.f_frsize
    need_bytes = bytes_per_path - st.st_blocks * 512
    short = (
        f"cannot reserve {bytes_per_path} bytes for SSD path {path}: its file system has "
        f"{free_bytes} bytes free; lower ssd_bytes or free space there"
    )
    if need_bytes > free_bytes:
        raise DeviceError(errno.ENOSPC, short)
    try:
        os.posix_fallocate(fd, 0, bytes_per_path)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, bytes_per_path)  # no fallocate (tmpfs before 2.6.x, some FUSE)
            return
        os.ftruncate(fd, st.st_size)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DeviceError(exc.errno, short) from exc
        raise DeviceError(
            exc.errno, f"cannot reserve {bytes_per_path} bytes in {path}: {exc.strerror}"
        ) from exc


def _open(path: str, bytes_per_path: int) -> Device:
    exists = os.path.exists(path)
    is_block = exists and stat.S_ISBLK(os.stat(path).st_mode)
    if not is_block:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    flags = os.O_RDWR | (0 if is_block else os.O_CREAT)
    direct = True
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise DeviceError(exc.errno, f"cannot open SSD path {path}: {exc.strerror}") from exc
        log.warning("O_DIRECT refused, opening buffered", extra={"path": path})
        fd = os.open(path, flags, 0o600)
        direct = False
    try:
        _check_writable(path, fd, is_block)
        if is_block:
            size = os.lseek(fd, 0, os.SEEK_END)
            usable = min(size, bytes_per_path) if bytes_per_path else size
        else:
            _reserve(path, fd, bytes_per_path)
            usable = bytes_per_path
    except BaseException:
        os.close(fd)
        if not exists:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return Device(path, fd, usable, direct, is_block, created=not exists)


class DeviceSet:
    """N paths as one striped address space of logical segments."""

    def __init__(
        self, paths: Sequence[str], bytes_per_path: int, segment_bytes: int, stripe_bytes: int
    ) -> None:
        if not paths:
            raise DeviceError(errno.EINVAL, "no SSD path")
        if segment_bytes % stripe_bytes:
            raise DeviceError(errno.EINVAL, "segment_bytes is not a multiple of stripe_bytes")
        self.devices: list[Device] = []
        self._locks: list[int] = []
        try:
            for path in paths:
                self.devices.append(_open(path, bytes_per_path))
            # Two daemons (or a daemon and `kvd fsck --repair`) on one path
            # would overwrite each other's records.
            self._locks = lock_paths(paths)
        except BaseException:
            self._abandon()
            raise
        self.segment_bytes = segment_bytes  # per path
        self.stripe_bytes = stripe_bytes
        self.segment_count = min(d.usable_bytes for d in self.devices) // segment_bytes
        if self.segment_count < 2:
            self._abandon()
            raise DeviceError(
                errno.ENOSPC,
                f"SSD paths hold {self.segment_count} segment(s) of {segment_bytes} bytes; "
                "L2 needs at least 2 (raise ssd_bytes or lower ssd_segment_bytes)",
            )
        self.logical_segment_bytes = segment_bytes * len(self.devices)
        self.layout = StripeLayout(tuple(d.fd for d in self.devices), segment_bytes, stripe_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.segment_count * self.logical_segment_bytes

    @property
    def direct(self) -> bool:
        return all(d.direct for d in self.devices)

    def ops(
        self, kind: OpKind, segment: int, offset: int, bufs: Sequence[memoryview]
    ) -> list[IoOp]:
        """The per-path ops that move ``bufs`` to/from logical ``offset`` of ``segment``."""
        assert 0 <= segment < self.segment_count
        return self.layout.ops(kind, segment, offset, bufs)

    def fds(self) -> list[int]:
        return [d.fd for d in self.devices]

    def _abandon(self) -> None:
        """Close after a failed start, removing the files this start created."""
        created = [d.path for d in self.devices if d.created]
        self.close()
        for path in created:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        for fd in [d.fd for d in self.devices] + self._locks:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.devices = []
        self._locks = []


class AlignedBuffer:
    """Page-aligned anonymous memory for headers (O_DIRECT needs aligned memory)."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._map)

    def close(self) -> None:
        # A slice handed to an io op may still be referenced (by a finished
        # op's bookkeeping); then the mapping is freed with its last view.
        with contextlib.suppress(BufferError):
            self.view.release()
            self._map.close()


def lock_paths(paths: Sequence[str]) -> list[int]:
    """Take an exclusive ``flock`` on every path; the fds hold the locks until closed.

    The daemon (at start) and ``kvd fsck`` both call this, so neither runs on
    files the other is using. A lock held elsewhere raises DeviceError(EBUSY)
    at once (no waiting) after releasing the locks already taken; a missing
    path raises DeviceError(ENOENT), since locking must not create files.
    """
    fds: list[int] = []
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                what = f"cannot lock SSD path {path}: {exc.strerror}"
                raise DeviceError(exc.errno, what) from exc
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DeviceError(
                    errno.EBUSY, f"SSD path {path} is in use (another kvd holds its lock)"
                ) from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
