"""The LMCache plugin inside LMCache's own machinery (its config, connector
loader, RemoteBackend, LocalCPUBackend allocator) against a real daemon.

Skipped, with the reason, where LMCache is not installed (``make e2e-deps``
or ``pip install --no-deps lmcache`` plus the pure-Python imports it needs).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvd.connectors.lmcache import kvd_address, split_key_string
from tests.support import DaemonProcess, free_ports

lmcache = pytest.importorskip("lmcache", reason="LMCache is not installed")
torch = pytest.importorskip("torch", reason="torch is not installed")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from kvd.connectors.lmcache import KvdRemoteConnector  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK_TOKENS = 16
MODEL = "org/model-7b"
# (layers, 2, tokens, kv heads, head size): 2 KiB per fp16 chunk, small and fast.
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)


def make_config(target: str, **extra: Any) -> Any:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS,
        local_cpu=False,
        max_local_cpu_size=0.05,
        remote_serde="naive",
        remote_storage_plugins=["kvd"],
        extra_config={
            "remote_storage_plugin.kvd.module_path": "kvd.connectors.lmcache",
            "remote_storage_plugin.kvd.class_name": "KvdConnectorAdapter",
            "remote_storage_plugin.kvd.url": f"kvd://{target}",
            "remote_storage_plugin.kvd.timeout_s": 2.0,
            **extra,
        },
    )


def make_metadata(worker_id: int = 0, world_size: int = 1) -> Any:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.float16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK_TOKENS,
    )


def key(chunk_hash: int, worker_id: int = 0, world_size: int = 1, **tags: str) -> Any:
    configs = {f"lmcache.tag.{k}": v for k, v in tags.items()} or None
    return CacheEngineKey(MODEL, world_size, worker_id, chunk_hash, torch.float16, configs)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """LMCache runs its connectors on an event loop in a thread of its own."""
    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, daemon=True)
    thread.start()
    yield event_loop
    event_loop.call_soon_threadsafe(event_loop.stop)
    thread.join(5)
    event_loop.close()


class Engine:
    """One LMCache worker's storage side: allocator + RemoteBackend over kvd."""

    def __init__(self, target: str, loop: asyncio.AbstractEventLoop, worker_id: int = 0) -> None:
        self.config = make_config(target)
        self.metadata = make_metadata(worker_id)
        self.cpu = LocalCPUBackend(self.config, self.metadata)
        self.loop = loop
        self.remote = RemoteBackend(self.config, self.metadata, loop, self.cpu, plugin_name="kvd")

    def chunk(self, seed: int, tokens: int = CHUNK_TOKENS) -> Any:
        shape = list(self.metadata.get_shapes()[0])
        shape[2] = tokens
        memory_obj = self.cpu.allocate([torch.Size(shape)], [torch.float16], MemoryFormat.KV_2LTD)
        assert memory_obj is not None
        generator = torch.Generator().manual_seed(seed)
        memory_obj.tensor.copy_(torch.randn(shape, generator=generator, dtype=torch.float32))
        return memory_obj

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        if self.remote.connection is not None:
            self.run(self.remote.connection.close())


@pytest.fixture
def engine(shared_daemon: DaemonProcess, loop: asyncio.AbstractEventLoop) -> Iterator[Engine]:
    built = Engine(shared_daemon.target, loop)
    yield built
    built.close()


def test_key_string_fields_all_separate() -> None:
    base = "m@2@1@abcd@half"
    fields, block = split_key_string(base)
    assert fields == {"model": "m", "world_size": "2", "worker_id": "1", "dtype": "half"}
    assert block == "abcd"
    variants = [
        base,
        "n@2@1@abcd@half",
        "m@4@1@abcd@half",
        "m@2@0@abcd@half",
        "m@2@1@abce@half",
        "m@2@1@abcd@float",
        "m@2@1@abcd@half@lora%a",
        "m@2@1@abcd@half@3",
    ]
    assert len({kvd_address(v) for v in variants}) == len(variants)
    assert kvd_address(base, salt="tenant-a") != kvd_address(base)
    with pytest.raises(ValueError):
        split_key_string("m@2@1@abcd")


def test_plugin_loads_from_config(shared_daemon: DaemonProcess, loop: Any) -> None:
    config = make_config(shared_daemon.target)
    metadata = make_metadata()
    cpu = LocalCPUBackend(config, metadata)
    for url in ("plugin://kvd", f"kvd://{shared_daemon.target}"):
        connector = CreateConnector(url, loop, cpu, config, metadata, plugin_name="kvd")
        inner = connector.getWrappedConnector()
        assert isinstance(inner, KvdRemoteConnector)
        assert inner.target == shared_daemon.target
        asyncio.run_coroutine_threadsafe(connector.close(), loop).result(10)


def test_put_get_round_trip_through_remote_backend(engine: Engine) -> None:
    keys = [key(1000 + i) for i in range(4)]
    sent = [engine.chunk(i) for i in range(4)]
    expected = [m.tensor.clone() for m in sent]
    engine.remote.batched_submit_put_task(keys, sent)
    for future_key in keys:  # batched put is asynchronous: wait for it
        assert _eventually(lambda k=future_key: engine.remote.contains(k))
    got = engine.remote.batched_get_blocking(keys)
    for memory_obj, tensor in zip(got, expected, strict=True):
        assert memory_obj is not None
        assert memory_obj.get_memory_format() == MemoryFormat.KV_2LTD
        assert torch.equal(memory_obj.tensor, tensor)
        memory_obj.ref_count_down()
    single = engine.remote.get_blocking(keys[0])
    assert single is not None and torch.equal(single.tensor, expected[0])
    single.ref_count_down()
    for memory_obj in sent:
        memory_obj.ref_count_down()


def test_partial_chunk_keeps_its_shape(engine: Engine) -> None:
    partial = engine.chunk(7, tokens=5)
    expected = partial.tensor.clone()
    future = engine.remote.submit_put_task(key(2000), partial)
    future.result(10)
    got = engine.remote.get_blocking(key(2000))
    assert got is not None
    assert list(got.get_shapes()[0]) == list(expected.shape)
    assert torch.equal(got.tensor, expected)
    got.ref_count_down()
    partial.ref_count_down()


def test_longest_prefix_in_one_call_with_lease(engine: Engine) -> None:
    keys = [key(3000 + i) for i in range(6)]
    sent = [engine.chunk(30 + i) for i in range(4)]
    engine.remote.submit_put_task(keys[0], sent[0]).result(10)
    for k, m in zip(keys[1:4], sent[1:4], strict=True):
        engine.remote.submit_put_task(k, m).result(10)
    connector = engine.remote.connection
    assert connector is not None
    assert engine.remote.batched_contains(keys) == 4
    hits = engine.run(connector.batched_async_contains("req-1", keys, pin=True))
    assert hits == 4
    inner = connector.getWrappedConnector()
    assert inner._leases.get("req-1"), "a pinned lookup holds a lease"
    got = engine.run(connector.batched_get_non_blocking("req-1", keys))
    assert len(got) == 4
    for memory_obj, original in zip(got, sent, strict=True):
        assert torch.equal(memory_obj.tensor, original.tensor)
        memory_obj.ref_count_down()
    assert "req-1" not in inner._leases, "the get released the lookup's lease"
    # A hole in the middle ends the prefix there.
    holed = [keys[0], key(3999), keys[1]]
    assert engine.run(connector.batched_async_contains("req-2", holed)) == 1
    for memory_obj in sent:
        memory_obj.ref_count_down()


def test_other_rank_and_tags_miss(engine: Engine) -> None:
    chunk = engine.chunk(50)
    engine.remote.submit_put_task(key(4000), chunk).result(10)
    assert engine.remote.contains(key(4000))
    assert not engine.remote.contains(key(4000, worker_id=1, world_size=2))
    assert not engine.remote.contains(key(4000, world_size=2))
    assert not engine.remote.contains(key(4000, lora="x"))
    chunk.ref_count_down()


def test_daemon_down_is_a_miss(loop: asyncio.AbstractEventLoop) -> None:
    (port,) = free_ports(1)  # nothing listens there
    engine = Engine(f"127.0.0.1:{port}", loop)
    chunk = engine.chunk(60)
    keys = [key(5000), key(5001)]
    assert engine.remote.contains(keys[0]) is False
    assert engine.remote.get_blocking(keys[0]) is None
    assert engine.remote.batched_get_blocking(keys) == [None, None]
    assert engine.remote.batched_contains(keys) == 0
    connector = engine.remote.connection
    assert connector is not None
    assert engine.run(connector.batched_async_contains("r", keys, pin=True)) == 0
    assert engine.run(connector.batched_get_non_blocking("r", keys)) == []
    engine.remote.submit_put_task(keys[0], chunk).result(10)  # dropped, not raised
    inner = connector.getWrappedConnector()
    assert inner.guard.failures() >= 5
    chunk.ref_count_down()
    engine.close()


def _eventually(predicate: Any, attempts: int = 200) -> bool:
    for _ in range(attempts):
        if predicate():
            return True
        threading.Event().wait(0.01)
    return bool(predicate())
