"""kvd as an SGLang HiCache storage backend (the L3 under HiCache's host pool).

Matched against sglang ``main`` at commit 001067fffe33427bee0ed2f007fb7551a1d76b44:
``python/sglang/srt/mem_cache/hicache_storage.py`` (``HiCacheStorage``,
``HiCacheStorageConfig``), ``mem_cache/storage/backend_factory.py`` (the
``dynamic`` backend is built as ``cls(storage_config, kwargs)``) and
``managers/cache_controller.py`` (which calls ``batch_exists`` for the
prefix, ``batch_get``/``batch_set`` on flat host pages, or
``batch_get_v1``/``batch_set_v1`` with host indices when the extra config
has ``"interface_v1": 1``).

Launch::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvd",
        "module_path": "kvd.connectors.sglang", "class_name": "KvdHiCacheStorage",
        "url": "kvd://127.0.0.1:7070", "interface_v1": 1}'

Keys are SGLang's page hashes (SHA-256 hex, chained over the prefix, see
``page_hashes``); the namespace holds the model, TP rank and size (not for
MLA, whose pages every rank shares), PP and attention-CP rank and size, and
the host pool layout. Every daemon error is a miss or a failed write (the
page is recomputed); nothing raises into HiCache's threads, which are never
restarted if they die.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvd.client import Client
from kvd.connectors.common import (
    DEFAULT_TIMEOUT_S,
    Guard,
    config_value,
    get_prefix_into,
    load_groups,
    namespace,
    parse_target,
    text_key,
    tls_config,
)

try:
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        HiCacheStorage,
    )

    HAVE_SGLANG = True
except ImportError:  # the backend also runs without SGLang, for tests and tools
    HAVE_SGLANG = False
    HiCacheStorage = object

ENGINE = "sglang"
# SGLang's STORAGE_BATCH_SIZE: the controller never passes more pages at once.
BATCH_PAGES_MAX = 128


def page_hashes(
    token_ids: Sequence[int], page_size: int, prior_hash: str | None = None
) -> list[str]:
    """SGLang's chained page keys (``get_hash_str``): SHA-256 over the parent
    digest then each token as 4 little-endian bytes; full pages only."""
    out = []
    prior = prior_hash
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        hasher = hashlib.sha256()
        if prior:
            hasher.update(bytes.fromhex(prior))
        for token in token_ids[start : start + page_size]:
            hasher.update(int(token).to_bytes(4, byteorder="little", signed=False))
        prior = hasher.hexdigest()
        out.append(prior)
    return out


def storage_namespace(storage_config: Any, salt: str = "", kv_dtype: str = "") -> str:
    """Namespace for one rank of one model: everything that changes a page's bytes.

    ``kv_dtype`` is the host pool's dtype: SGLang's storage config carries none,
    and fp16/bf16 (or fp8 e4m3/e5m2) pages of one model have the same size.
    """
    fields: dict[str, object] = {"model": getattr(storage_config, "model_name", None) or ""}
    if kv_dtype:
        fields["kv_dtype"] = kv_dtype
    if not getattr(storage_config, "is_mla_model", False):
        fields["tp"] = f"{storage_config.tp_rank}of{storage_config.tp_size}"
    if getattr(storage_config, "pp_size", 1) > 1:
        fields["pp"] = f"{storage_config.pp_rank}of{storage_config.pp_size}"
    if getattr(storage_config, "attn_cp_size", 1) > 1:
        fields["cp"] = f"{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
    page_first = getattr(storage_config, "is_page_first_layout", False)
    fields["layout"] = "page_first" if page_first else "layer_first"
    if getattr(storage_config, "should_split_heads", False):
        fields["tp_lcm"] = getattr(storage_config, "tp_lcm_size", "")
    if salt:
        fields["salt"] = salt
    return namespace(ENGINE, fields)


def _byte_view(tensor: Any) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    import torch  # type: ignore[import-not-found,unused-ignore]

    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy()).cast("B")


class KvdHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache L3 storage over a kvd daemon."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.storage_config = storage_config
        self.target = parse_target(config_value(extra, "url", "") or None)
        self.salt = config_value(extra, "namespace_salt", "")
        self.namespace = storage_namespace(storage_config, self.salt)
        self.client = Client(
            self.target,
            token=config_value(extra, "token", "") or None,
            timeout_s=config_value(extra, "timeout_s", DEFAULT_TIMEOUT_S),
            tls=tls_config(lambda name, default: config_value(extra, name, default)),
        )
        self.guard = Guard(f"sglang[tp{getattr(storage_config, 'tp_rank', 0)}]")
        self.mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        # SGLang registers the host pool before any page moves: from here on
        # the namespace names the pool's dtype too.
        dtype = getattr(mem_pool_host, "dtype", None)
        if dtype is not None:
            self.namespace = storage_namespace(self.storage_config, self.salt, str(dtype))

    # -- single pages --------------------------------------------------------

    def _get_into(self, key: str, target: Any) -> bool:
        view = _byte_view(target)
        size = self.client.get_into(self.namespace, text_key(key), view)
        if size is None:
            return False
        if size != len(view):
            raise ValueError(f"page {key}: {size} bytes stored, {len(view)} expected")
        return True

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page into ``target_location`` (returned), or None on a miss."""

        def fetch() -> Any:
            if target_location is None:
                value = self.client.get(self.namespace, text_key(key))
                if value is None:
                    return None
                import torch  # type: ignore[import-not-found,unused-ignore]

                return torch.frombuffer(bytearray(value), dtype=torch.uint8)
            return target_location if self._get_into(key, target_location) else None

        return self.guard.call("get", None, fetch)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if value is None:
            return False

        def put() -> bool:
            self.client.put(self.namespace, text_key(key), _byte_view(value))
            return True

        return self.guard.call("set", False, put)

    def exists(self, key: str) -> bool:
        return self.guard.call(
            "exists", False, lambda: self.client.exists(self.namespace, [text_key(key)])[0]
        )

    # -- batches (the generic path) ----------------------------------------

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Pages in order; after the first miss every later page is None (a prefix).
        With targets, one batch reads them all: a target after the miss may hold
        its own page's bytes, but is reported None."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if any(target is None for target in targets):
            out: list[Any] = []
            for key, target in zip(keys, targets, strict=True):
                page = self.get(key, target) if not out or out[-1] is not None else None
                out.append(page)
            return out

        def fetch() -> int:
            return self._load_prefix(keys, [_byte_view(target) for target in targets])

        hits = self.guard.call("batch_get", 0, fetch)
        return [target if i < hits else None for i, target in enumerate(targets)]

    def _load_prefix(self, keys: Sequence[str], views: Sequence[memoryview]) -> int:
        """Pages into ``views``, a batch per ``LOAD_BATCH_BYTES``; leading hits."""
        hits = 0
        for start, end in load_groups([len(view) for view in views]):
            group = [text_key(key) for key in keys[start:end]]
            got = get_prefix_into(self.client, self.namespace, group, views[start:end])
            hits += got
            if got < end - start:
                break
        return hits

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store the pages, linked as one chain (they are one sequence's pages)."""
        if values is None or len(keys) == 0:
            return False

        def put() -> bool:
            items = [(text_key(k), _byte_view(v)) for k, v in zip(keys, values, strict=True)]
            self.client.put_many(self.namespace, items, chained=True)
            return True

        return self.guard.call("batch_set", False, put)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages stored: one Lookup."""
        return self.guard.call(
            "batch_exists",
            0,
            lambda: self.client.lookup(self.namespace, [text_key(k) for k in keys]),
        )

    # -- zero-copy interface (extra config "interface_v1": 1) --------------

    def _page_offsets(self, keys: Sequence[str], host_indices: Any) -> list[int]:
        page_size = int(getattr(self.mem_pool_host, "page_size", 1) or 1)
        if host_indices is None or len(host_indices) != len(keys) * page_size:
            raise ValueError(f"{len(keys)} pages but {len(host_indices)} host indices")
        return [int(host_indices[i * page_size]) for i in range(len(keys))]

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Pages straight into the host pool; stops at the first miss."""

        def fetch() -> list[bool]:
            pool = self.mem_pool_host
            offsets = self._page_offsets(keys, host_indices)
            results = [False] * len(keys)
            per_page = len(_byte_view(pool.get_dummy_flat_data_page()))
            for start, end in load_groups([per_page] * len(keys)):
                pages = [pool.get_dummy_flat_data_page() for _ in range(start, end)]
                views = [_byte_view(page) for page in pages]
                got = get_prefix_into(
                    self.client, self.namespace, [text_key(k) for k in keys[start:end]], views
                )
                for i in range(got):
                    pool.set_from_flat_data_page(offsets[start + i], pages[i])
                    results[start + i] = True
                if got < end - start:
                    break
            return results

        return self.guard.call("batch_get_v1", [False] * len(keys), fetch)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        def put() -> list[bool]:
            pool = self.mem_pool_host
            items = [
                (text_key(key), _byte_view(pool.get_data_page(offset, flat=True)))
                for key, offset in zip(keys, self._page_offsets(keys, host_indices), strict=True)
            ]
            self.client.put_many(self.namespace, items, chained=True)
            return [True] * len(keys)

        return self.guard.call("batch_set_v1", [False] * len(keys), put)

    # -- housekeeping --------------------------------------------------------

    def clear(self) -> None:
        self.guard.call("clear", 0, lambda: self.client.delete_namespace(self.namespace))

    def get_stats(self) -> dict[str, int] | None:
        return {"kvd_failures": self.guard.failures()}

    def close(self) -> None:
        self.client.close()
