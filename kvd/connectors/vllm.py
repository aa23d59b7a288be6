"""kvd as a vLLM V1 KV connector (``KVConnectorBase_V1``).

Matched against vLLM ``main`` at commit 003df2961dd8830c317a61f9745ccd557da9fa06:
``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (the abstract
methods and their arguments) and ``example_connector.py`` (how the paged
KV and the scheduler output are read).

Launch::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
      "kv_connector_module_path": "kvd.connectors.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"url": "kvd://127.0.0.1:7070"}}'

Scheduler side: ``get_num_new_matched_tokens`` asks the daemon, in one
Lookup with a lease, for the longest stored prefix of the prompt's block
keys (leaving at least one token to compute) and plans loads into the
blocks vLLM allocates. Worker side: ``start_load_kv`` copies those blocks
into the paged KV of every layer; ``wait_for_save`` stores the full prompt
blocks a step computed. A block that fails to load is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it.

Block keys follow vLLM's scheme: one key per ``block_size`` tokens, each
chained over its parent, with the LoRA name and ``cache_salt`` as extra
keys, so key *i* names exactly vLLM's block *i*. They are computed with
``kvd.client.keys.chain_keys`` (SHA-256) rather than taken from
``request.block_hashes``: vLLM seeds those with ``os.urandom`` unless
``PYTHONHASHSEED`` is set, which would make every restart a miss.

One value per block holds the block of every layer, layers in name order;
its ``meta`` has the per-layer shape and dtype. The namespace has the
model, KV dtype, block size and the TP rank and size; the scheduler looks
up in rank 0's namespace (a rank that then misses reports load errors).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvd.client import Client
from kvd.client.keys import chain_keys
from kvd.connectors.common import (
    DEFAULT_LEASE_MS,
    DEFAULT_TIMEOUT_S,
    LOAD_BATCH_BYTES,
    Guard,
    config_value,
    encode_meta,
    get_prefix_into,
    load_groups,
    namespace,
    parse_target,
    tls_config,
)
from kvd.connectors.vllm_events import (
    SchedulerEvents,
    WorkerEvents,
    events_enabled,
    stored_event,
)
from kvd.connectors.vllm_stats import KvdConnectorStats
from kvd.wire.errors import AlreadyExists, Cancelled, KvdError, Unavailable

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    HAVE_VLLM = True
except ImportError:  # the connector's logic runs without vLLM, for tests and tools
    HAVE_VLLM = False
    KVConnectorBase_V1 = object
    KVConnectorMetadata = object

try:
    from vllm.v1.metrics.cache_hit_source import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        CacheHitSource,
    )

    HOST_SOURCE: Any = CacheHitSource.HOST
    DISK_SOURCE: Any = CacheHitSource.DISK
except ImportError:  # vLLM before 0.32, or none
    HOST_SOURCE, DISK_SOURCE = "host", "disk"

log = logging.getLogger("kvd.connectors.vllm")

ENGINE = "vllm"
# Leases and plans of requests not yet scheduled: bounded, oldest dropped
# (its lease then simply expires on the daemon).
PENDING_REQUESTS_MAX = 4096


def block_keys(
    token_ids: Sequence[int], block_size: int, lora_name: str = "", cache_salt: str = ""
) -> list[bytes]:
    """One chained key per full block of ``token_ids``, with vLLM's extra keys."""
    extra = b""
    if lora_name or cache_salt:
        # Length-prefixed, so no LoRA name can end where a salt begins
        # ("a\0salt=b" + "" and "a" + "b\0salt=" once gave the same bytes).
        lora, salt = lora_name.encode(), cache_salt.encode()
        extra = struct.pack("<I", len(lora)) + lora + struct.pack("<I", len(salt)) + salt
    return chain_keys(list(token_ids), block_size, extra=extra)


def _request_extras(request: Any) -> tuple[str, str]:
    lora = getattr(request, "lora_request", None)
    lora_name = str(getattr(lora, "lora_name", "") or "") if lora is not None else ""
    return lora_name, str(getattr(request, "cache_salt", "") or "")


@dataclass
class BlockTransfer:
    """Blocks of one request to move: keys[i] <-> block_ids[i]."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes | None = None
    # A save's tokens and LoRA name, for its KV-cache event (events on only).
    token_ids: list[int] = field(default_factory=list)
    lora_name: str = ""


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    keys: list[bytes]
    hit_blocks: int = 0  # leading blocks kvd holds that this request may load
    stored_blocks: int = 0  # leading blocks kvd holds (one more than hit_blocks at most)
    local_blocks: int = 0  # leading blocks vLLM's own prefix cache holds
    load: bool = False
    lease: tuple[str, int] | None = None
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    l2_blocks: int = 0  # of the hit blocks, those only on kvd's SSD tier
    prompt: list[int] = field(default_factory=list)  # kept for KV-cache events only
    lora_name: str = ""


def _role_name(role: Any) -> str:
    return str(getattr(role, "name", role)).upper()


class KvdConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM V1 connector over a kvd daemon.

    Not ``SupportsHMA``: a value holds one block of every layer of the
    model's one full-attention KV group, keyed by that group's block hashes.
    With the hybrid allocator a block id means a different block in each
    group (sliding-window groups drop old blocks), so one key could not name
    all of them; vLLM turns the hybrid allocator off for this connector,
    which costs sliding-window models memory, never correctness.
    """

    # Default source of an external hit; get_external_cache_hit_sources splits
    # each hit between kvd's DRAM (host) and SSD (disk) tiers.
    _cache_hit_source = HOST_SOURCE

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if HAVE_VLLM:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.kvd_role = _role_name(role)
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        _recompute_failed_loads(transfer, extra)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self.lease_ms = config_value(extra, "lease_ms", DEFAULT_LEASE_MS)
        self.client = Client(
            parse_target(config_value(extra, "url", "") or None),
            token=config_value(extra, "token", "") or None,
            timeout_s=config_value(extra, "timeout_s", DEFAULT_TIMEOUT_S),
            tls=tls_config(lambda name, default: config_value(extra, name, default)),
        )
        parallel = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.tp_rank = int(config_value(extra, "tp_rank", -1))
        if self.tp_rank < 0:
            self.tp_rank = _tensor_parallel_rank() if self.kvd_role == "WORKER" else 0
        model = vllm_config.model_config
        self.ns_fields: dict[str, object] = {
            "model": getattr(model, "model", ""),
            "revision": getattr(model, "revision", None) or "",
            "dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
            + "/"
            + str(getattr(model, "dtype", "")).removeprefix("torch."),
            "block": self.block_size,
            "salt": config_value(extra, "namespace_salt", ""),
        }
        self.namespace = self._namespace(self.tp_rank)
        self.guard = Guard(f"vllm[{self.kvd_role.lower()}]")
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._kv_caches: dict[str, Any] = {}
        self._layer_names: list[str] = []
        self._block_dims: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._staging: memoryview | None = None
        self._stats = KvdConnectorStats()
        self._stats.reset()
        self.kv_events = events_enabled(vllm_config)
        self._worker_events = WorkerEvents()
        self._scheduler_events = SchedulerEvents()

    def _namespace(self, tp_rank: int) -> str:
        return namespace(ENGINE, {**self.ns_fields, "tp": f"{tp_rank}of{self.tp_size}"})

    # ==============================================================
    # Scheduler side
    # ==============================================================

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvd holds (whole blocks)."""
        prompt = list(getattr(request, "prompt_token_ids", None) or [])
        if len(prompt) <= self.block_size:
            return 0, False
        lora_name, salt = _request_extras(request)
        # Every full block is looked up, so that blocks kvd holds are not saved
        # again (a block this engine computes after a restore can differ from
        # the stored one in the last bits, and keys are write-once); one token
        # is always left to compute, so the last block of a prompt that fills
        # its blocks exactly is never claimed: vLLM needs logits for it.
        keys = block_keys(prompt, self.block_size, lora_name, salt)
        claimable = (len(prompt) - 1) // self.block_size
        lookup_ns = self._namespace(0)
        previous = self._tracked.get(request.request_id)
        if previous is not None and previous.lease is not None:
            lease_ns, lease_id = previous.lease
            self.guard.call("release", False, lambda: self.client.release(lease_ns, lease_id))
        found = self.guard.call(
            "lookup", None, lambda: self.client.lookup_ex(lookup_ns, keys, self.lease_ms)
        )
        stored_blocks = found.prefix_len if found is not None else 0
        hit_blocks = min(stored_blocks, claimable)
        tracked = _Tracked(keys, hit_blocks, num_computed_tokens // self.block_size)
        tracked.stored_blocks = stored_blocks
        if found is not None and found.lease_id:
            tracked.lease = (lookup_ns, found.lease_id)
        if found is not None:
            tracked.l2_blocks = min(found.l2_hits, hit_blocks)
        if self.kv_events:
            tracked.prompt, tracked.lora_name = prompt, lora_name
        with self._lock:
            self._tracked[request.request_id] = tracked
            while len(self._tracked) > PENDING_REQUESTS_MAX:
                self._tracked.pop(next(iter(self._tracked)))
        return max(0, hit_blocks * self.block_size - num_computed_tokens), False

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """The tokens of a hit split between kvd's DRAM (host) and SSD (disk) tiers."""
        if num_external_tokens <= 0:
            return {}
        tracked = self._tracked.get(request.request_id)
        disk = min(num_external_tokens, (tracked.l2_blocks if tracked else 0) * self.block_size)
        sources = {HOST_SOURCE: num_external_tokens - disk, DISK_SOURCE: disk}
        return {source: tokens for source, tokens in sources.items() if tokens}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        if blocks is not None:
            tracked.block_ids = list(blocks.get_block_ids()[0])
        tracked.load = num_external_tokens > 0

    def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
        meta = KvdConnectorMetadata()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            if tracked.load and tracked.hit_blocks > tracked.local_blocks:
                span = slice(tracked.local_blocks, tracked.hit_blocks)
                meta.loads.append(
                    BlockTransfer(new.req_id, tracked.keys[span], tracked.block_ids[span])
                )
            tracked.saved_blocks = tracked.stored_blocks  # kvd holds these already
            computed = int(new.num_computed_tokens) + int(scheduled.get(new.req_id, 0))
            self._plan_save(meta, new.req_id, tracked, computed)
        cached: Any = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for i, req_id in enumerate(getattr(cached, "req_ids", []) or []):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                tracked.block_ids.extend(new_ids[0])
            computed = int(cached.num_computed_tokens[i]) + int(scheduled.get(req_id, 0))
            self._plan_save(meta, req_id, tracked, computed)
        return meta

    def _plan_save(
        self, meta: KvdConnectorMetadata, req_id: str, tracked: _Tracked, tokens: int
    ) -> None:
        """Save the full prompt blocks that this step finishes computing."""
        done = min(tokens // self.block_size, len(tracked.keys), len(tracked.block_ids))
        if done <= tracked.saved_blocks:
            return
        start = tracked.saved_blocks
        parent = tracked.keys[start - 1] if start else None
        save = BlockTransfer(
            req_id, tracked.keys[start:done], tracked.block_ids[start:done], parent
        )
        if tracked.prompt:
            save.token_ids = tracked.prompt[start * self.block_size : done * self.block_size]
            save.lora_name = tracked.lora_name
        meta.saves.append(save)
        tracked.saved_blocks = done

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._lock:
            tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None and tracked.lease is not None:
            lease_ns, lease_id = tracked.lease
            self.guard.call("release", False, lambda: self.client.release(lease_ns, lease_id))
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Gather the workers' KV-cache events of a step (``kvd.connectors.vllm_events``)."""
        self._scheduler_events.gather(getattr(connector_output, "kv_cache_events", None))

    def take_events(self) -> list[Any]:
        """The blocks stored in kvd since the last call, as vLLM KV-cache events."""
        return self._scheduler_events.take()

    # ==============================================================
    # Worker side
    # ==============================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_names = sorted(kv_caches)
        for name, tensor in kv_caches.items():
            self._block_dims[name] = self._block_dim(tensor)

    def _block_dim(self, tensor: Any) -> int:
        """The block axis: FlashAttention's [2, blocks, ...] -> 1, [blocks, ...] -> 0."""
        shape = tuple(tensor.shape)
        if self.num_blocks:
            for dim in (0, 1):
                if dim < len(shape) and shape[dim] == self.num_blocks:
                    return dim
        return 1 if shape and shape[0] == 2 else 0

    def _block_views(self, block_id: int) -> list[Any]:
        return [
            self._kv_caches[name].select(self._block_dims[name], block_id)
            for name in self._layer_names
        ]

    def _staging_for(self, nbytes: int) -> memoryview:
        """Reused memory for a batch of blocks, in a shared region when the
        shm path is on (the daemon copies straight into or out of it)."""
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = self.client.buffer(max(nbytes, min(LOAD_BATCH_BYTES, 4 * nbytes)))
        return self._staging

    @contextlib.contextmanager
    def _staging_dropped_on_failure(self) -> Iterator[None]:
        """A call that may still run in the daemon gets fresh staging next
        time: a get that timed out may still be written into the old one
        (``kvd.client.shm``). A refusal the daemon answered (a write-once
        conflict, a full pool) leaves nothing running: the staging stays, as a
        fresh region costs its first copies a page fault per 4 KiB."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, KvdError) or isinstance(exc, Unavailable | Cancelled):
                self._staging = None
            raise

    def _stage_blocks(self, block_ids: Sequence[int], staging: Any) -> list[memoryview]:
        """Copy each block's layers from the paged KV into ``staging``, one copy
        a layer; a view of ``staging`` per block."""
        sizes = self._layer_sizes(block_ids[0])
        block_bytes = sum(sizes)
        views = []
        for i, block_id in enumerate(block_ids):
            offset = i * block_bytes
            for view, size in zip(self._block_views(block_id), sizes, strict=True):
                dst = staging[offset : offset + size].view(view.dtype).reshape(view.shape)
                dst.copy_(view)
                offset += size
            views.append(self._staging_view(i * block_bytes, block_bytes))
        return views

    def _staging_view(self, offset: int, nbytes: int) -> memoryview:
        assert self._staging is not None
        return self._staging[offset : offset + nbytes]

    def _layer_sizes(self, block_id: int) -> list[int]:
        return [v.numel() * v.element_size() for v in self._block_views(block_id)]

    def _block_meta(self) -> bytes:
        first = self._block_views(0)
        return encode_meta(
            {
                "layers": len(first),
                "shape": list(first[0].shape),
                "dtype": str(first[0].dtype).removeprefix("torch."),
            }
        )

    def _load_blocks(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Blocks into the paged KV, a batch per ``LOAD_BATCH_BYTES``; how many
        leading blocks were loaded (the rest start at the first miss). The
        daemon writes each batch into the staging region, and one copy a
        layer moves it into the KV tensors."""
        import torch  # type: ignore[import-not-found,unused-ignore]

        sizes = self._layer_sizes(block_ids[0])
        block_bytes = sum(sizes)
        loaded = 0
        for start, end in load_groups([block_bytes] * len(block_ids)):
            staging_view = self._staging_for((end - start) * block_bytes)
            staging = torch.frombuffer(staging_view, dtype=torch.uint8)
            views = [self._staging_view(i * block_bytes, block_bytes) for i in range(end - start)]
            got = get_prefix_into(self.client, self.namespace, keys[start:end], views)
            for i in range(got):
                offset = i * block_bytes
                for view, size in zip(self._block_views(block_ids[start + i]), sizes, strict=True):
                    src = staging[offset : offset + size].view(view.dtype).reshape(view.shape)
                    view.copy_(src, non_blocking=False)
                    offset += size
            loaded += got
            if got < end - start:
                break
        return loaded

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Copy the planned blocks into the paged KV; failures become load errors."""
        meta = self._connector_meta()
        if meta is None or not self._kv_caches:
            return
        for load in meta.loads:
            if not load.block_ids:
                continue

            def fetch(load: BlockTransfer = load) -> int:
                with self._staging_dropped_on_failure():
                    return self._load_blocks(load.keys, load.block_ids)

            started = time.perf_counter()
            loaded = self.guard.call("load", 0, fetch)
            self._count("load_s", time.perf_counter() - started)
            self._count("loaded_blocks", loaded)
            self._count("load_errors", len(load.block_ids) - loaded)
            self._load_errors.update(load.block_ids[loaded:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loads every layer before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are saved in wait_for_save, once all layers hold them

    def wait_for_save(self) -> None:
        meta = self._connector_meta()
        if meta is None or not self._kv_caches or not meta.saves:
            return

        block_meta = self._block_meta()
        for save in meta.saves:
            if not save.block_ids:
                continue

            def put(save: BlockTransfer = save) -> bool:
                with self._staging_dropped_on_failure():
                    self._save_blocks(save, block_meta)
                return True

            started = time.perf_counter()
            done = self.guard.call("save", False, put)
            self._count("save_s", time.perf_counter() - started)
            self._count("saved_blocks" if done else "save_failures", len(save.block_ids))
            if done and save.token_ids:
                self._worker_events.add(
                    stored_event(
                        save.keys, save.parent, save.token_ids, self.block_size, save.lora_name
                    )
                )

    def _save_blocks(self, save: BlockTransfer, block_meta: bytes) -> None:
        """Stage the blocks, a batch per ``LOAD_BATCH_BYTES``, and put each batch."""
        import torch  # type: ignore[import-not-found,unused-ignore]

        block_bytes = sum(self._layer_sizes(save.block_ids[0]))
        for start, end in load_groups([block_bytes] * len(save.block_ids)):
            staging_view = self._staging_for((end - start) * block_bytes)
            staging = torch.frombuffer(staging_view, dtype=torch.uint8)
            values = self._stage_blocks(save.block_ids[start:end], staging)
            parent = save.keys[start - 1] if start else save.parent
            keys = save.keys[start:end]
            items = [(key, value, block_meta) for key, value in zip(keys, values, strict=True)]
            try:
                self.client.put_many(self.namespace, items, chained=True, parent=parent)
            except AlreadyExists:
                # Another engine stored a block first, computed with other
                # rounding: keys are write-once and the first value stays.
                # The rest of the batch was stored; it was answered in full.
                self._count("save_conflicts", 1)

    def _count(self, name: str, value: float) -> None:
        self._stats.data[name] = self._stats.data.get(name, 0) + value

    def get_kv_connector_stats(self) -> KvdConnectorStats | None:
        """This worker's counters since the last call (vLLM logs and exports them)."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvdConnectorStats()
        self._stats.reset()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvdConnectorStats:
        stats = KvdConnectorStats()
        stats.reset()
        stats.data.update(data or {})
        return stats

    def get_kv_connector_kv_cache_events(self) -> Any:
        """This worker's KV-cache events since the last call; None when there are none."""
        return self._worker_events.collect()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _connector_meta(self) -> KvdConnectorMetadata | None:
        meta = getattr(self, "_connector_metadata", None)
        return meta if isinstance(meta, KvdConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def shutdown(self) -> None:
        self.client.close()


def _recompute_failed_loads(transfer: Any, extra: dict[str, Any]) -> None:
    """Make vLLM recompute blocks that fail to load, rather than fail the request.

    vLLM 0.32 defaults ``kv_load_failure_policy`` to ``"fail"``: a block the
    daemon could not give back (it died, a disk read failed) then ends the
    user's request with an error. A cache must never do that, so the
    connector sets ``"recompute"`` (the scheduler reads the policy after it
    builds its connector). ``"keep_load_failure_policy": true`` in the
    connector's extra config leaves vLLM's setting alone.
    """
    if transfer is None or config_value(extra, "keep_load_failure_policy", False):
        return
    if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
        transfer.kv_load_failure_policy = "recompute"
        log.info("kvd: kv_load_failure_policy set to 'recompute': a failed load is recomputed")


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
            get_tensor_model_parallel_rank,
        )

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not inside a vLLM worker: a single rank
        return 0
