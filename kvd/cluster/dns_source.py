"""Pool membership from DNS: the A and AAAA records of one name, each an
address of a member listening on the name's port.

This is the DaemonSet's source: a Kubernetes headless Service answers its
name with the address of every pod it selects (``publishNotReadyAddresses``
makes a starting pod see itself at once), so ``dns://kvd-pool.NS.svc.cluster.local:7070``
names every node's daemon. The name is resolved again every
``pool_dns_refresh_ms``; the records feed ``Membership``, which refuses a list
that does not name this daemon (``pool_advertise``, the pod's IP) as it
does for the other sources.

- **A name with no records** (NXDOMAIN, or no A/AAAA) is an empty list:
  refused, the previous members stay.
- **DNS unreachable** (timeout, refused, no server): the last list stays and
  the membership is marked stale until an answer comes.

The resolver is dnspython's asyncio resolver, asking the servers of
``/etc/resolv.conf`` or the one ``pool_dns_server`` names (tests). Each
resolution is bounded by ``CALL_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from kvd.cluster.membership import Membership
from kvd.config.addresses import parse_address
from kvd.config.pool_members import MEMBERS_MAX, PoolSpec, normalize

log = logging.getLogger("kvd.cluster.dns")

# A DNS answer on a LAN takes ~1 ms; CoreDNS answers a cluster name from its
# cache. 2 s means the server is gone (dnspython retries within this lifetime).
CALL_TIMEOUT_S = 2.0
RECORD_TYPES = ("A", "AAAA")


class DnsUnreachable(Exception):
    """No DNS server answered (timeout, refused, none configured)."""


class DnsMembers:
    """Resolves the pool's name every ``refresh_s`` and feeds ``membership``."""

    def __init__(
        self, spec: PoolSpec, membership: Membership, server: str, refresh_s: float
    ) -> None:
        assert spec.kind == "dns"
        ((self.name, self.port),) = spec.endpoints
        self.membership = membership
        self.refresh_s = refresh_s
        self.resolutions = 0
        self.errors = 0
        self.resolver = dns.asyncresolver.Resolver(configure=not server)
        if server:
            host, port = parse_address(server)
            ipaddress.ip_address(host)  # dnspython asks addresses only; ValueError otherwise
            self.resolver.nameservers = [dns.nameserver.Do53Nameserver(host, port)]
        self.resolver.lifetime = CALL_TIMEOUT_S
        self.resolver.timeout = CALL_TIMEOUT_S / 4  # per try; the lifetime bounds the retries
        self._task: asyncio.Task[None] | None = None

    @property
    def source(self) -> str:
        return f"dns://{self.name}:{self.port}"

    async def start(self) -> None:
        """Resolve once (bounded by ``CALL_TIMEOUT_S``), then keep resolving in a task."""
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="kvd-pool-dns")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Resolve the name and hand its members on; an unreachable DNS keeps the last."""
        try:
            members = await self.resolve()
        except DnsUnreachable as exc:
            self.errors += 1
            self.membership.set_stale(True, self.source, str(exc))
            return
        self.resolutions += 1
        self.membership.set_stale(False, self.source)
        self.membership.update(members, self.source)

    async def resolve(self) -> list[str]:
        """The members the name's A and AAAA records give, sorted; [] for no records."""
        answers = await asyncio.gather(*(self._records(kind) for kind in RECORD_TYPES))
        addresses = sorted({address for answer in answers for address in answer})
        if len(addresses) > MEMBERS_MAX:
            log.warning(
                "the pool's DNS name has more records than members allowed; the first kept",
                extra={"source": self.source, "records": len(addresses), "kept": MEMBERS_MAX},
            )
            addresses = addresses[:MEMBERS_MAX]
        return [normalize(f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}")
                for a in addresses]  # fmt: skip

    async def _records(self, kind: str) -> list[str]:
        try:
            answer = await self.resolver.resolve(self.name, kind, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.resolver.NoNameservers, dns.resolver.LifetimeTimeout) as exc:
            raise DnsUnreachable(f"{kind} {self.name}: {exc}") from None
        except dns.exception.DNSException as exc:
            raise DnsUnreachable(f"{kind} {self.name}: {exc!r}") from None
        return [record.to_text() for record in answer]
