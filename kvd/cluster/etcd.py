"""Pool membership from etcd: this daemon registers ``PREFIX/members/<advertise>``
under a lease and watches ``PREFIX/members/``; every change re-reads the list.

One task runs a session at a time against one endpoint (the next endpoint
on failure): grant a lease of ``ttl_s``, put the key under it, read the
members, then watch and refresh the lease every ``ttl_s / 3``. Any failure
(etcd gone, lease lost) ends the session: the membership is marked stale and
kept as it was, and a new session starts after a pause. A daemon that dies
stops refreshing and its key goes with its lease, within ``ttl_s``.

A value under the prefix that is not HOST:PORT is garbage: one warning per
key, then ignored. Each etcd call is bounded by ``CALL_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aetcd

from kvd.cluster.etcd_tls import EtcdCredentials, TlsClient
from kvd.cluster.membership import Membership, parse_member
from kvd.config.pool_members import PoolSpec

log = logging.getLogger("kvd.cluster.etcd")

# One etcd round trip on a LAN is ~1 ms; 2 s means etcd is gone or stuck.
CALL_TIMEOUT_S = 2.0
# Pause between sessions: soon enough to be back within a lease, not a spin.
RETRY_S_MIN = 0.2
RETRY_S_MAX = 5.0
# Garbage keys remembered (to warn once each); past it, new ones are not logged.
GARBAGE_KEYS_MAX = 1024


class EtcdMembers:
    """Registers this daemon in etcd and feeds ``membership`` from the prefix."""

    def __init__(
        self, spec: PoolSpec, membership: Membership, ttl_s: int,
        tls: EtcdCredentials | None = None,
    ) -> None:  # fmt: skip
        """``tls``: etcd over TLS, its files read for each session
        (``kvd.cluster.etcd_tls``); None: in clear."""
        assert spec.kind == "etcd"
        self.spec = spec
        self.tls = tls
        self.membership = membership
        self.ttl_s = ttl_s
        self.key = f"{spec.prefix}/members/{membership.advertise}".encode()
        self.members_prefix = f"{spec.prefix}/members/".encode()
        self.sessions = 0
        self.connected = False
        self._garbage: set[bytes] = set()
        self._task: asyncio.Task[None] | None = None
        self._lease: Any = None
        self._client: Any = None
        self._first = asyncio.Event()

    @property
    def source(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.spec.endpoints)
        return f"etcd://{hosts}{self.spec.prefix}"

    async def start(self, wait_s: float) -> None:
        """Start the session task; wait up to ``wait_s`` for a first member list."""
        self._task = asyncio.create_task(self._run(), name="kvd-pool-etcd")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._first.wait()
        if not self._first.is_set():
            self.membership.set_stale(True, self.source, "no answer at start")

    async def stop(self) -> None:
        """End the session and revoke the lease (others see this daemon leave at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease is not None and self._client is not None:
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await self._client.revoke_lease(self._lease.id)
            except (Exception, TimeoutError) as exc:
                log.info("could not revoke the etcd lease", extra={"error": str(exc)})
        await self._close_client()

    async def _close_client(self) -> None:
        client, self._client, self._lease = self._client, None, None
        if client is not None:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await client.close()

    async def _run(self) -> None:
        attempt = 0
        pause_s = RETRY_S_MIN
        while True:
            host, port = self.spec.endpoints[attempt % len(self.spec.endpoints)]
            attempt += 1
            if self.tls is None:
                self._client = aetcd.Client(host, port, timeout=CALL_TIMEOUT_S)
            else:
                self._client = TlsClient(host, port, self.tls.fresh(), timeout=CALL_TIMEOUT_S)
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (Exception, TimeoutError) as exc:
                self.connected = False
                self.membership.set_stale(True, self.source, f"{host}:{port}: {exc!r}")
            else:
                pause_s = RETRY_S_MIN
            await self._close_client()
            await asyncio.sleep(pause_s)
            pause_s = min(RETRY_S_MAX, pause_s * 2)

    async def _session(self) -> None:
        client = self._client
        async with asyncio.timeout(CALL_TIMEOUT_S):
            self._lease = await client.lease(self.ttl_s)
            await client.put(self.key, self.membership.advertise.encode(), lease=self._lease)
            watch = await client.watch_prefix(self.members_prefix)
        self.sessions += 1
        try:
            await self._read()
            self.connected = True
            self.membership.set_stale(False, self.source)
            refresh = asyncio.create_task(self._refresh(), name="kvd-pool-etcd-lease")
            follow = asyncio.create_task(self._follow(watch), name="kvd-pool-etcd-watch")
            try:
                done, _ = await asyncio.wait((refresh, follow), return_when="FIRST_COMPLETED")
            finally:
                for task in (refresh, follow):
                    task.cancel()
                await asyncio.gather(refresh, follow, return_exceptions=True)
            for task in done:
                task.result()  # raises what ended the session
        finally:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await watch.cancel()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            async with asyncio.timeout(CALL_TIMEOUT_S):
                reply = await self._client.refresh_lease(self._lease.id)
            if reply is None or reply.TTL <= 0:
                raise ConnectionError("the etcd lease expired")

    async def _follow(self, watch: Any) -> None:
        async for _event in watch:
            await self._read()
        raise ConnectionError("the etcd watch ended")

    async def _read(self) -> None:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            found = await self._client.get_prefix(self.members_prefix)
        members = []
        for kv in found:
            member = parse_member(kv.value)
            if member is None:
                if kv.key not in self._garbage and len(self._garbage) < GARBAGE_KEYS_MAX:
                    self._garbage.add(kv.key)
                    log.warning(
                        "garbage under the etcd pool prefix (not HOST:PORT); ignored",
                        extra={"key": kv.key.decode("utf-8", "replace"), "value": kv.value[:64]},
                    )
                continue
            members.append(member)
        if self.key not in {kv.key for kv in found}:
            # The lease expired while we were away and took the key: register again.
            raise ConnectionError("this daemon's etcd key is gone")
        self.membership.update(members, self.source)
        self._first.set()
