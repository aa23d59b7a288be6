"""The SGLang HiCache backend against a real daemon, driven the way
HiCache's cache controller drives it (``batch_exists`` for the prefix, then
``batch_get`` into flat host pages or ``batch_get_v1`` into the host pool).

SGLang itself does not install here (no CPU wheel of it on the package
index this project uses), so the interface is checked against the abstract
methods of ``HiCacheStorage`` as recorded from sglang's
``python/sglang/srt/mem_cache/hicache_storage.py`` (commit in the module's
docstring), and against the real class when SGLang is importable.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvd.connectors.sglang import KvdHiCacheStorage, page_hashes, storage_namespace
from tests.support import DaemonProcess, free_ports

torch = pytest.importorskip("torch", reason="torch is not installed")

PAGE_TOKENS = 4
PAGE_ELEMENTS = 2 * 3 * PAGE_TOKENS * 8  # K and V, 3 layers, 4 tokens, 8 values each

# HiCacheStorage's methods as HiCache calls them: name -> parameter names.
UPSTREAM_METHODS = {
    "get": ["key", "target_location", "target_sizes"],
    "batch_get": ["keys", "target_locations", "target_sizes"],
    "set": ["key", "value", "target_location", "target_sizes"],
    "batch_set": ["keys", "values", "target_locations", "target_sizes"],
    "exists": ["key"],
    "batch_exists": ["keys", "extra_info"],
    "batch_get_v1": ["keys", "host_indices", "extra_info"],
    "batch_set_v1": ["keys", "host_indices", "extra_info"],
    "register_mem_pool_host": ["mem_pool_host"],
    "clear": [],
    "get_stats": [],
}


@dataclass
class StorageConfig:
    """The fields of sglang's HiCacheStorageConfig that a backend reads."""

    tp_rank: int = 0
    tp_size: int = 2
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = "Qwen/Qwen3-0.6B"
    extra_config: dict[str, Any] | None = field(default_factory=dict)


class HostPool:
    """A page-first host KV pool with the calls HiCache's v1 path makes."""

    def __init__(self, pages: int) -> None:
        self.page_size = PAGE_TOKENS
        self.data = torch.zeros(pages, PAGE_ELEMENTS, dtype=torch.float16)

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros(PAGE_ELEMENTS, dtype=torch.float16)

    def set_from_flat_data_page(self, index: int, page: Any) -> None:
        self.data[index // self.page_size].copy_(page)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        return self.data[index // self.page_size]


def backend(target: str, **config: Any) -> KvdHiCacheStorage:
    extra = {
        "backend_name": "kvd",
        "module_path": "kvd.connectors.sglang",
        "class_name": "KvdHiCacheStorage",
        "url": f"kvd://{target}",
        "timeout_s": 2,
    }
    return KvdHiCacheStorage(StorageConfig(extra_config=extra, **config), {})


def pages(count: int, seed: int) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_ELEMENTS, generator=generator).half() for _ in range(count)]


def test_signatures_match_upstream() -> None:
    for name, params in UPSTREAM_METHODS.items():
        ours = list(inspect.signature(getattr(KvdHiCacheStorage, name)).parameters)[1:]
        assert ours == params, f"{name}: {ours} != {params}"
    ours_init = list(inspect.signature(KvdHiCacheStorage.__init__).parameters)[1:]
    assert ours_init == ["storage_config", "kwargs"]  # the factory calls cls(config, kwargs)


def test_real_base_class_when_installed() -> None:
    base = pytest.importorskip(
        "sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed"
    )
    assert issubclass(KvdHiCacheStorage, base.HiCacheStorage)
    assert not inspect.isabstract(KvdHiCacheStorage)


def test_page_hashes_chain() -> None:
    tokens = list(range(10))
    hashes = page_hashes(tokens, PAGE_TOKENS)
    assert len(hashes) == 2 and all(len(h) == 64 for h in hashes)
    assert page_hashes(tokens[4:], PAGE_TOKENS, prior_hash=hashes[0])[0] == hashes[1]
    assert page_hashes([1, 2, 3, 5], PAGE_TOKENS) != page_hashes([1, 2, 3, 4], PAGE_TOKENS)


def test_namespace_separates_ranks_and_models() -> None:
    names = {
        storage_namespace(StorageConfig()),
        storage_namespace(StorageConfig(tp_rank=1)),
        storage_namespace(StorageConfig(tp_size=4)),
        storage_namespace(StorageConfig(model_name="other")),
        storage_namespace(StorageConfig(is_page_first_layout=False)),
        storage_namespace(StorageConfig(pp_size=2, pp_rank=1)),
    }
    assert len(names) == 6
    # MLA pages are the same on every rank: one namespace for all of them.
    assert storage_namespace(StorageConfig(is_mla_model=True, tp_rank=0)) == storage_namespace(
        StorageConfig(is_mla_model=True, tp_rank=1)
    )


def test_generic_path_prefix_and_pages(shared_daemon: DaemonProcess) -> None:
    store = backend(shared_daemon.target)
    keys = page_hashes(list(range(100, 124)), PAGE_TOKENS)  # 6 pages
    data = pages(6, seed=1)
    assert store.batch_exists(keys) == 0
    assert store.batch_set(keys[:4], data[:4])
    assert store.batch_exists(keys) == 4
    assert store.exists(keys[3]) and not store.exists(keys[4])
    targets = [torch.zeros(PAGE_ELEMENTS, dtype=torch.float16) for _ in keys]
    got = store.batch_get(keys, targets)
    for i in range(4):
        assert got[i] is targets[i] and torch.equal(targets[i], data[i])
    assert got[4:] == [None, None]
    assert torch.equal(store.get(keys[0]).view(torch.float16), data[0])  # no target: a new tensor
    other_rank = backend(shared_daemon.target, tp_rank=1)
    assert other_rank.batch_exists(keys) == 0
    store.clear()
    assert store.batch_exists(keys) == 0
    store.close()
    other_rank.close()


def test_zero_copy_path_into_host_pool(shared_daemon: DaemonProcess) -> None:
    store = backend(shared_daemon.target, model_name="zero-copy")
    writer_pool, reader_pool = HostPool(8), HostPool(8)
    store.register_mem_pool_host(writer_pool)
    for i, page in enumerate(pages(3, seed=2)):
        writer_pool.data[i].copy_(page)
    keys = page_hashes(list(range(12)), PAGE_TOKENS)
    host_indices = torch.arange(0, 3 * PAGE_TOKENS)
    assert store.batch_set_v1(keys, host_indices) == [True, True, True]
    store.register_mem_pool_host(reader_pool)
    into = torch.arange(4 * PAGE_TOKENS, 7 * PAGE_TOKENS)  # pages 4..6 of the reader
    assert store.batch_get_v1(keys, into) == [True, True, True]
    assert torch.equal(reader_pool.data[4:7], writer_pool.data[0:3])
    missing = page_hashes(list(range(50, 58)), PAGE_TOKENS)
    assert store.batch_get_v1([keys[0], *missing], torch.arange(0, 3 * PAGE_TOKENS)) == [
        True, False, False,
    ]  # fmt: skip
    store.close()


def test_daemon_down_is_a_miss() -> None:
    (port,) = free_ports(1)  # nothing listens there
    store = backend(f"127.0.0.1:{port}")
    keys = page_hashes(list(range(8)), PAGE_TOKENS)
    target = torch.zeros(PAGE_ELEMENTS, dtype=torch.float16)
    assert store.batch_exists(keys) == 0
    assert store.exists(keys[0]) is False
    assert store.get(keys[0], target) is None
    assert store.batch_get(keys, [target, target]) == [None, None]
    assert store.batch_set(keys, pages(2, seed=3)) is False
    assert store.set(keys[0], pages(1, seed=4)[0]) is False
    store.register_mem_pool_host(HostPool(4))
    assert store.batch_get_v1(keys, torch.arange(0, 8)) == [False, False]
    assert store.get_stats() == {"kvd_failures": 7}
    store.close()


@pytest.mark.parametrize("batch_bytes", [1, 64 << 20])  # one page per batch, or all at once
def test_batched_loads_stop_at_the_first_miss(
    shared_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, batch_bytes: int
) -> None:
    monkeypatch.setattr("kvd.connectors.common.LOAD_BATCH_BYTES", batch_bytes)
    store = backend(shared_daemon.target, model_name=f"batches-{batch_bytes}")
    writer_pool, reader_pool = HostPool(8), HostPool(8)
    store.register_mem_pool_host(writer_pool)
    for i, page in enumerate(pages(4, seed=5)):
        writer_pool.data[i].copy_(page)
    keys = page_hashes(list(range(16)), PAGE_TOKENS)
    assert store.batch_set_v1(keys, torch.arange(0, 4 * PAGE_TOKENS)) == [True] * 4
    with_gap = [keys[0], keys[1], "absent", keys[3]]
    store.register_mem_pool_host(reader_pool)
    assert store.batch_get_v1(with_gap, torch.arange(0, 4 * PAGE_TOKENS)) == [
        True, True, False, False,
    ]  # fmt: skip
    assert torch.equal(reader_pool.data[0:2], writer_pool.data[0:2])
    assert not reader_pool.data[2:4].any()
    targets = [torch.zeros(PAGE_ELEMENTS, dtype=torch.float16) for _ in range(4)]
    got = store.batch_get(with_gap, targets)
    assert [page is not None for page in got] == [True, True, False, False]
    assert torch.equal(targets[1], writer_pool.data[1])  # (a page after the miss may be read too)
    store.close()
