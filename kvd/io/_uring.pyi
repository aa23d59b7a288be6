"""Type stub for the native io_uring helper (native/kvd_uring.c).

Only kvd.io.backend imports this module.
"""

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias

from typing_extensions import Buffer

OP_READ: Final[int]
OP_WRITE: Final[int]
OP_FSYNC: Final[int]
OP_FDATASYNC: Final[int]
DEPTH_MAX: Final[int]
BUFS_PER_OP_MAX: Final[int]
READ_OK: Final[int]
READ_SHORT: Final[int]
READ_BAD_HEADER: Final[int]
READ_BAD_CHECKSUM: Final[int]
RECV_EOF: Final[int]
RECV_TIMEOUT: Final[int]

# (opcode, fd, offset, buffer | list/tuple of buffers | None for fsync, user_data)
Op: TypeAlias = tuple[int, int, int, Buffer | Sequence[Buffer] | None, int]
# (fds, segment_bytes, stripe_bytes): kvd.io.ops.StripeLayout.native
Layout: TypeAlias = tuple[tuple[int, ...], int, int]
# (segment, offset, header_bytes, payload, payload_bytes, checksum, seq, generation,
#  namespace, key): kvd.io.ops.RecordRead
Record: TypeAlias = tuple[int, int, int, Sequence[Buffer], int, int, int, int, str | bytes, bytes]

def check_record(
    header: Buffer,
    payload: Sequence[Buffer],
    payload_bytes: int,
    checksum: int,
    seq: int,
    generation: int,
    namespace: str | bytes,
    key: bytes,
    /,
) -> int:
    """The checks a record read gets, on buffers in memory: READ_OK or a READ_* miss."""

def xxh3_64(data: Buffer, /) -> int:
    """xxHash's xxh3-64 (seed 0), as the record checks compute it."""

def copy_many(jobs: Sequence[tuple[Buffer, Sequence[Buffer]]], to_pages: bool, /) -> list[int]:
    """Copy each (span, pages) job, span -> pages when to_pages, else pages ->
    span, with the GIL released; each job's xxh3-64 where its bytes landed."""

def recv_hashed(fd: int, views: Sequence[Buffer], timeout_ms: int, /) -> tuple[int, int, int]:
    """Fill views in order from a stream socket with the GIL released, hashing each
    piece as it lands: (0, RECV_EOF, RECV_TIMEOUT or -errno; bytes received; their xxh3-64)."""

def pool_read_many(
    pool: Buffer,
    layout: tuple[int, int, int, int, int],
    digests: Sequence[bytes],
    buffers: Sequence[Buffer],
    verify: bool,
    /,
) -> list[int]:
    """Gets through the pool's directory with the GIL released: each value's
    size once copied into its buffer, or -1 where it was not read so."""

def density_learn(
    keys: Sequence[object],
    mine: Sequence[bool] | None,
    nodes: dict[Any, Any],
    node_type: type,
    fields: tuple[Any, ...],
    ghost_pop: Callable[[Any, None], Any],
    pending: dict[Any, Any],
    shares: dict[Any, Any] | None,
    children: dict[Any, int],
    leaf_heap: list[Any],
    inner_heap: list[Any],
    heappush: Callable[[list[Any], Any], None],
    rebuild: Callable[[int], tuple[list[Any], list[Any]]],
    ring: Buffer,
    ring_tick: Buffer,
    reused: Buffer,
    age_bin: Buffer,
    gap_part: Buffer,
    count_bucket: Buffer,
    retention: Sequence[int],
    entered: Buffer,
    edge_ticks: Buffer,
    consts: tuple[int, ...],
    state: tuple[int, ...],
    /,
) -> tuple[int, int]:
    """What the density eviction policy learns from one chain lookup, key by
    key (kvd/store/eviction/density_learn.py): (seq, accesses) after it."""

def density_hazards(
    entered: Buffer,
    reused: Buffer,
    features: tuple[Buffer, ...],
    classes: int,
    bins: int,
    prior: float,
    rounds: int,
    hazard: Buffer,
    /,
) -> None:
    """The density eviction policy's reuse hazard per class and age bin into
    ``hazard`` (native/kvd_plan.c), numpy's arithmetic."""

def density_choose(
    hazard: Buffer,
    entered: Buffer,
    widths: Buffer,
    retentions: Buffer,
    lookups: float,
    target: float,
    low: float,
    high: float,
    steps: int,
    residence_cap: float,
    exp: Callable[[float], Any],
    survival: Buffer,
    /,
) -> list[int]:
    """The rest of the density eviction policy's plan after its hazards
    (native/kvd_plan.c): a retention per class; the survival into ``survival``."""

class Ring:
    """A bounded io_uring instance: at most `depth` ops in flight."""

    def __init__(self, depth: int) -> None: ...
    @property
    def depth(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    @property
    def unsubmitted(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def cooperative(self) -> bool:
        """Whether completions run as cooperative task work (no IPI per completion)."""
    def submit(self, ops: Sequence[Op], /) -> int:
        """Queue a prefix of ops (up to depth - inflight); return its length."""
    def submit_records(
        self, layout: Layout, records: Sequence[Record], start: int, user_data: int, /
    ) -> int:
        """Queue a prefix of records[start:] whose ops fit (depth - inflight), the
        i-th with user_data + i; return its length."""
    def reap(self, max: int, wait_nr: int = 0, timeout_ms: int = -1) -> list[tuple[int, int]]:
        """Return up to max (user_data, bytes moved or -errno) completions."""
    def eventfd(self) -> int:
        """A non-blocking eventfd signalled on completions (owned by the ring)."""
    def close(self) -> None:
        """Wait for in-flight ops, release their buffers, tear the ring down."""
