"""Builds this daemon's part of the pool from the settings: the membership
and its source, the peer channels and the router, and hooks the router into
the store. ``kvd.daemon.server`` calls ``start_pool`` once gRPC serves (peers that
see this daemon can reach it) and ``PoolNode.leave`` first at shutdown (etcd
sees it leave at once), ``PoolNode.close`` once RPCs have drained.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
from typing import TYPE_CHECKING

from kvd.cluster.membership import Membership
from kvd.cluster.nixl_node import NixlNode
from kvd.cluster.peer_bulk import BulkPeers
from kvd.cluster.peer_reads import PeerReads
from kvd.cluster.peer_tls import peer_bulk_tls, peer_tls
from kvd.cluster.peers import Peers
from kvd.cluster.router import PoolRouter
from kvd.config.addresses import parse_address
from kvd.config.pool_members import parse_spec
from kvd.config.settings import Config, ConfigError
from kvd.store.store import Store

if TYPE_CHECKING:
    from kvd.cluster.dns_source import DnsMembers
    from kvd.cluster.etcd import EtcdMembers

log = logging.getLogger("kvd.cluster")

# How long start-up waits for etcd's first member list; past it the daemon
# serves alone (stale) and joins when etcd answers.
ETCD_START_WAIT_S = 3.0
# A pool token file holds one token (auth.TOKEN_BYTES_MAX is 4 KiB).
TOKEN_FILE_MAX_BYTES = 4096
# Where the kernel lists RDMA devices (InfiniBand, RoCE, EFA, iWARP).
RDMA_DEVICES = "/sys/class/infiniband"


# The pool's metrics: stat name -> (metric name, help), read by the server's collector.
POOL_GAUGES = {
    "members": ("kvd_cluster_members", "Members of the pool this daemon places keys over"),
    "membership_stale": (
        "kvd_cluster_membership_stale",
        "1 while the membership source (etcd) is unreachable and the last members are kept",
    ),
    "forward_queue": ("kvd_cluster_forward_queue", "Puts waiting to be handed to their owner"),
    "hint_pinned_bytes": (
        "kvd_cluster_hint_pinned_bytes",
        "L1 bytes this owner pins for other members' lookup hints (pool_lookup_hint_ms)",
    ),
}
POOL_COUNTERS = {
    "membership_changes": ("kvd_cluster_membership_changes", "Member lists accepted"),
    "membership_refused": (
        "kvd_cluster_membership_refused",
        "Member lists ignored (not naming this daemon)",
    ),
    "etcd_sessions": ("kvd_cluster_etcd_sessions", "etcd sessions begun (registrations)"),
    "remote_lookups": (
        "kvd_cluster_remote_lookups",
        "Lookup and Exists calls that asked other members",
    ),
    "remote_lookup_hits": ("kvd_cluster_remote_lookup_hits", "Chain keys found on other members"),
    "hinted_lookups": (
        "kvd_cluster_hinted_lookups",
        "Lookups answered from the owners' recent answers without asking them "
        "(pool_lookup_hint_ms)",
    ),
    "hint_refreshes": (
        "kvd_cluster_hint_refreshes",
        "Hinted lookups whose owners were asked again in the background, keeping the "
        "chain's hints fresh",
    ),
    "hint_refreshes_skipped": (
        "kvd_cluster_hint_refreshes_skipped",
        "Hint refreshes due but not started (too many running): the hints age out",
    ),
    "hints_kept": (
        "kvd_cluster_hints_kept",
        "Keys this owner answered held and keeps for the asking member's lookup hints",
    ),
    "hints_not_kept": (
        "kvd_cluster_hints_not_kept",
        "Keys this owner answered held but could not keep for hints (only on L2, or its "
        "share of L1 for them full): asked again",
    ),
    "shares_learned": (
        "kvd_cluster_shares_learned",
        "Other members' chain lookups this member's eviction policy learned its share of",
    ),
    "remote_gets": ("kvd_cluster_remote_gets", "Gets sent to the key's owner"),
    "prefetched": (
        "kvd_cluster_prefetched",
        "Values leased lookups found at their owners and started fetching before their get "
        "(pool_prefetch_keys)",
    ),
    "prefetches_dropped": (
        "kvd_cluster_prefetches_dropped",
        "Leased lookups whose values found elsewhere were not fetched ahead: too many ran",
    ),
    "nixl_read_batches": (
        "kvd_cluster_nixl_read_batches",
        "NIXL reads of one owner's values made together: pins on one connection, one transfer",
    ),
    "nixl_batched_reads": ("kvd_cluster_nixl_batched_reads", "Values read in those batches"),
    "remote_get_batches": (
        "kvd_cluster_remote_get_batches",
        "Batched gets whose values held elsewhere were read from their owners together",
    ),
    "remote_hits": ("kvd_cluster_remote_hits", "Values fetched from their owner into L1"),
    "remote_misses": ("kvd_cluster_remote_misses", "Gets the owner answered as not found"),
    "remote_not_kept": (
        "kvd_cluster_remote_not_kept",
        "Values their owner sent that this daemon could not keep in L1 for their get "
        "(pinned full, or evicted first): each a miss",
    ),
    "peer_errors": ("kvd_cluster_peer_errors", "Peer calls failed or timed out (each a miss)"),
    "peer_skips": (
        "kvd_cluster_peer_skips",
        "Peer calls not made: the member failed within the last second (each a miss)",
    ),
    "checksum_mismatches": (
        "kvd_cluster_checksum_mismatches",
        "Peer values whose bytes failed their checksum (each a miss)",
    ),
    "forwards": ("kvd_cluster_forwards", "Puts handed to their owner"),
    "forward_errors": ("kvd_cluster_forward_errors", "Puts that could not reach their owner"),
    "forwards_dropped": (
        "kvd_cluster_forwards_dropped",
        "Puts not handed to their owner: the forward queue was full, or the value "
        "was evicted before its turn",
    ),
    "tells_dropped": (
        "kvd_cluster_tells_dropped",
        "Lookups not told to an owner for its eviction policy: too many in flight",
    ),
    "plans_adopted": (
        "kvd_cluster_plans_adopted",
        "Eviction plans of the pool's plan holder this member keeps its blocks by",
    ),
    "plans_refused": (
        "kvd_cluster_plans_refused",
        "Plans of the pool's plan holder refused: another policy or member size",
    ),
    "rebalanced": (
        "kvd_cluster_rebalanced",
        "Values handed to their new owner after the pool's members changed",
    ),
    "rebalanced_from_l2": (
        "kvd_cluster_rebalanced_from_l2",
        "Values read from L2 to be handed to their new owner after the members changed",
    ),
    "histories_taken": (
        "kvd_cluster_histories_taken",
        "Values handed to this member whose history in their old owner's eviction policy "
        "its policy took",
    ),
    "rebalance_adopted": (
        "kvd_cluster_rebalance_adopted",
        "Copies of values this member owns since the members changed, kept as its own",
    ),
}


class PoolNode:
    """This daemon's membership, its source and the router."""

    def __init__(
        self,
        membership: Membership,
        router: PoolRouter,
        etcd: EtcdMembers | None,
        dns: DnsMembers | None = None,
        joined: dict[str, str] | None = None,
        tls_config: Config | None = None,
    ) -> None:
        """``tls_config``: the settings whose files the peers' TLS is read
        from again on SIGHUP (``reload``); None: no TLS."""
        self.membership = membership
        self.router = router
        self.etcd = etcd
        self.dns = dns
        self._joined = joined or {}
        self._tls_config = tls_config

    def reload(self) -> None:
        """SIGHUP: read the peers' TLS files again; calls from now on use
        them. ConfigError (a file missing, a key not matching its
        certificate) keeps the old ones."""
        if self._tls_config is not None:
            tls = peer_tls(self._tls_config)
            bulk = peer_bulk_tls(tls)
            assert tls is not None and bulk is not None, "a pool with TLS has pool_tls_ca_file"
            self.router.peers.use_tls(tls)
            self.router.reads.bulk.use_tls(bulk)

    async def join(self) -> None:
        """Start the membership source (etcd registers this daemon), once
        every listener is up: a member that others see must take their calls
        and the values they hand it (kvd.cluster.rebalance)."""
        if self.dns is not None:
            await self.dns.start()
        if self.etcd is not None:
            await self.etcd.start(ETCD_START_WAIT_S)
        members = ",".join(self.membership.members)
        log.info("pool joined", extra={**self._joined, "members": members})

    def stats(self) -> dict[str, int]:
        values = self.router.stats()
        values["etcd_sessions"] = self.etcd.sessions if self.etcd is not None else 0
        return values

    async def leave(self, hand_off_s: float = 0.0) -> None:
        """Leave the membership (etcd revokes this daemon's key); first at
        shutdown. With ``hand_off_s``, first hand the values L1 owns to the
        members that own them once this one is gone, for at most that long
        (``Rebalance.leave``), where membership comes from etcd or DNS: a
        static list keeps this member, and its keys, whatever it does."""
        if hand_off_s > 0 and (self.etcd is not None or self.dns is not None):
            await self.router.rebalance.leave(hand_off_s)
        if self.etcd is not None:
            await self.etcd.stop()
        if self.dns is not None:
            await self.dns.stop()

    async def close(self) -> None:
        """Stop the router, once no RPC is in flight."""
        await self.router.close()


def advertise_address(config: Config, port: int) -> str:
    """``pool_advertise``, or ``listen`` with the port it bound."""
    if config.pool_advertise:
        return config.pool_advertise
    host, _ = parse_address(config.listen)
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:
        raise ConfigError(
            f"pool_advertise: listen {config.listen} is no address a peer can reach; "
            "set pool_advertise to this node's HOST:PORT",
            key="pool_advertise",
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _read_token(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as file:
            data = file.read(TOKEN_FILE_MAX_BYTES + 1)
    except OSError as error:
        raise ConfigError(
            f"pool_token_file: cannot read {path}: {error.strerror}", key="pool_token_file"
        ) from None
    token = data.decode("utf-8", "replace").strip()
    if not token or len(data) > TOKEN_FILE_MAX_BYTES:
        raise ConfigError(
            f"pool_token_file: {path} must hold one token of 1 to {TOKEN_FILE_MAX_BYTES} bytes",
            key="pool_token_file",
        )
    return token


def _start_nixl(config: Config, store: Store, advertise: str) -> NixlNode | str | None:
    """This daemon's NIXL agent with the L1 arena registered, or why there is
    none; None when ``pool_peer_transport`` does not ask for NIXL. ``auto``
    starts it only beside an RDMA device: over UCX's TCP transport it moved
    no more than the bulk port between namespaces on the development VM, with
    more round trips per value (22 ms for a member's first read)."""
    if _transport(config) not in ("auto", "nixl"):
        return None
    if config.pool_peer_transport == "auto" and not _rdma_devices():
        return f"no RDMA device in {RDMA_DEVICES}: bulk TCP"
    pool = store.pool
    (arena,) = pool.views([(0, pool.page_count)], pool.capacity_bytes)
    return NixlNode.start(arena, advertise)


def _transport(config: Config) -> str:
    """``pool_peer_transport``. Where the members talk over TLS, ``auto`` is
    the bulk port where this member's takes TLS (``bulk_tls``: a pool's
    members share their settings), else gRPC; with ``bulk`` a member whose
    bulk port is in clear is read over gRPC (``PeerReads``). NIXL carries
    values in clear: never with TLS."""
    if config.pool_tls_ca_file and config.pool_peer_transport == "auto":
        return "bulk" if config.bulk_tls else "grpc"
    return config.pool_peer_transport


def _rdma_devices() -> list[str]:
    try:
        return os.listdir(RDMA_DEVICES)
    except OSError:
        return []


async def start_pool(config: Config, store: Store, port: int) -> PoolNode | None:
    """This daemon's part in the pool ``pool_members`` names (a static list
    in use at once; etcd and DNS start with ``PoolNode.join``); None for a
    single-node daemon."""
    spec = parse_spec(config.pool_members)
    if spec is None:
        return None
    membership = Membership(advertise_address(config, port))
    token = _read_token(config.pool_token_file)
    tls = peer_tls(config)
    peers = Peers(token, config.max_message_bytes, tls)
    reads = PeerReads(store, peers, BulkPeers(token, peer_bulk_tls(tls)), _transport(config),
                      _start_nixl(config, store, membership.advertise))  # fmt: skip
    router = PoolRouter(store, membership, peers, reads, config.pool_peer_timeout_ms / 1000,
                        config.pool_lookup_hint_ms / 1000,
                        config.pool_rebalance_bytes_per_s, config.pool_prefetch_keys)  # fmt: skip
    router.start()
    etcd: EtcdMembers | None = None
    dns: DnsMembers | None = None
    if spec.kind == "static":
        membership.update(spec.members, "pool_members")
    elif spec.kind == "dns":
        from kvd.cluster.dns_source import DnsMembers  # dnspython loads only for a DNS pool

        try:
            dns = DnsMembers(spec, membership, config.pool_dns_server,
                             config.pool_dns_refresh_ms / 1000)  # fmt: skip
        except ValueError as exc:
            raise ConfigError(
                f"pool_dns_server: {config.pool_dns_server} is not IP:PORT ({exc})",
                key="pool_dns_server",
            ) from None
    else:
        from kvd.cluster.etcd import EtcdMembers  # aetcd loads only for an etcd pool
        from kvd.cluster.etcd_tls import EtcdCredentials

        ttl_s = math.ceil(config.pool_etcd_ttl_ms / 1000)
        etcd = EtcdMembers(spec, membership, ttl_s, EtcdCredentials.from_config(config))
    joined = {
        "source": spec.kind,
        "advertise": membership.advertise,
        "peer_token": "on" if config.pool_token_file else "off",
        "peer_tls": "on" if peers.tls is not None else "off",
        "peer_transport": reads.describe(),
    }
    if etcd is not None:
        joined["etcd_tls"] = "on" if etcd.tls is not None else "off"
    return PoolNode(membership, router, etcd, dns, joined, config if peers.tls else None)
