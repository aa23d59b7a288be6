"""The ``pool_members`` grammar: where the member list comes from.

- ``""``: no pool; a single-node daemon.
- ``static:HOST:PORT,HOST:PORT,...``: a fixed list (systemd fleets, tests).
- ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``: each daemon registers
  ``PREFIX/members/<advertise>`` under a lease and watches the prefix.
- ``dns://NAME:PORT``: the A/AAAA records of ``NAME`` (a Kubernetes headless
  Service), each ``ADDRESS:PORT``, resolved again every few seconds.

Members are gRPC addresses (the peers' ``listen``); IPv6 hosts in brackets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvd.config.addresses import parse_address

# A static list past this is a config mistake, not a fleet: placement costs
# one hash per member per key (kvd/cluster/rendezvous.py).
MEMBERS_MAX = 1024
ENDPOINTS_MAX = 16
# RFC 1035: labels of letters, digits and hyphens (underscores too, as
# Kubernetes' service names allow), 253 characters in all.
_DNS_NAME = re.compile(r"(?=.{1,253}\.?$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?)+")


@dataclass(frozen=True)
class PoolSpec:
    """A parsed ``pool_members``: ``kind`` is ``static``, ``etcd`` or ``dns``."""

    kind: str
    members: tuple[str, ...] = ()  # static: as written, duplicates kept (membership logs them)
    endpoints: tuple[tuple[str, int], ...] = ()  # etcd; dns: the one (name, port)
    prefix: str = ""  # etcd, without a trailing /


def normalize(address: str) -> str:
    """``HOST:PORT`` as members compare it (brackets kept for IPv6)."""
    host, port = parse_address(address.strip())
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_spec(text: str) -> PoolSpec | None:
    """The spec ``text`` names, None for an empty one; ValueError when malformed."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("static:"):
        items = [item for item in text[len("static:") :].split(",") if item.strip()]
        if not items:
            raise ValueError("static: names no member")
        if len(items) > MEMBERS_MAX:
            raise ValueError(f"static: {len(items)} members, at most {MEMBERS_MAX}")
        members = tuple(normalize(item) for item in items)
        for member in members:
            if parse_address(member)[1] == 0:
                raise ValueError(f"static: member {member} has port 0")
        return PoolSpec("static", members=members)
    if text.startswith("etcd://"):
        rest = text[len("etcd://") :]
        hosts, slash, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not slash or not prefix:
            raise ValueError(f"{text!r}: write etcd://HOST:PORT[,HOST:PORT]/PREFIX")
        endpoints = tuple(parse_address(item) for item in hosts.split(",") if item)
        if not endpoints or len(endpoints) > ENDPOINTS_MAX:
            raise ValueError(f"{text!r}: name 1 to {ENDPOINTS_MAX} etcd endpoints")
        return PoolSpec("etcd", endpoints=endpoints, prefix="/" + prefix)
    if text.startswith("dns://"):
        name, port = parse_address(text[len("dns://") :])
        if not _DNS_NAME.fullmatch(name) or port == 0:
            raise ValueError(f"{text!r}: write dns://NAME:PORT (a DNS name and the gRPC port)")
        return PoolSpec("dns", endpoints=((name.rstrip("."), port),))
    raise ValueError(f"{text!r}: pool_members starts with static:, etcd:// or dns://")
