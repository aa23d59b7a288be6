"""This daemon's NIXL agent: the L1 arena registered once, the other
members' agents added from the metadata they send, and one-sided READs of
a peer's pool pages straight into this daemon's pool pages.

NIXL (PyPI ``nixl-cu12``, the ``pool`` extra; installed with ``--no-deps``:
it declares torch but does not import it) is optional. ``start`` answers a
``NixlNode`` or, where NIXL does not import or its UCX backend does not
start, the reason, which the pool logs once at start-up; the pool then reads
values over bulk TCP (kvd.cluster.peer_reads). UCX picks the transport: RDMA
verbs where the NIC has them, shared memory (cma) between processes on one
host, TCP otherwise. Measured here between two processes: 4 MiB READs at
~3-6 GB/s over UCX's default transports after the first (the first, which
connects, took ~70 ms).

The control step (which pages hold a value, pinned until the reader says it
is done) travels on the bulk TCP connection (``OP_NIXL_*`` in
kvd.wire.bulk), authenticated by the pool token in its HELLO.

The agent runs without NIXL's progress thread: with it each idle daemon
spent ~27 % of a core polling (0.8 CPU-s in 3 s, measured here), which a
2-CPU node cannot give. Instead the reader polls its transfer from the event
loop (``check_xfer_state`` progresses its side), and the owner progresses
its side (``get_new_notifs``, every ``PROGRESS_S``) only while it holds a
pin for a member's read (``hold`` / ``unhold``): UCX's TCP and shared-memory
transports need the target to progress, RDMA READs do not. A read
cancelled or timed out is released; NIXL cancels it if it can. Until the
transfer is known to have stopped, the pages it writes into are not given
back: a reaper task waits up to ``STOP_WAIT_S`` for that (the event loop
never blocks) and, when it did not stop, keeps those pages out of use
(counted, logged) rather than let a late write land in another value.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("kvd.cluster")

# Whether a UCX backend was created in this process. UCX's library teardown
# at interpreter exit crashed (SIGSEGV) on the development VM (AMD EPYC,
# nixl-cu12 1.5.1) once any agent with a UCX backend had existed, even after
# it was closed and deleted; a process that loaded it ends with os._exit
# once its own shutdown is done (``exit_past_ucx``).
_ucx_loaded = False


def ucx_loaded() -> bool:
    return _ucx_loaded


def exit_past_ucx(code: int) -> None:
    """Return when this process never loaded UCX; else flush what it wrote
    and end it now with ``code``, skipping the library teardown."""
    if not _ucx_loaded:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# Poll of a transfer in flight: starts at 50 µs (a 64 KiB READ over shm takes
# ~20-40 µs) and doubles up to 1 ms (a 4 MiB READ over tcp takes 1-4 ms).
# Polling at every turn of the loop instead (and the owner progressing at
# every turn) read 4 MiB values no faster between network namespaces on a
# loaded 2-CPU VM (0.13 GB/s against 0.27 GB/s with these pauses, one run
# each), and it spends CPU the node's engines need.
POLL_S_MIN = 0.00005
POLL_S_MAX = 0.001
# The owner's progress while it holds pins: a 64 KiB READ's turn is ~30 µs.
PROGRESS_S = 0.0002
# A cancelled transfer is waited for this long before its pages are written
# off: a READ posted on a live connection ends within a round trip.
STOP_WAIT_S = 2.0
# Descriptors one read may have (a value's runs on both sides, intersected):
# a 32 MiB value in 64 KiB pages is at most 512 runs per side.
SEGMENTS_MAX = 2048


class NixlError(Exception):
    """A NIXL call failed (the read is a miss)."""


def _import_api() -> Any:
    """``nixl._api`` under the name the installed wheel gives it."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def view_address(view: memoryview) -> int:
    """The address of a memoryview's first byte (of the pool arena)."""
    array = np.frombuffer(view, dtype=np.uint8)
    address: int = array.ctypes.data
    del array  # the export ends here: the arena can close later
    return address


def segments(views: Sequence[memoryview]) -> list[tuple[int, int]]:
    """(address, length) of each view, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for view in views:
        if not len(view):
            continue
        address = view_address(view)
        if out and out[-1][0] + out[-1][1] == address:
            out[-1] = (out[-1][0], out[-1][1] + len(view))
        else:
            out.append((address, len(view)))
    return out


def pair_segments(
    local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Split two lists of segments covering the same bytes at each other's
    boundaries, so the i-th local and i-th remote descriptor have one length."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise NixlError("local and remote segments cover different lengths")
    mine: list[tuple[int, int, int]] = []
    theirs: list[tuple[int, int, int]] = []
    i = j = 0
    li = rj = 0  # bytes used of local[i], remote[j]
    while i < len(local) and j < len(remote):
        take = min(local[i][1] - li, remote[j][1] - rj)
        mine.append((local[i][0] + li, take, 0))
        theirs.append((remote[j][0] + rj, take, 0))
        li += take
        rj += take
        if li == local[i][1]:
            i, li = i + 1, 0
        if rj == remote[j][1]:
            j, rj = j + 1, 0
    if len(mine) > SEGMENTS_MAX:
        raise NixlError(f"{len(mine)} descriptors in one read, over {SEGMENTS_MAX}")
    return mine, theirs


class NixlNode:
    """The agent, its registered arena and the peers' agents."""

    def __init__(self, api: Any, agent: Any, registered: Any, name: str) -> None:
        self._api = api
        self._agent = agent
        self._registered = registered
        self.name = name
        self.metadata: bytes = agent.get_agent_metadata()
        self._remote: dict[bytes, str] = {}  # metadata -> agent name
        self.stuck = 0  # transfers that did not stop when cancelled (their pages kept)
        self._holds = 0
        self._progress: asyncio.Task[None] | None = None
        self._reapers: set[asyncio.Task[None]] = set()

    @classmethod
    def start(cls, arena: memoryview, name: str) -> NixlNode | str:
        """An agent with ``arena`` registered, or why there is none."""
        try:
            api = _import_api()
        except ImportError as exc:
            return f"nixl does not import ({exc})"
        try:
            # One backend only: GDS and libfabric need CUDA / libfabric and are not used.
            config = api.nixl_agent_config(enable_prog_thread=False, backends=[])
            agent = api.nixl_agent(f"kvd-{name}-{os.getpid()}", config)
            options = {}
            if os.environ.get("UCX_TLS", "") == "shm":
                # UCX's shm transports have no peer-failure detection.
                options["ucx_error_handling_mode"] = "none"
            agent.create_backend("UCX", options)
            global _ucx_loaded
            _ucx_loaded = True
            registered = agent.register_memory([(view_address(arena), len(arena), 0, "")], "DRAM")
        except Exception as exc:  # any failure of the native agent means bulk TCP
            return f"nixl agent did not start ({type(exc).__name__}: {exc})"
        return cls(api, agent, registered, name)

    def hold(self) -> None:
        """A member is about to READ pinned pages: progress this side meanwhile."""
        self._holds += 1
        if self._progress is None or self._progress.done():
            self._progress = asyncio.get_running_loop().create_task(self._progress_loop())

    def unhold(self) -> None:
        self._holds -= 1
        assert self._holds >= 0, "unhold without hold"

    def progress(self) -> None:
        """Progress this side's transfers once (the UCX worker); no notifications are sent."""
        self._agent.get_new_notifs()

    async def _progress_loop(self) -> None:
        while self._holds > 0:
            self.progress()
            await asyncio.sleep(PROGRESS_S)

    def remote(self, metadata: bytes) -> str:
        """The agent name of a peer, its metadata loaded once."""
        found = self._remote.get(metadata)
        if found is None:
            try:
                added = self._agent.add_remote_agent(metadata)
            except Exception as exc:  # a peer's bad metadata is its error
                raise NixlError(f"peer agent metadata refused: {exc}") from None
            found = added.decode() if isinstance(added, bytes) else str(added)
            self._remote[metadata] = found
        return found

    def forget(self, metadata: bytes) -> None:
        """Drop a peer's agent (it left, or restarted with new metadata)."""
        name = self._remote.pop(metadata, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # already gone
                log.debug("nixl remote agent not removed", extra={"peer_agent": name})

    async def read(
        self,
        peer: str,
        local: Sequence[tuple[int, int]],
        remote: Sequence[tuple[int, int]],
        give_back: Callable[[], None],
    ) -> None:
        """READ ``remote`` segments of agent ``peer`` into ``local`` ones, then
        call ``give_back`` (the caller's pages are free to go: publish or abort).

        Raises NixlError on failure. A transfer that fails or is cancelled
        after it was posted is released, which cancels it where the backend
        can; one that cannot be released yet is left to a reaper task, which
        calls ``give_back`` once it stopped (within ``STOP_WAIT_S``), or never
        (its pages then stay out of use, counted in ``stuck``): a late write
        must not land in pages that hold another value by then. The event
        loop never blocks on it."""
        try:
            mine, theirs = pair_segments(local, remote)
        except NixlError:
            give_back()  # nothing was posted
            raise
        await self.read_paired(peer, mine, theirs, give_back)

    async def read_paired(
        self,
        peer: str,
        mine: Sequence[tuple[int, int, int]],
        theirs: Sequence[tuple[int, int, int]],
        give_back: Callable[[], None],
    ) -> None:
        """``read`` of descriptors already paired (``pair_segments``; several
        values' side by side, at most ``SEGMENTS_MAX``): one transfer."""
        if len(mine) > SEGMENTS_MAX:
            give_back()
            raise NixlError(f"{len(mine)} descriptors in one read, over {SEGMENTS_MAX}")
        agent = self._agent
        try:
            local_descs = agent.get_xfer_descs(mine, "DRAM")
            remote_descs = agent.get_xfer_descs(theirs, "DRAM")
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        except Exception as exc:  # NIXL raises its own nixl errors
            give_back()
            raise NixlError(f"nixl read not prepared: {exc}") from None
        try:
            state = agent.transfer(handle)
            pause = POLL_S_MIN
            while state == "PROC":
                await asyncio.sleep(pause)
                pause = min(pause * 2, POLL_S_MAX)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlError(f"nixl read ended in state {state}")
        except BaseException:
            self._end(handle, give_back)
            raise
        self._end(handle, give_back)

    def _end(self, handle: Any, give_back: Callable[[], None]) -> None:
        """Release a transfer and give its pages back, now or once it stopped."""
        try:
            handle.release()  # cancels a transfer still in flight where it can
        except Exception:  # not cancellable now: wait for it to end, off the loop's path
            task = asyncio.get_running_loop().create_task(self._reap(handle, give_back))
            self._reapers.add(task)
            task.add_done_callback(self._reapers.discard)
            return
        give_back()

    async def _reap(self, handle: Any, give_back: Callable[[], None]) -> None:
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_S_MAX)
            if self._agent.check_xfer_state(handle) != "PROC":
                try:
                    handle.release()
                except Exception:  # kept in the agent's leak list
                    log.warning("nixl transfer handle not released")
                give_back()
                return
        self.stuck += 1
        log.error("a cancelled nixl read did not stop; its pages are kept out of use")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.cancel()
        for metadata in list(self._remote):
            self.forget(metadata)
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # at shutdown
            log.warning("nixl arena not deregistered")
