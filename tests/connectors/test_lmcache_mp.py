"""The MP-mode L2 adapter inside LMCache's own multi-process server.

``run_cache_server`` (what ``lmcache server`` runs) is started on this CPU
with the adapter named by its ``--l2-adapter '{"type": "plugin", ...}'``
flag, and driven the way a CPU engine drives it: over its ZMQ transport,
with LMCache's engine-driven transfer context (``EngineDrivenContextPickle``)
storing and retrieving chunks. The server's StoreController writes them to
kvd, its PrefetchController looks up, locks, loads and unlocks through the
adapter. Other tests build the adapter with LMCache's plugin factory and call
its interface with LMCache's own keys, memory objects and bitmaps. Every
daemon is a real ``kvd serve``.

Skipped, with the reason, where LMCache, torch or the MP server's imports are
missing (``make e2e-deps``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvd.client import Client
from kvd.connectors.common import bytes_key
from kvd.connectors.lease_locks import LockTable
from tests.support import DaemonFactory, DaemonProcess, free_ports, stop_process, wait_until

lmcache = pytest.importorskip("lmcache", reason="LMCache is not installed")
torch = pytest.importorskip("torch", reason="torch is not installed")

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage reports from tests

try:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.mp_observability.config import (
        add_observability_args,
        parse_args_to_observability_config,
    )
    from lmcache.v1.multiprocess.config import (
        add_coordinator_args,
        add_mp_server_args,
        parse_args_to_coordinator_config,
        parse_args_to_mp_server_config,
    )
    from lmcache.v1.multiprocess.custom_types import (
        IPCCacheServerKey,
        RegisterEngineDrivenContextPayload,
    )
    from lmcache.v1.multiprocess.server import run_cache_server
    from lmcache.v1.multiprocess.transfer_context.base import EngineDrivenContextMetadata
    from lmcache.v1.multiprocess.transfer_context.pickle import EngineDrivenContextPickle
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
except ImportError as exc:  # e.g. opentelemetry or httpx missing
    pytest.skip(f"LMCache's MP server does not import: {exc}", allow_module_level=True)

from kvd.connectors.lmcache_mp import (  # noqa: E402
    KvdL2Adapter,
    KvdL2AdapterConfig,
    object_namespace,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK = 16  # tokens per chunk
LAYERS = 2
HIDDEN = 64
# One chunk: [2, layers, tokens, hidden] float32 = 16 KiB.
CHUNK_SHAPE = (2, LAYERS, CHUNK, HIDDEN)
MODEL = "org/model-7b"
WAIT_S = 10.0
RANK0 = ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)


def plugin_spec(url: str, **params: Any) -> dict[str, Any]:
    """What a user writes after ``--l2-adapter``."""
    return {
        "type": "plugin",
        "module_path": "kvd.connectors.lmcache_mp",
        "class_name": "KvdL2Adapter",
        "adapter_params": {"url": url, **params},
    }


def chunks_of(seed: int, count: int) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(CHUNK_SHAPE, generator=generator) for _ in range(count)]


def memory_obj(values: Any) -> Any:
    """An LMCache memory object over a tensor's own bytes (as L1 hands them out)."""
    values = values.contiguous()
    raw = values.flatten().view(torch.uint8)
    meta = MemoryObjMetadata(
        shape=values.shape,
        dtype=values.dtype,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=[values.shape],
        dtypes=[values.dtype],
    )
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def object_key(n: int, model: str = MODEL) -> Any:
    return ObjectKey(chunk_hash=n.to_bytes(32, "big"), model_name=model, kv_rank=RANK0)


def wait_result(query: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = query()
        if result is not None:
            return result
        time.sleep(0.005)
    raise AssertionError("the adapter did not answer in time")


def bits(bitmap: Any) -> list[int]:
    return [i for i in range(len(bitmap)) if bitmap.test(i)]


def readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def leases(daemon: DaemonProcess) -> int:
    with Client(daemon.target) as client:
        return int(client.stats()["leases_active"])


class MPServer:
    """LMCache's MP cache server with kvd as its L2, and one CPU engine on it."""

    def __init__(self, url: str, **params: Any) -> None:
        (self.port,) = free_ports(1)
        parser = argparse.ArgumentParser()
        add_mp_server_args(parser)
        add_storage_manager_args(parser)
        add_observability_args(parser)
        add_coordinator_args(parser)
        args = parser.parse_args(
            [
                "--host", "127.0.0.1",
                "--port", str(self.port),
                "--chunk-size", str(CHUNK),
                "--supported-transfer-mode", "engine_driven",
                # blake3 is a compiled wheel kvd's environment does not carry;
                # the fallback hash is stable within one process.
                "--hash-algorithm", "builtin",
                "--disable-metrics",
                "--l1-size-gb", "0.05",
                "--eviction-policy", "LRU",
                "--l2-adapter", json.dumps(plugin_spec(url, **params)),
            ]
        )  # fmt: skip
        self.server, self.engine = run_cache_server(
            parse_args_to_mp_server_config(args),
            parse_args_to_config(args),
            parse_args_to_observability_config(args),
            return_engine=True,
            start_prometheus_http_server=False,
            coordinator_config=parse_args_to_coordinator_config(args),
        )
        self.adapter = self.engine.storage_manager.l2_adapters()[0][1]
        self.client = RequestClientFactory.create(f"tcp://127.0.0.1:{self.port}")
        self.transfer = self.register(1, MODEL)

    def register(self, instance_id: int, model: str) -> Any:
        payload = RegisterEngineDrivenContextPayload(
            instance_id=instance_id,
            model_name=model,
            world_size=1,
            block_size=CHUNK,
            num_layers=LAYERS,
            hidden_dim_size=HIDDEN,
            dtype_str="float32",
            use_mla=False,
        )
        self.client.register_kv_cache_engine_driven_context(payload).result(timeout=WAIT_S)
        layout = MemoryLayoutDesc(shapes=[torch.Size(CHUNK_SHAPE)], dtypes=[torch.float32])
        metadata = EngineDrivenContextMetadata(layout_desc=layout, block_size=CHUNK, use_mla=False)
        return EngineDrivenContextPickle(metadata, self.client, WAIT_S)

    @staticmethod
    def key(tokens: list[int], request_id: str, worker: int | None = 0, model: str = MODEL) -> Any:
        return IPCCacheServerKey.from_token_ids(
            model, 1, worker, tokens, start=0, end=len(tokens), request_id=request_id
        )

    def store(self, tokens: list[int], chunks: list[Any], request_id: str) -> bool:
        key = self.key(tokens, request_id)
        self.transfer.prepare_store(key, 1)
        stored = bool(self.transfer.commit_store(key, 1, chunks))
        self.client.end_session(request_id).result(timeout=WAIT_S)
        return stored

    def object_keys(self, tokens: list[int]) -> list[Any]:
        """The ObjectKeys the server files these tokens' chunks under."""
        probe = f"probe-{time.monotonic_ns()}"
        keys = self.engine.context.resolve_obj_keys(self.key(tokens, probe), [0])[0]
        self.engine.context.session_manager.remove(probe)
        return list(keys)

    def in_kvd(self, daemon: DaemonProcess, tokens: list[int]) -> int:
        keys = self.object_keys(tokens)
        with Client(daemon.target) as client:
            return client.lookup(object_namespace(keys[0]), [bytes_key(k.chunk_hash) for k in keys])

    def drop_l1(self) -> None:
        """Empty the server's L1. Its store controller read-locks a chunk
        until it has taken the adapter's completion, a moment after kvd
        holds the value, and a clear keeps locked chunks: clear until none
        is left."""

        def cleared() -> bool:
            self.client.clear(False).result(timeout=WAIT_S)
            return int(self.engine.storage_manager.get_l1_usage()[0]) == 0

        assert wait_until(cleared), "LMCache's L1 kept locked chunks"

    def lookup(self, tokens: list[int], request_id: str, model: str = MODEL) -> int:
        self.client.lookup(self.key(tokens, request_id, None, model), 1).result(timeout=WAIT_S)
        hits = self.client.wait_prefetch_status(request_id, WAIT_S).result(timeout=WAIT_S + 5)
        return int(hits)

    def retrieve(self, tokens: list[int], request_id: str) -> list[Any] | None:
        key = self.key(tokens, request_id)
        got = self.transfer.prepare_retrieve(key, 1)
        self.transfer.commit_retrieve(key, 1)
        self.client.end_session(request_id).result(timeout=WAIT_S)
        return got  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.engine.close()


@pytest.fixture(scope="module")
def mp_server(shared_daemon: DaemonProcess) -> Iterator[MPServer]:
    built = MPServer(f"kvd://{shared_daemon.socket}")  # same node: shared memory
    yield built
    built.close()


def make_adapter(url: str, **params: Any) -> Any:
    """The adapter as LMCache builds it from an ``--l2-adapter`` flag."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(plugin_spec(url, **params))])
    return create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])


# -- the plugin path -----------------------------------------------------------


def test_plugin_config_builds_the_adapter(shared_daemon: DaemonProcess) -> None:
    adapter = make_adapter(f"kvd://{shared_daemon.target}", lease_ms=5000, timeout_s=1.5)
    try:
        assert isinstance(adapter, KvdL2Adapter) and isinstance(adapter, L2AdapterInterface)
        assert isinstance(adapter.config, KvdL2AdapterConfig)  # found as class_name + "Config"
        assert adapter.lease_ms == 5000 and adapter.target == shared_daemon.target
        fds = {
            adapter.get_store_event_fd(),
            adapter.get_lookup_and_lock_event_fd(),
            adapter.get_load_event_fd(),
        }
        assert len(fds) == 3
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="unknown kvd L2 adapter parameter"):
        make_adapter("kvd://127.0.0.1:1", lease_msec=5)


def test_the_server_loaded_kvd_as_its_l2(mp_server: MPServer) -> None:
    assert isinstance(mp_server.adapter, KvdL2Adapter)


# -- through LMCache's MP server ----------------------------------------------------


def test_store_lookup_load_through_the_server(
    mp_server: MPServer, shared_daemon: DaemonProcess
) -> None:
    tokens = list(range(1000, 1000 + 4 * CHUNK))
    chunks = chunks_of(1, 4)
    assert mp_server.store(tokens, chunks, "store-1")
    assert wait_until(lambda: mp_server.in_kvd(shared_daemon, tokens) == 4)
    mp_server.drop_l1()  # the server must now load from kvd
    before = mp_server.adapter.report_status()["failures"]
    assert mp_server.lookup(tokens, "load-1") == 4
    got = mp_server.retrieve(tokens, "load-1")
    assert got is not None and len(got) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))
    # The prefetch unlocked what it loaded: no lock and no lease left.
    assert wait_until(lambda: len(mp_server.adapter.locks) == 0)
    assert wait_until(lambda: leases(shared_daemon) == 0)
    assert mp_server.adapter.report_status()["failures"] == before


def test_prefix_hit_then_miss_through_the_server(
    mp_server: MPServer, shared_daemon: DaemonProcess
) -> None:
    stored = list(range(2000, 2000 + 2 * CHUNK))
    chunks = chunks_of(2, 2)
    assert mp_server.store(stored, chunks, "store-2")
    assert wait_until(lambda: mp_server.in_kvd(shared_daemon, stored) == 2)
    mp_server.drop_l1()
    longer = stored + list(range(9000, 9000 + 2 * CHUNK))  # two more chunks, never stored
    assert mp_server.lookup(longer, "load-2") == 2
    got = mp_server.retrieve(stored, "load-2")
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))
    assert mp_server.lookup(list(range(7000, 7000 + 3 * CHUNK)), "miss-2") == 0
    mp_server.client.end_session("miss-2").result(timeout=WAIT_S)
    assert wait_until(lambda: leases(shared_daemon) == 0)


def test_another_model_is_never_served(mp_server: MPServer, shared_daemon: DaemonProcess) -> None:
    tokens = list(range(3000, 3000 + 2 * CHUNK))
    assert mp_server.store(tokens, chunks_of(3, 2), "store-3")
    assert wait_until(lambda: mp_server.in_kvd(shared_daemon, tokens) == 2)
    mp_server.drop_l1()
    mp_server.register(2, "org/other-model")
    assert mp_server.lookup(tokens, "other-3", model="org/other-model") == 0
    mp_server.client.end_session("other-3").result(timeout=WAIT_S)


def test_stopped_daemon_is_a_miss_through_the_server(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    server = MPServer(f"kvd://{daemon.socket}", timeout_s=0.5)
    try:
        tokens = list(range(4000, 4000 + 2 * CHUNK))
        assert server.store(tokens, chunks_of(4, 2), "store-4")
        assert wait_until(lambda: server.in_kvd(daemon, tokens) == 2)
        server.drop_l1()
        stop_process(daemon.proc.pid)
        try:
            start = time.monotonic()
            assert server.lookup(tokens, "stopped-4") == 0  # a miss, not an error
            assert time.monotonic() - start < 3.0  # one 0.5 s deadline, not a hang
            server.client.end_session("stopped-4").result(timeout=WAIT_S)
            assert server.adapter.report_status()["failures"] >= 1
            assert not server.adapter.report_status()["is_healthy"]
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        server.close()


# -- the adapter's interface, called as LMCache's controllers call it ------------


def test_lookup_locks_with_leases_and_unlock_releases(shared_daemon: DaemonProcess) -> None:
    adapter = make_adapter(f"kvd://{shared_daemon.socket}")
    try:
        keys = [object_key(100 + i) for i in range(5)]
        values = chunks_of(5, 5)
        stored = [0, 1, 3, 4]  # a hole at 2: CacheBlend and P2P fetch past it
        task = adapter.submit_store_task(
            [keys[i] for i in stored], [memory_obj(values[i]) for i in stored]
        )
        result = wait_result(lambda: adapter.pop_completed_store_tasks().get(task))
        assert result.is_successful() and result.bytes_transferred() == 4 * values[0].numel() * 4
        base = leases(shared_daemon)

        task = adapter.submit_lookup_and_lock_task(keys, {})
        found = wait_result(lambda: adapter.query_lookup_and_lock_result(task))
        assert bits(found) == stored
        assert adapter.query_lookup_and_lock_result(task) is None  # answered once
        assert leases(shared_daemon) == base + 2  # one lease per run of hits
        assert len(adapter.locks) == 4

        targets = [memory_obj(torch.zeros(CHUNK_SHAPE)) for _ in keys]
        task = adapter.submit_load_task(keys, targets)
        loaded = wait_result(lambda: adapter.query_load_result(task))
        assert bits(loaded) == stored
        for i in stored:
            assert torch.equal(targets[i].tensor, values[i])
        assert torch.count_nonzero(targets[2].tensor) == 0

        adapter.submit_unlock(keys[:2])  # the first lease is free now, the second is not
        assert wait_until(lambda: leases(shared_daemon) == base + 1)
        adapter.submit_unlock([keys[2], keys[3]])  # keys[2] was never locked: ignored
        assert leases(shared_daemon) == base + 1
        adapter.submit_unlock([keys[4]])
        assert wait_until(lambda: leases(shared_daemon) == base)
        assert len(adapter.locks) == 0
    finally:
        adapter.close()


def test_load_of_the_wrong_size_or_model_fails(shared_daemon: DaemonProcess) -> None:
    adapter = make_adapter(f"kvd://{shared_daemon.target}")  # TCP: the bulk port
    try:
        key = object_key(200)
        task = adapter.submit_store_task([key], [memory_obj(chunks_of(6, 1)[0])])
        assert wait_result(lambda: adapter.pop_completed_store_tasks().get(task)).is_successful()
        half = memory_obj(torch.zeros(CHUNK_SHAPE)[:, :, : CHUNK // 2])
        other = object_key(200, model="org/other-model")
        task = adapter.submit_load_task([key, other], [half, memory_obj(torch.zeros(CHUNK_SHAPE))])
        assert bits(wait_result(lambda: adapter.query_load_result(task))) == []
        task = adapter.submit_lookup_and_lock_task([other], {})
        assert bits(wait_result(lambda: adapter.query_lookup_and_lock_result(task))) == []
    finally:
        adapter.close()


def stopped_or_gone(daemon: DaemonProcess, url: str) -> None:
    """Store, lookup and load against a daemon that does not answer: each one
    is reported (failed, miss, failed) within about one deadline, its fd set."""
    adapter = make_adapter(url, timeout_s=0.5)
    try:
        keys = [object_key(300 + i) for i in range(3)]
        objs = [memory_obj(v) for v in chunks_of(7, 3)]
        start = time.monotonic()
        store = adapter.submit_store_task(keys, objs)
        lookup = adapter.submit_lookup_and_lock_task(keys, {})
        load = adapter.submit_load_task(keys, [memory_obj(torch.zeros(CHUNK_SHAPE)) for _ in keys])
        assert not wait_result(
            lambda: adapter.pop_completed_store_tasks().get(store)
        ).is_successful()
        assert bits(wait_result(lambda: adapter.query_lookup_and_lock_result(lookup))) == []
        assert bits(wait_result(lambda: adapter.query_load_result(load))) == []
        assert time.monotonic() - start < 3.0
        for fd in (adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd()):
            assert readable(fd)
        adapter.submit_unlock(keys)  # nothing locked: nothing to do, no error
        assert adapter.report_status()["failures"] >= 3
    finally:
        start = time.monotonic()
        adapter.close()
        assert time.monotonic() - start < 3.0


def test_stopped_daemon_fails_tasks_in_bounded_time(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    stop_process(daemon.proc.pid)
    try:
        stopped_or_gone(daemon, f"kvd://{daemon.socket}")
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


def test_gone_daemon_fails_tasks_at_once(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    target = daemon.target
    daemon.stop()
    stopped_or_gone(daemon, f"kvd://{target}")


def test_full_queue_answers_at_once(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that finds its lane's queue full is answered (a miss) at once,
    never waited for. The lane's thread is held by a load of its own first
    (as by a slow daemon), so the queue's state is known, not raced."""
    monkeypatch.setattr("kvd.connectors.lmcache_mp.LOAD_QUEUE_MAX", 1)
    daemon = daemon_factory()
    adapter = make_adapter(f"kvd://{daemon.socket}", timeout_s=0.5)
    busy, go = threading.Event(), threading.Event()

    def held_load() -> None:
        busy.set()
        go.wait(WAIT_S)

    try:
        assert adapter._loads.tasks.maxsize == 1, adapter.report_status()
        assert adapter._loads.submit(held_load) and busy.wait(WAIT_S)
        keys = [object_key(400)]
        waiting = adapter.submit_load_task(keys, [memory_obj(torch.zeros(CHUNK_SHAPE))])
        start = time.monotonic()
        full = adapter.submit_load_task(keys, [memory_obj(torch.zeros(CHUNK_SHAPE))])
        refused = adapter.query_load_result(full)
        assert time.monotonic() - start < 0.5
        assert refused is not None and bits(refused) == []
        assert adapter.query_load_result(waiting) is None  # still in the queue
        go.set()
        assert bits(wait_result(lambda: adapter.query_load_result(waiting))) == []  # not stored
    finally:
        go.set()
        adapter.close()


# -- the lock table ----------------------------------------------------------------


def test_lock_table_releases_a_lease_with_its_last_key() -> None:
    table = LockTable(keys_max=4)
    far = time.monotonic() + 60
    assert table.add("ns", 1, ["a", "b"], far)
    assert table.add("ns", 2, ["b", "c"], far)  # b is locked twice
    assert not table.add("ns", 3, ["d"], far)  # full
    assert table.remove(["a"]) == []
    assert table.remove(["b"]) == [("ns", 1)]  # the oldest hold of b goes first
    assert table.remove(["b", "x"]) == []
    assert table.remove(["c"]) == [("ns", 2)]
    assert len(table) == 0


def test_lock_table_forgets_expired_leases_when_full() -> None:
    table = LockTable(keys_max=2)
    assert table.add("ns", 1, ["a", "b"], time.monotonic() - 1)  # its lease has ended
    assert table.add("ns", 2, ["a"], time.monotonic() + 60)
    assert table.remove(["a"]) == [("ns", 2)]
    assert table.remove(["b"]) == []
    assert table.drain() == []
