"""The vLLM V1 connector against a real daemon: a scheduler-side instance
plans, a worker-side instance moves blocks of a paged KV cache laid out as
vLLM's FlashAttention backend lays it out ([2, blocks, block, heads, dim]).

vLLM does not install here (no CPU wheel on this project's package index),
so the scheduler output and request objects are the fields vLLM fills, the
interface is checked against ``KVConnectorBase_V1``'s abstract methods as
recorded from vLLM's ``kv_connector/v1/base.py`` (commit in the module's
docstring), and against the real class when vLLM is importable.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvd.client import Client
from kvd.connectors.vllm import BlockTransfer, KvdConnector, KvdConnectorMetadata, block_keys
from tests.support import DaemonProcess, free_ports

torch = pytest.importorskip("torch", reason="torch is not installed")

BLOCK = 4
NUM_BLOCKS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

UPSTREAM_ABSTRACT = {
    "start_load_kv": ["forward_context", "kwargs"],
    "wait_for_layer_load": ["layer_name"],
    "save_kv_layer": ["layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": [],
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["scheduler_output"],
}
UPSTREAM_OPTIONAL = {
    "register_kv_caches": ["kv_caches"],
    "request_finished": ["request", "block_ids"],
    "get_block_ids_with_load_errors": [],
    "shutdown": [],
}


def vllm_config(target: str, model: str = "Qwen/Qwen3-0.6B") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="KvdConnector",
            kv_connector_module_path="kvd.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"url": f"kvd://{target}", "timeout_s": 2, "tp_rank": 0},
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=SimpleNamespace(model=model, revision=None, dtype=torch.float16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    num_scheduled_tokens: dict[str, int]
    scheduled_cached_reqs: Any = field(
        default_factory=lambda: SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[]
        )
    )


def paged_caches(seed: int | None) -> dict[str, Any]:
    shape = (2, NUM_BLOCKS, BLOCK, 2, 8)
    if seed is None:
        return {name: torch.zeros(shape, dtype=torch.float16) for name in LAYERS}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).half() for name in LAYERS}


_made: list[KvdConnector] = []


@pytest.fixture(autouse=True)
def _shut_down_connectors() -> Iterator[None]:
    """vLLM calls ``shutdown()`` when a worker exits; so do the tests."""
    yield
    while _made:
        _made.pop().shutdown()


def pair(target: str) -> tuple[KvdConnector, KvdConnector]:
    config = vllm_config(target)
    kv_config = SimpleNamespace(num_blocks=NUM_BLOCKS)
    scheduler = KvdConnector(config, SimpleNamespace(name="SCHEDULER"), kv_config)
    worker = KvdConnector(config, SimpleNamespace(name="WORKER"), kv_config)
    _made.extend((scheduler, worker))
    return scheduler, worker


def step(scheduler: KvdConnector, worker: KvdConnector, request: Request, blocks: list[int]) -> int:
    """One engine step of a new request: lookup, alloc, load, forward (nothing), save."""
    matched, is_async = scheduler.get_num_new_matched_tokens(request, 0)
    assert is_async is False
    assert matched is not None
    scheduler.update_state_after_alloc(request, Blocks(blocks), matched)
    output = SchedulerOutput(
        [NewRequestData(request.request_id, request.prompt_token_ids, (blocks,), matched)],
        {request.request_id: len(request.prompt_token_ids) - matched},
    )
    meta = scheduler.build_connector_meta(output)
    assert isinstance(meta, KvdConnectorMetadata)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    scheduler.request_finished(request, blocks)
    return matched


def test_signatures_match_upstream() -> None:
    for name, params in {**UPSTREAM_ABSTRACT, **UPSTREAM_OPTIONAL}.items():
        ours = list(inspect.signature(getattr(KvdConnector, name)).parameters)[1:]
        assert ours == params, f"{name}: {ours} != {params}"
    init = list(inspect.signature(KvdConnector.__init__).parameters)[1:]
    assert init == ["vllm_config", "role", "kv_cache_config"]


def test_real_base_class_when_installed() -> None:
    base = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.base", reason="vLLM is not installed"
    )
    assert issubclass(KvdConnector, base.KVConnectorBase_V1)
    assert not inspect.isabstract(KvdConnector)


def test_block_keys_chain_and_extras() -> None:
    tokens = list(range(12))
    keys = block_keys(tokens, BLOCK)
    assert len(keys) == 3
    assert block_keys(tokens[:8], BLOCK) == keys[:2]  # a prefix's keys are a prefix
    assert block_keys(tokens, BLOCK, cache_salt="a")[0] != keys[0]
    assert block_keys(tokens, BLOCK, lora_name="l")[0] != keys[0]


def test_save_then_restore_in_another_engine(shared_daemon: DaemonProcess) -> None:
    scheduler, worker = pair(shared_daemon.target)
    worker.register_kv_caches(paged_caches(seed=1))
    first = Request("a", list(range(1000, 1013)))  # 3 full blocks + 1 token
    assert step(scheduler, worker, first, [5, 6, 7, 8]) == 0
    source = {name: t.clone() for name, t in worker._kv_caches.items()}

    scheduler2, worker2 = pair(shared_daemon.target)  # a fresh engine: empty paged cache
    worker2.register_kv_caches(paged_caches(seed=None))
    second = Request("b", [*first.prompt_token_ids, 7, 8, 9, 10, 11])  # the next turn
    assert step(scheduler2, worker2, second, [1, 2, 3, 4, 9]) == 3 * BLOCK
    for name in LAYERS:
        for src, dst in ((5, 1), (6, 2), (7, 3)):
            assert torch.equal(worker2._kv_caches[name][:, dst], source[name][:, src])
        assert not worker2._kv_caches[name][:, 4].any()  # the last block was not loaded
    assert worker2.get_block_ids_with_load_errors() == set()
    salted = Request("c", second.prompt_token_ids, cache_salt="tenant-b")
    assert scheduler2.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_lookup_takes_a_lease_and_finish_releases_it(shared_daemon: DaemonProcess) -> None:
    scheduler, worker = pair(shared_daemon.target)
    worker.register_kv_caches(paged_caches(seed=2))
    request = Request("lease", list(range(2000, 2009)))
    step(scheduler, worker, request, [0, 1, 2])
    again = Request("lease-2", request.prompt_token_ids)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, False)
    assert scheduler._tracked["lease-2"].lease is not None
    scheduler.request_finished(again, [])
    assert "lease-2" not in scheduler._tracked


def test_daemon_down_is_a_miss_and_a_load_error() -> None:
    (port,) = free_ports(1)  # nothing listens there
    scheduler, worker = pair(f"127.0.0.1:{port}")
    worker.register_kv_caches(paged_caches(seed=3))
    request = Request("down", list(range(9)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = KvdConnectorMetadata()
    meta.loads.append(BlockTransfer("down", block_keys(request.prompt_token_ids, BLOCK), [3, 4]))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())  # no exception: the blocks are reported instead
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.get_block_ids_with_load_errors() == set()
    assert step(scheduler, worker, request, [0, 1, 2]) == 0  # saves fail quietly
    # The first call of each side waits for the daemon; the next ones are
    # misses at once for the retry window.
    for guard in (scheduler.guard, worker.guard):
        assert guard.failures() >= 2 and guard.skipped >= 1


@pytest.mark.parametrize("batch_bytes", [1, 64 << 20])  # one block per batch, or all at once
def test_loads_in_batches_stop_at_the_first_miss(
    shared_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, batch_bytes: int
) -> None:
    monkeypatch.setattr("kvd.connectors.common.LOAD_BATCH_BYTES", batch_bytes)
    scheduler, worker = pair(shared_daemon.target)
    worker.register_kv_caches(paged_caches(seed=4))
    first = 3000 + batch_bytes % 100  # other tokens per case: nothing stored by the other
    request = Request(f"batches-{batch_bytes}", list(range(first, first + 17)))  # 4 blocks + 1
    step(scheduler, worker, request, [0, 1, 2, 3, 4])
    keys = block_keys(request.prompt_token_ids, BLOCK)[:4]
    with Client(shared_daemon.target) as client:
        assert client.delete(worker.namespace, [keys[2]]) == 1
    before = {name: t.clone() for name, t in worker._kv_caches.items()}
    meta = KvdConnectorMetadata()
    meta.loads.append(BlockTransfer("load", keys, [10, 11, 12, 13]))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    for name in LAYERS:
        cache = worker._kv_caches[name]
        assert torch.equal(cache[:, 10], cache[:, 0]) and torch.equal(cache[:, 11], cache[:, 1])
        assert torch.equal(cache[:, 12:14], before[name][:, 12:14])  # from the miss on: untouched
    assert worker.get_block_ids_with_load_errors() == {12, 13}
