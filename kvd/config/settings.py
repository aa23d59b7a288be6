"""The settings table: every kvd setting, declared once.

Each field of :class:`Config` is one setting: its name (unit last), type,
default, bounds and help text. Everything else is derived from that table:
the TOML keys, the ``KVD_<NAME>`` environment variables, the ``kvd serve``
flags, the README reference table and the start-up log line.

Precedence, lowest first: defaults < TOML file < environment < flags
(``kvd.config.loading``). Unknown keys, unknown ``KVD_*`` variables, wrong
types and out-of-bound values raise :class:`ConfigError` naming the key and
where it came from.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TypeVar, get_type_hints

from kvd.config.rules import (
    check_address,
    check_address_or_empty,
    check_group,
    check_io_faults,
    check_nonempty,
    check_paths,
    check_patterns,
    check_pool_members,
    check_socket_path,
)
from kvd.config.setting import ConfigError, Setting, kind_of, validate

# The configuration's public face: the table and the error its checks raise
# (defined with the table's rows, in kvd.config.setting); the loaders are
# kvd.config.loading's.
__all__ = [
    "SETTINGS",
    "Config",
    "ConfigError",
    "Setting",
]


_T = TypeVar("_T")


# The names of kvd.store.eviction.policy's table, written here so that the
# settings import nothing of the store (a test checks that both agree).
EVICTION_POLICIES = ("lru", "gdf", "pred", "hazard", "s3fifo", "density")
L2_ADMISSIONS = ("all", "twice")  # kvd.store.admission


def _setting(
    default: _T,
    *,
    help: str,
    min: int | None = None,
    max: int | None = None,
    choices: tuple[str, ...] | None = None,
    octal: bool = False,
    check: Callable[[object], None] | None = None,
) -> _T:
    """Declare one setting; ``min``/``max`` bound numbers or, for lists, the item count."""
    metadata = {
        "help": help,
        "min": min,
        "max": max,
        "choices": choices,
        "octal": octal,
        "check": check,
    }
    return field(default=default, metadata=metadata)


KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PiB = 1 << 50


@dataclass(frozen=True, kw_only=True)
class Config:
    """The daemon's settings; construct through :func:`load_config` or directly."""

    listen: str = _setting(
        "127.0.0.1:7070",
        help="gRPC address HOST:PORT; non-loopback only with auth_tokens_file",
        check=check_address,
    )
    # In the shm directory by default, so engines on this node find the daemon
    # (and its shared-memory path) at one well-known path with no setting.
    socket: str = _setting(
        "/dev/shm/kvd/grpc.sock",
        help="Unix socket path for gRPC (engines on this node connect here); empty: none",
        check=check_socket_path,
    )
    socket_mode: int = _setting(
        0o660, help="file mode of the Unix socket (octal)", min=0, max=0o777, octal=True
    )
    socket_group: str = _setting(
        "",
        help="group (name or number) given the Unix socket; empty: the daemon's own",
        check=check_group,
    )
    metrics_listen: str = _setting(
        "127.0.0.1:9470",
        help="Prometheus /metrics address HOST:PORT; empty: no metrics endpoint",
        check=check_address_or_empty,
    )
    dram_bytes: int = _setting(
        1 * GiB, help="size of the L1 DRAM pool, allocated at start", min=1 * MiB, max=64 * TiB
    )
    ssd_path: tuple[str, ...] = _setting(
        ("./kvd-data/kvd-0.dat",),
        help="L2 files or block devices, striped; repeat the flag for several; empty: no L2",
        min=0,
        max=64,
        check=check_paths,
    )
    ssd_bytes: int = _setting(
        4 * GiB,
        help="L2 space per ssd_path (a file is preallocated to it; a device is bounded by it)",
        min=1 * MiB,
        max=1 * PiB,
    )
    ssd_segment_bytes: int = _setting(
        256 * MiB,
        help="L2 segment size per path: the unit of append and reclaim",
        min=1 * MiB,
        max=16 * GiB,
    )
    ssd_stripe_bytes: int = _setting(
        256 * KiB,
        help="bytes written to one path before the next, with several ssd_path entries",
        min=64 * KiB,
        max=1 * GiB,
    )
    io_faults: str = _setting(
        "",
        help="tests only: L2 I/O faults to inject, e.g. write:eio:nth=5 "
        "(grammar: kvd/io/faults.py)",
        check=check_io_faults,
    )
    test_crash_point: str = _setting(
        "",
        help="tests only: SIGKILL the daemon at this step of the write path",
        choices=("", "after_payload_write", "after_sync", "after_publish"),
    )
    test_crash_after: int = _setting(
        1, help="tests only: the Nth time test_crash_point is reached", min=1, max=1 << 30
    )
    io_depth: int = _setting(
        64, help="L2 I/O ops in flight at once (io_uring depth)", min=1, max=4096
    )
    io_threads: int = _setting(
        8, help="threads of the fallback I/O backend (no io_uring)", min=1, max=256
    )
    max_value_bytes: int = _setting(
        64 * MiB, help="largest value a put may store", min=1 * KiB, max=64 * GiB
    )
    max_message_bytes: int = _setting(
        64 * MiB, help="largest gRPC message, either direction", min=1 * MiB, max=1 * GiB
    )
    max_concurrent_rpcs: int = _setting(
        256, help="RPCs served at once; more wait in gRPC's queue", min=1, max=65536
    )
    max_inflight_bytes: int = _setting(
        512 * MiB,
        help="value bytes in flight over all RPCs; past it: RESOURCE_EXHAUSTED",
        min=1 * MiB,
        max=1 * TiB,
    )
    uploads_max_bytes: int = _setting(
        0,
        help="pool bytes held by all puts whose bytes are still arriving (bulk PUT, gRPC Put "
        "stream); past it such a put is RESOURCE_EXHAUSTED; 0: half of dram_bytes",
        min=0,
        max=64 * TiB,
    )
    grpc_put_timeout_ms: int = _setting(
        30_000,
        help="time a gRPC Put stream has to arrive in full; past it: DEADLINE_EXCEEDED",
        min=10,
        max=3_600_000,
    )
    max_batch_items: int = _setting(
        1024, help="items in one BatchPut/BatchGet/region batch", min=1, max=65536
    )
    # 16,384 blocks of 16 tokens (vLLM's default block) hold a 256K-token prompt.
    max_lookup_keys: int = _setting(16_384, help="keys in one Lookup", min=1, max=1 << 20)
    lease_ms_max: int = _setting(
        60_000, help="longest lease a Lookup may take", min=1, max=3_600_000
    )
    max_leases: int = _setting(65536, help="leases held at once", min=1, max=1 << 24)
    namespace_l1_quota_bytes: int = _setting(
        0,
        help="L1 bytes one namespace may hold; over it, its own oldest values go; 0: no quota",
        min=0,
        max=64 * TiB,
    )
    namespace_l2_quota_bytes: int = _setting(
        0,
        help="L2 bytes one namespace may hold; over it, its oldest records go and durable "
        "puts are refused (a value larger than it stays in L1 only); 0: no quota",
        min=0,
        max=1 * PiB,
    )
    eviction_policy: str = _setting(
        "density", help="L1 replacement policy", choices=EVICTION_POLICIES
    )
    l2_admission: str = _setting(
        "all",
        help="which puts are written to L2: all; or twice, a value once a second request "
        "references it (a lookup or get that finds it in L1, a put of it again; the keys "
        "put lately are remembered, ~70 MiB at most): a value used once costs no SSD write, "
        "and is gone when L1 evicts it. Durable puts are always written",
        choices=L2_ADMISSIONS,
    )
    shutdown_grace_ms: int = _setting(
        10_000, help="time to drain and flush on SIGTERM before exit", min=0, max=600_000
    )
    log_level: str = _setting(
        "info", help="least severe log level written", choices=("debug", "info", "warning", "error")
    )
    log_format: str = _setting("logfmt", help="log line format", choices=("logfmt", "json"))
    shm_dir: str = _setting(
        "/dev/shm/kvd",
        help="directory of the shm socket (regions are memfds passed over it)",
        check=check_nonempty,
    )
    max_regions_per_client: int = _setting(
        16,
        help="shared-memory regions one client process may attach at once",
        min=1,
        max=1024,
    )
    max_regions: int = _setting(
        256, help="shared-memory regions attached at once over all clients", min=1, max=65536
    )
    max_region_bytes: int = _setting(
        4 * GiB, help="largest shared-memory region", min=64 * KiB, max=1 * TiB
    )
    region_check_ms: int = _setting(
        1000,
        help="how often the daemon checks that region owners still hold their lock",
        min=10,
        max=60_000,
    )
    shm_socket: str = _setting(
        "", help="Unix socket for region ops; empty: kvd.sock in shm_dir", check=check_socket_path
    )
    shm_l2_direct_min_bytes: int = _setting(
        0,
        help="L2-only values this large or larger are read from disk straight into the "
        "client's region, not through L1; 0: never",
        min=0,
        max=1 * TiB,
    )
    shm_pool_reads: bool = _setting(
        False,
        help="let shm socket clients map L1 read-only and copy values out of it themselves; "
        "only callers that may read every namespace (auth off, or an admin token)",
    )
    bulk_listen: str = _setting(
        "127.0.0.1:7071",
        help="bulk TCP data port HOST:PORT; empty: none; non-loopback only with auth_tokens_file",
        check=check_address_or_empty,
    )
    bulk_max_connections: int = _setting(
        256, help="bulk TCP connections served at once; more are closed", min=1, max=65536
    )
    bulk_max_unauthenticated: int = _setting(
        32,
        help="bulk TCP connections waiting for their HELLO at once; a new one past it closes "
        "the oldest",
        min=1,
        max=65536,
    )
    bulk_max_connections_per_peer: int = _setting(
        64,
        help="bulk TCP connections one peer address may hold; more are refused "
        "(RESOURCE_EXHAUSTED)",
        min=1,
        max=65536,
    )
    bulk_hello_timeout_ms: int = _setting(
        2_000,
        help="time a new bulk connection has to send its HELLO; past it, it is closed",
        min=10,
        max=600_000,
    )
    bulk_inflight_bytes: int = _setting(
        64 * MiB,
        help="value bytes one bulk connection may have queued to send; past it, reading pauses",
        min=1 * MiB,
        max=64 * GiB,
    )
    bulk_frame_timeout_ms: int = _setting(
        30_000,
        help="time a started bulk frame has to arrive in full, and a GET answer to leave",
        min=10,
        max=3_600_000,
    )
    bulk_idle_timeout_ms: int = _setting(
        600_000,
        help="a bulk connection with no frame for this long is closed",
        min=10,
        max=86_400_000,
    )
    bulk_tls: bool = _setting(
        False,
        help="the bulk TCP port takes TLS only, with tls_cert_file and tls_key_file (and "
        "client certificates where tls_client_ca_file is set), as the gRPC listener; pool "
        "members with pool_tls_ca_file then read each other's values there; needs "
        "tls_cert_file and bulk_listen",
    )
    io_backend: str = _setting(
        "auto",
        help="L2 I/O engine; auto: io_uring when available",
        choices=("auto", "uring", "threads"),
    )
    auth_tokens_file: str = _setting(
        "",
        help="TOML file of sha256-hashed bearer tokens and their namespaces (SIGHUP reloads); "
        "empty: no auth",
    )
    tls_cert_file: str = _setting(
        "", help="PEM certificate chain of the gRPC TCP listener; empty: no TLS"
    )
    tls_key_file: str = _setting("", help="PEM private key of tls_cert_file")
    tls_client_ca_file: str = _setting(
        "", help="PEM CA bundle; set: clients must present a certificate it signed (mTLS)"
    )
    metrics_namespaces_max: int = _setting(
        32,
        help="namespaces exported by name in /metrics (largest first); the rest sum into other",
        min=0,
        max=1000,
    )

    # The pool across nodes (docs/pool.md).
    pool_members: str = _setting(
        "",
        help="where the pool's members come from: static:HOST:PORT,... or "
        "etcd://HOST:PORT[,HOST:PORT]/PREFIX or dns://NAME:PORT (a headless Service); "
        "empty: a single-node daemon",
        check=check_pool_members,
    )
    pool_advertise: str = _setting(
        "",
        help="gRPC HOST:PORT the other members reach this daemon at; empty: listen",
        check=check_address_or_empty,
    )
    pool_token_file: str = _setting(
        "",
        help="file holding the token this daemon sends to its peers (each member's "
        "auth_tokens_file must admit it to every namespace); empty: none",
    )
    pool_peer_timeout_ms: int = _setting(
        200,
        help="longest a call to a peer may take (less when the caller's deadline is nearer); "
        "past it the key is a miss",
        min=1,
        max=60_000,
    )
    pool_lookup_hint_ms: int = _setting(
        500,
        help="how long an owner's answer about a key (held or not) answers lookups here "
        "without asking it again (up to twice this; a chain looked up again has its owners "
        "asked again in the background every quarter of this); an owner with it keeps the keys it "
        "answers held for that long (pinned, up to an eighth of its L1; past it they are "
        "asked again), so give every member the same value; a key lost anyway (deleted) "
        "is claimed and then a miss at the get (a load error the engine recomputes), never "
        "a wrong block; 0: every lookup asks the owners",
        min=0,
        max=60_000,
    )
    pool_prefetch_keys: int = _setting(
        32,
        help="values a lookup that leases what it found (an engine about to load it) starts "
        "fetching from their owners at once, the first of the chain's held elsewhere, so "
        "the get that follows finds them here or joins the read under way; at most 4 "
        "lookups' at once; 0: a get starts the reads",
        min=0,
        max=16_384,
    )
    pool_rebalance_bytes_per_s: int = _setting(
        256 * MiB,
        help="after the pool's members change, the most a member receives a second of the "
        "values whose owner changed (from L1, then L2), from all the others together: each "
        "hands each new owner this divided by the other members; 0: as fast as the forward "
        "queue drains",
        min=0,
        max=64 * TiB,
    )
    pool_leave_handoff_ms: int = _setting(
        0,
        help="at a graceful stop (SIGTERM), how long this daemon may spend, before it "
        "leaves the pool and before shutdown_grace_ms, handing the values it owns (those in "
        "L1, then those only on L2, the newest first) to the members that own them once it "
        "is gone (membership from etcd or DNS); 0: none, its keys miss until put again or "
        "until a restart under this address serves them from L2",
        min=0,
        max=600_000,
    )
    pool_peer_transport: str = _setting(
        "auto",
        help="how values are read from their owner: nixl (one-sided reads into L1 pages), "
        "bulk (the owner's bulk TCP port), grpc; auto: nixl beside an RDMA device where it "
        "starts, else bulk",
        choices=("auto", "nixl", "bulk", "grpc"),
    )
    pool_tls_ca_file: str = _setting(
        "",
        help="PEM CA bundle that signs the members' certificates: with it, members call each "
        "other with TLS only (checking each other's certificate against it, presenting "
        "tls_cert_file as their own): values over the bulk ports where those take TLS "
        "(bulk_tls), else over gRPC, never over NIXL, which carries them in clear; needs "
        "tls_cert_file; empty: members talk in clear, and tls_cert_file is refused in a pool",
    )
    pool_tls_server_name: str = _setting(
        "",
        help="the name (SAN) every member's certificate carries, where it is not each "
        "member's own host (pool_advertise); empty: the member's host",
    )
    pool_etcd_ca_file: str = _setting(
        "",
        help="PEM CA bundle that signs etcd's certificate: with it, this daemon talks to etcd "
        "(an etcd:// pool_members) over TLS; empty: in clear",
    )
    pool_etcd_cert_file: str = _setting(
        "",
        help="PEM client certificate this daemon presents to etcd (one started with "
        "--client-cert-auth); needs pool_etcd_key_file and pool_etcd_ca_file",
    )
    pool_etcd_key_file: str = _setting("", help="PEM private key of pool_etcd_cert_file")
    pool_etcd_ttl_ms: int = _setting(
        10_000,
        help="lease of this daemon's etcd registration: a daemon gone leaves the pool within it "
        "(whole seconds, rounded up)",
        min=2_000,
        max=3_600_000,
    )

    pool_dns_server: str = _setting(
        "",
        help="DNS server HOST:PORT a dns:// pool_members asks; empty: the servers in "
        "/etc/resolv.conf",
        check=check_address_or_empty,
    )
    pool_dns_refresh_ms: int = _setting(
        5_000,
        help="how often a dns:// pool_members name is resolved again (a member gone leaves "
        "within it plus the record's TTL)",
        min=100,
        max=600_000,
    )

    # KV events in vLLM's format for KV-aware routers (docs/pool.md).
    kv_events_endpoint: str = _setting(
        "",
        help="ZMQ PUB endpoint of the KV events: tcp://*:PORT binds, tcp://HOST:PORT connects "
        "to a subscriber that binds (vLLM's rule); empty: no events",
    )
    kv_events_replay_endpoint: str = _setting(
        "",
        help="ZMQ ROUTER endpoint (bound) that answers a start sequence number with the "
        "batches still buffered; empty: no replay",
    )
    kv_events_topic: str = _setting(
        "",
        help="topic of every event message (llm-d's indexer reads kv@<pod>@<model>)",
    )
    kv_events_namespaces: tuple[str, ...] = _setting(
        (),
        help="namespaces whose blocks the events name: a namespace, or a prefix ending in * "
        "(team-a/*); repeat the flag for several; empty: every namespace",
        min=0,
        max=64,
        check=check_patterns,
    )
    kv_events_encoding: str = _setting(
        "map",
        help="each event as a map of named fields (vLLM today) or a positional array "
        "(older vLLM and its consumers)",
        choices=("map", "array"),
    )
    kv_events_block_size: int = _setting(
        0,
        help="tokens per block the engines store, sent as BlockStored.block_size; 0: unknown",
        min=0,
        max=1 << 20,
    )
    kv_events_queue_batches: int = _setting(
        1_024,
        help="event batches waiting for the sender thread; past it a batch is dropped "
        "(kvd_kv_events_dropped), never waited for",
        min=1,
        max=100_000,
    )
    kv_events_replay_batches: int = _setting(
        1_000,
        help="sent event batches kept for replay (a batch is at most 256 events, ~28 KiB)",
        min=1,
        max=1_000_000,
    )

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            value = getattr(self, setting.name)
            if setting.kind == "list" and isinstance(value, list):
                object.__setattr__(self, setting.name, tuple(value))  # frozen: only here
            validate(setting, getattr(self, setting.name))

    def describe(self) -> dict[str, str | int]:
        """Every setting in short form (sizes as ``1GiB``), for the start-up log line."""
        return {setting.name: setting.show(getattr(self, setting.name)) for setting in SETTINGS}

    def to_toml(self) -> str:
        """This configuration as a TOML file that :func:`load_config` reads back."""
        lines = []
        for setting in SETTINGS:
            lines.append(f"# {setting.help}")
            lines.append(f"{setting.name} = {setting.toml(getattr(self, setting.name))}")
        return "\n".join(lines) + "\n"


def _build_table() -> tuple[Setting, ...]:
    hints = get_type_hints(Config)
    table = []
    for config_field in fields(Config):
        meta = config_field.metadata
        table.append(
            Setting(
                name=config_field.name,
                kind=kind_of(config_field.name, hints[config_field.name]),
                default=config_field.default,
                help=meta["help"],
                min=meta["min"],
                max=meta["max"],
                choices=meta["choices"],
                octal=meta["octal"],
                check=meta["check"],
            )
        )
    return tuple(table)


SETTINGS: tuple[Setting, ...] = _build_table()
SETTINGS_BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}
