"""RAM-backed loop devices for ``kvd bench l2 --ramdisk``: a fast device anyone
can make.

A file on tmpfs (``/dev/shm``) attached with ``losetup --direct-io=on`` is a
block device that takes O_DIRECT and answers at memory speed (fio io_uring
random 64 KiB reads: 5-7 GB/s on this 2-core VM), standing in for an NVMe
SSD whose speed the VM's own disk hides. ``ramdisks`` makes ``count`` of
them (optionally with ext4 on each, mounted), yields their paths, and takes
everything down again however the bench ends. It needs root and losetup;
anything it cannot do raises ``RamdiskError`` with the reason.

A RAM-backed device is faster than the two cores that drive it, so N of them
read no faster than one. ``read_bps`` caps each device's reads (the kernel's
block throttle: a blkio cgroup, or io.max under cgroup v2, that this
process joins for the run, fio included), as each SSD of a RAID0 has its own
bandwidth: then striping over N devices shows as N times one's throughput.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

SHM_DIR = Path("/dev/shm")
CGROUP_ROOT = Path("/sys/fs/cgroup")
RAMDISKS_MAX = 8
COMMAND_TIMEOUT_S = 60
FILESYSTEMS = ("none", "ext4")


class RamdiskError(RuntimeError):
    """A RAM-backed loop device could not be made here."""


def _run(*args: str) -> str:
    try:
        out = subprocess.run(
            list(args), check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise RamdiskError(f"{' '.join(args)} failed: {detail.strip()}") from exc
    return out.stdout.strip()


def check_can_make(count: int, size_bytes: int) -> None:
    """Raise RamdiskError unless ``count`` ramdisks of ``size_bytes`` can be made."""
    if not 1 <= count <= RAMDISKS_MAX:
        raise RamdiskError(f"ramdisk count must be in 1..{RAMDISKS_MAX}, got {count}")
    if os.geteuid() != 0:
        raise RamdiskError("RAM-backed loop devices need root (losetup, mount)")
    if shutil.which("losetup") is None:
        raise RamdiskError("losetup is not installed (util-linux)")
    if not SHM_DIR.is_dir():
        raise RamdiskError(f"{SHM_DIR} (tmpfs) is missing")
    free_bytes = shutil.disk_usage(SHM_DIR).free
    if count * size_bytes > free_bytes // 2:
        raise RamdiskError(
            f"{count} x {size_bytes} bytes of ramdisk would take more than half of "
            f"{SHM_DIR}'s {free_bytes} free bytes"
        )


@contextlib.contextmanager
def ramdisks(
    count: int, size_bytes: int, fs: str = "none", read_bps: int = 0
) -> Iterator[list[str]]:
    """Yield ``count`` RAM-backed devices: ``/dev/loopN`` paths (fs ``none``) or
    the directories where each one's ext4 is mounted (fs ``ext4``), each read
    at most ``read_bps`` bytes a second by this process when that is not 0."""
    if fs not in FILESYSTEMS:
        raise RamdiskError(f"ramdisk file system must be one of {FILESYSTEMS}, got {fs!r}")
    check_can_make(count, size_bytes)
    if fs == "ext4" and shutil.which("mkfs.ext4") is None:
        raise RamdiskError("mkfs.ext4 is not installed (e2fsprogs)")
    with contextlib.ExitStack() as undo:
        backing = Path(tempfile.mkdtemp(prefix="kvd-ramdisk-", dir=SHM_DIR))
        undo.callback(shutil.rmtree, backing, True)
        paths: list[str] = []
        devices: list[str] = []
        for i in range(count):
            image = backing / f"disk{i}.img"
            with open(image, "wb") as file:
                file.truncate(size_bytes)
            device = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
            undo.callback(_run, "losetup", "--detach", device)
            devices.append(device)
            if fs == "none":
                paths.append(device)
                continue
            _run("mkfs.ext4", "-q", "-F", device)
            mount = Path(tempfile.mkdtemp(prefix=f"kvd-ramdisk{i}-"))
            undo.callback(os.rmdir, mount)
            _run("mount", device, str(mount))
            undo.callback(_run, "umount", str(mount))
            paths.append(str(mount))
        if read_bps:
            undo.enter_context(_read_throttled(devices, read_bps))
        yield paths


@contextlib.contextmanager
def _read_throttled(devices: list[str], read_bps: int) -> Iterator[None]:
    """This process (and what it starts) in a cgroup that caps its reads of
    each device at ``read_bps``; back where it was afterwards."""
    numbers = [f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
               for st in (os.stat(d) for d in devices)]  # fmt: skip
    v1 = CGROUP_ROOT / "blkio"
    if (v1 / "blkio.throttle.read_bps_device").exists():
        group, limit_file = v1 / f"kvd-bench-{os.getpid()}", "blkio.throttle.read_bps_device"
        lines = [f"{number} {read_bps}" for number in numbers]
        home = v1
    else:
        unified = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else None
        if unified is None or "io" not in (unified / "cgroup.controllers").read_text().split():
            raise RamdiskError("no block throttle here (neither a blkio cgroup nor cgroup v2 io)")
        group, limit_file = unified / f"kvd-bench-{os.getpid()}", "io.max"
        lines = [f"{number} rbps={read_bps}" for number in numbers]
        home = unified
        with contextlib.suppress(OSError):
            (unified / "cgroup.subtree_control").write_text("+io")
    try:
        group.mkdir()
        for line in lines:
            (group / limit_file).write_text(line)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        raise RamdiskError(f"cannot throttle reads in {group}: {exc}") from exc
    try:
        yield
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
