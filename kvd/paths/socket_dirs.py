"""The daemon's Unix-socket directories and paths: made the daemon's alone,
and a socket path claimed only when nobody still serves it.

Used for the shm socket (``kvd.paths.shm.channel``) and for the gRPC socket when
it sits in the shm directory, its default (``kvd.daemon.server``).
"""

from __future__ import annotations

import logging
import os
import socket
import stat

log = logging.getLogger("kvd.paths.shm.regions")

# The socket's directory when the daemon creates it: the group may reach the
# socket (x) and list it (r); nobody but the daemon may create or unlink
# anything there, and the sticky bit keeps that so if someone adds write bits.
DIR_MODE = 0o1750


def secure_directory(path: str, group_id: int = -1) -> None:
    """Make ``path`` a directory where only this daemon can place or remove
    files; OSError when it exists and is not (and cannot be made) one.

    Created here: mode ``DIR_MODE`` set with ``chmod`` (``makedirs`` modes
    pass through the umask: 0o770 gave 0o750 under umask 022). Existing: a
    directory (not a link) owned by this uid or root, and sticky if anyone
    else may write it; one of ours that is not gets the sticky bit."""
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
        created = True
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a directory")
    me = os.geteuid()
    if created:
        if group_id >= 0:
            os.chown(path, -1, group_id)
        os.chmod(path, DIR_MODE)
        return
    if info.st_uid not in (me, 0):
        raise OSError(f"{path} belongs to uid {info.st_uid}, not to this daemon (uid {me})")
    others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if others_write and not info.st_mode & stat.S_ISVTX:
        if info.st_uid != me:
            raise OSError(
                f"{path} is writable by others and not sticky: they could replace the socket"
            )
        os.chmod(path, stat.S_IMODE(info.st_mode) | stat.S_ISVTX)


def claim_socket_path(path: str) -> None:
    """Remove a stale socket file, or one another uid put there (the
    directory is ours: nobody else may hold a name in it); refuse one that
    another daemon of ours still serves."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    if info.st_uid != os.geteuid():
        log.warning("socket taken back", extra={"path": path, "uid": info.st_uid})
        os.unlink(path)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left by a daemon that died
        return
    finally:
        probe.close()
    raise OSError(f"{path} is served by another process")
