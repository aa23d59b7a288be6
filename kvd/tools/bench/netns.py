"""Nodes in network namespaces on one private bridge, for the pool's
benchmark and failure tests.

A ``Lab`` makes ``count`` node namespaces and one switch namespace holding a
bridge; each node gets a veth pair (``eth0`` inside the node, ``nI`` on the
bridge) and the address ``10.77.0.(I+1)/24``. Nothing is added to the root
namespace: the subnet exists only on that bridge, so two labs (two runs at
once) never see each other's addresses, and the root namespace's firewall
never sees the traffic. Cutting a node's link (``link_down``) sets its port
on the bridge down, as unplugging its cable would.

Names carry ``kvdn-<pid>-<seq>-``: a lab whose process died (a crashed run)
is swept at the next lab's start, processes inside it first. Root only
(``ip netns`` needs CAP_SYS_ADMIN): ``unavailable()`` says why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

PREFIX = "kvdn-"
SUBNET = "10.77.0"
NODES_MAX = 64
# One `ip` command: milliseconds normally; a stuck one is a broken lab.
IP_TIMEOUT_S = 10.0
_CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}(\d+)-")  # a lab's, or a probe's
_sequence = itertools.count()
_sequence_lock = threading.Lock()
_probed: list[str] = []

T = TypeVar("T")


class NetnsError(RuntimeError):
    """An ``ip`` command failed."""


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str:
    """Why labs cannot be made here, or "" when they can (checked once)."""
    if not _probed:
        _probed.append(_probe())
    return _probed[0]


def _probe() -> str:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    name = f"{PREFIX}{os.getpid()}-probe-"
    try:
        ip("netns", "add", name)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add is not permitted here: {exc}"
    ip("netns", "del", name, check=False)
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    """SIGKILL what runs in ``namespace`` (processes a lab started there)."""
    for pid in ip("netns", "pids", namespace, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep_leftovers() -> list[str]:
    """Remove the namespaces of labs whose process is gone; their names."""
    swept = []
    for name in _namespaces():
        found = _NAME.match(name)
        if found is None or _pid_alive(int(found.group(1))):
            continue
        _kill_inside(name)
        ip("netns", "del", name, check=False)
        swept.append(name)
    return swept


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    address: str  # without the prefix length
    port_link: str  # its port on the bridge, in the switch namespace


class Lab:
    """``count`` nodes on one bridge; a context manager that removes them all."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= NODES_MAX:
            raise ValueError(f"count must be in 1..{NODES_MAX}, got {count}")
        reason = unavailable()
        if reason:
            raise NetnsError(reason)
        sweep_leftovers()
        with _sequence_lock:
            seq = next(_sequence)
        self.tag = f"{PREFIX}{os.getpid()}-{seq}-"
        self.switch = self.tag + "sw"
        self.nodes = [Node(i, f"{self.tag}{i}", f"{SUBNET}.{i + 1}", f"n{i}") for i in range(count)]
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            ip("netns", "add", node.namespace)
            self._made.append(node.namespace)
            ip("-n", self.switch, "link", "add", node.port_link, "type", "veth",
               "peer", "name", "eth0", "netns", node.namespace)  # fmt: skip
            ip("-n", self.switch, "link", "set", node.port_link, "master", "br0", "up")
            ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
            ip("-n", node.namespace, "link", "set", "eth0", "up")
            ip("-n", node.namespace, "link", "set", "lo", "up")

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs inside the nodes and delete every namespace (and with
        them the bridge and the veth pairs)."""
        for name in reversed(self._made):
            _kill_inside(name)
            ip("netns", "del", name, check=False)
        self._made.clear()

    def link_down(self, index: int) -> None:
        ip("-n", self.switch, "link", "set", self.nodes[index].port_link, "down")

    def link_up(self, index: int) -> None:
        ip("-n", self.switch, "link", "set", self.nodes[index].port_link, "up")

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``index`` (for subprocess)."""
        return ["ip", "netns", "exec", self.nodes[index].namespace, *argv]

    def call_in(self, index: int, work: Callable[[], T]) -> T:
        """``work()`` in a thread of this process that entered node ``index``'s
        namespace: the sockets it opens are that node's."""
        return call_in_namespace(self.nodes[index].namespace, work)


def call_in_namespace(namespace: str, work: Callable[[], T]) -> T:
    """Run ``work`` in a short-lived thread inside ``namespace`` (a network
    namespace is per thread; the thread ends with it, so no other code runs
    there)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def enter_and_run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({namespace})")
            finally:
                os.close(fd)
            result.append(work())
        except BaseException as exc:  # re-raised in the caller
            failure.append(exc)

    thread = threading.Thread(target=enter_and_run, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
