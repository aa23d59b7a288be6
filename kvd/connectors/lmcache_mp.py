"""kvd as an L2 adapter of LMCache's multi-process mode (``lmcache server``).

Matched against LMCache 0.5.6 (PyPI): ``lmcache/v1/distributed/l2_adapters/
base.py`` (``L2AdapterInterface``) and ``plugin_l2_adapter.py`` (the
``"plugin"`` adapter type: it imports ``module_path``, checks that
``class_name`` subclasses ``L2AdapterInterface``, builds ``KvdL2AdapterConfig``
— found as ``class_name + "Config"`` — from ``adapter_params`` and passes it
with ``l1_memory_desc=``). The MP server's ``StorageManager`` drives the
adapter: its ``StoreController`` writes L1 objects with ``submit_store_task``,
its ``PrefetchController`` looks up and locks, loads into the L1 buffers it
reserved and unlocks. ``tests/connectors/test_lmcache_mp.py`` runs LMCache's
own server (``run_cache_server``, its ZMQ transport, the engine-driven
transfer a CPU engine uses) against a real daemon.

Configuration, a flag of ``lmcache server``::

    --l2-adapter '{"type": "plugin", "module_path": "kvd.connectors.lmcache_mp",
                   "class_name": "KvdL2Adapter",
                   "adapter_params": {"url": "kvd:///dev/shm/kvd/grpc.sock"}}'

``adapter_params`` (all optional): ``url``, ``timeout_s``, ``token``, ``tls``,
``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``, ``lease_ms``,
``namespace_salt``, ``kv_format``; an unknown one stops the server's start.

- **Keys.** An ``ObjectKey``'s model, kv rank (world size and rank), object
  group and cache salt — plus ``kv_format`` and ``namespace_salt`` when set —
  form the namespace: another model's, rank's or group's blocks are never
  returned. The chunk hash is the key. Shapes, dtypes and format go in each
  value's ``meta``; a stored value whose size is not the buffer's is a failed
  load, never a hit. Set ``kv_format`` (e.g. ``"bf16"``) when one model is
  served with two KV dtypes of one size: ``ObjectKey`` does not carry it.
- **Lookup and lock** is a kvd ``Lookup`` with a lease per run of keys of one
  namespace: the hits cannot be evicted until unlocked or ``lease_ms`` passes.
  Keys stored after the first miss (CacheBlend and P2P fetch them too) are
  found with one ``Exists`` and leased run by run, at most
  ``RUNS_AFTER_MISS_MAX`` runs. ``submit_unlock`` releases a lease once all
  its keys are unlocked; a key locked twice is unlocked twice.
- **Loads** are ``get_many_into`` straight into the MemoryObjs' buffers, one
  call per ``LOAD_BATCH_BYTES``; **stores** are ``put_many`` from them.
- **Threads.** Lookups and releases, loads, and stores each have a thread
  and a bounded queue; stores and loads use separate clients, so each has the
  client's staging region to itself. A full queue answers at once: a failed
  store, misses, a failed load.
- **Failures.** Every daemon error and deadline (``timeout_s``) becomes a
  failed store, a miss or a failed load, logged at most once per 30 s per
  operation; after a daemon is found down, calls fail at once for 2 s
  (``kvd.connectors.common.Guard``). Nothing raises into LMCache's threads.
  A release the daemon does not get ends with its lease (``lease_ms``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvd.client import Client
from kvd.connectors.common import (
    DEFAULT_LEASE_MS,
    DEFAULT_TIMEOUT_S,
    Guard,
    bytes_key,
    config_value,
    encode_meta,
    load_groups,
    namespace,
    parse_target,
    tls_config,
)
from kvd.connectors.lease_locks import LockTable
from kvd.wire.errors import ResourceExhausted

try:
    from lmcache.lmcache_native import Bitmap  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.distributed.internal_api import L2StoreResult  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.platform import create_event_notifier  # type: ignore[import-untyped,import-not-found,unused-ignore]

    HAVE_LMCACHE = True
except ImportError:  # kvd itself never needs LMCache; the adapter does
    HAVE_LMCACHE = False
    L2AdapterInterface = object
    L2AdapterConfigBase = object

log = logging.getLogger("kvd.connectors")

ENGINE = "lmcache-mp"
PARAMS = (
    "url",
    "timeout_s",
    "token",
    "tls",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "lease_ms",
    "namespace_salt",
    "kv_format",
)
# Tasks waiting per lane. A prefetch submits one lookup and one load per
# adapter, a store one task per L1 write batch: 256 is minutes of backlog on
# a stopped daemon, past which a submit fails at once instead of queueing.
LOOKUP_QUEUE_MAX = 1024
LOAD_QUEUE_MAX = 256
STORE_QUEUE_MAX = 256
# Results LMCache has not collected yet; past it the oldest are dropped.
RESULTS_MAX = 65536
# Runs of stored keys after a chain's first miss that a lookup leases, one
# Lookup each: a chain with holes costs at most this many more calls.
RUNS_AFTER_MISS_MAX = 8
# Keys in one Lookup or Exists: within the max_lookup_keys default of every kvd release.
LOOKUP_KEYS_MAX = 4096
# At close, how long each lane has to finish the task at hand.
CLOSE_GRACE_S = 2.0


class KvdL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """``adapter_params`` of the plugin, checked when the server starts."""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = dict(params or {})
        unknown = sorted(set(self.params) - set(PARAMS))
        if unknown:
            raise ValueError(f"unknown kvd L2 adapter parameter(s) {unknown}; known: {PARAMS}")
        self.url = str(self.params.get("url") or "")
        self.timeout_s = config_value(self.params, "timeout_s", DEFAULT_TIMEOUT_S)
        self.lease_ms = config_value(self.params, "lease_ms", DEFAULT_LEASE_MS)
        self.token = str(self.params.get("token") or "") or None
        self.namespace_salt = config_value(self.params, "namespace_salt", "")
        self.kv_format = config_value(self.params, "kv_format", "")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.lease_ms < 1:
            raise ValueError(f"lease_ms must be at least 1, got {self.lease_ms}")
        parse_target(self.url or None)  # a bad url fails here, at start

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KvdL2AdapterConfig:
        return cls(d)

    @classmethod
    def help(cls) -> str:
        return (
            "kvd L2 adapter (adapter_params, all optional):\n"
            "- url: kvd://host:port, kvd:///path.sock, unix:///path.sock "
            "(default: the daemon's Unix socket when present, else 127.0.0.1:7070)\n"
            f"- timeout_s: deadline of each daemon call (default {DEFAULT_TIMEOUT_S})\n"
            f"- lease_ms: how long a lookup's hits stay locked (default {DEFAULT_LEASE_MS})\n"
            "- token, tls, tls_ca_file, tls_cert_file, tls_key_file: auth and TLS\n"
            "- namespace_salt, kv_format: extra namespace fields"
        )


def object_namespace(key: Any, salt: str = "", kv_format: str = "") -> str:
    """The kvd namespace of an LMCache ``ObjectKey``: everything but its hash."""
    fields: dict[str, object] = {
        "model": key.model_name,
        "kv_rank": key.kv_rank,
        "group": key.object_group_id,
    }
    if key.cache_salt:
        fields["cache_salt"] = key.cache_salt
    if kv_format:
        fields["format"] = kv_format
    if salt:
        fields["salt"] = salt
    return namespace(ENGINE, fields)


def object_meta(obj: Any) -> bytes:
    """A MemoryObj's layout, kept in its value's ``meta``."""
    return encode_meta(
        {
            "v": 1,
            "shapes": [list(map(int, s)) for s in obj.get_shapes()],
            "dtypes": [str(d).removeprefix("torch.") for d in obj.get_dtypes()],
            "fmt": int(obj.get_memory_format().value),
            "bytes": int(obj.get_size()),
        }
    )


class _Lane:
    """One worker thread and its bounded queue of tasks."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.tasks: queue.Queue[Callable[[], None] | None] = queue.Queue(size)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, task: Callable[[], None]) -> bool:
        try:
            self.tasks.put_nowait(task)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while (task := self.tasks.get()) is not None:
            try:
                task()
            except Exception:  # a bug in a task must not end the lane
                log.exception("kvd L2 adapter: task on %s failed", self.name)

    def stop(self, timeout_s: float) -> None:
        while True:  # waiting tasks give way to the stop sentinel
            try:
                self.tasks.put_nowait(None)
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.tasks.get_nowait()
        self.thread.join(timeout_s)


class KvdL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache MP-mode ``L2AdapterInterface`` over a kvd daemon."""

    config_class_name = "KvdL2AdapterConfig"

    def __init__(
        self,
        config: KvdL2AdapterConfig | Mapping[str, Any] | None = None,
        l1_memory_desc: Any = None,
    ) -> None:
        if not HAVE_LMCACHE:
            raise ImportError("the kvd L2 adapter needs lmcache installed")
        if not isinstance(config, KvdL2AdapterConfig):
            config = KvdL2AdapterConfig(config)
        # kvd bounds and evicts its own memory: LMCache's global L2 eviction
        # stays off (capacity 0) and a usage-based policy never deletes here.
        super().__init__(max_capacity_bytes=0)
        self.config = config
        self.target = parse_target(config.url or None)
        self.lease_ms = config.lease_ms
        # The L1 buffer is not a kvd region, so loads and stores go through
        # the client's staging region on the same node (one more copy).
        self.l1_memory_desc = l1_memory_desc
        tls = tls_config(lambda name, default: config.params.get(name) or default)
        self._fetch_client = Client(
            self.target, token=config.token, timeout_s=config.timeout_s, tls=tls
        )
        self._store_client = Client(
            self.target, token=config.token, timeout_s=config.timeout_s, tls=tls
        )
        self.guard = Guard("lmcache-mp")
        self.locks = LockTable()
        self._notifiers = {kind: create_event_notifier() for kind in ("store", "lookup", "load")}
        self._results: dict[str, collections.OrderedDict[int, Any]] = {
            kind: collections.OrderedDict() for kind in self._notifiers
        }
        self._lock = threading.Lock()
        self._next_id = 0
        self._namespaces: dict[tuple[str, int, int, str], str] = {}
        self._closed = False
        self._lookups = _Lane("kvd-l2-lookup", LOOKUP_QUEUE_MAX)
        self._loads = _Lane("kvd-l2-load", LOAD_QUEUE_MAX)
        self._stores = _Lane("kvd-l2-store", STORE_QUEUE_MAX)
        log.info("kvd L2 adapter: target=%s lease_ms=%d", self.target, self.lease_ms)

    def __repr__(self) -> str:
        return f"<KvdL2Adapter {self.target}>"

    # -- event fds -------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._notifiers["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._notifiers["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._notifiers["load"].fileno())

    # -- store -----------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task_id = self._new_id()
        keys, objects = list(keys), list(objects)

        def run() -> None:
            stored = self.guard.call("store", -1, lambda: self._store(keys, objects))
            self._finish("store", task_id, L2StoreResult(stored >= 0, max(stored, 0)))

        self._submit(self._stores, "store", task_id, run, L2StoreResult(False, 0))
        return task_id

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done = dict(self._results["store"])
            self._results["store"].clear()
        return done

    # -- lookup and lock -------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[Any], group_layout_descs: Mapping[int, Any] | None = None
    ) -> int:
        """``group_layout_descs`` is not used: a serde wrapper above this
        adapter stores another layout than the one it describes."""
        task_id = self._new_id()
        keys = list(keys)

        def run() -> None:
            found = Bitmap(len(keys))
            self.guard.call("lookup", None, lambda: self._lookup(keys, found))
            self._finish("lookup", task_id, found)

        self._submit(self._lookups, "lookup", task_id, run, Bitmap(len(keys)))
        return task_id

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._take("lookup", task_id)

    def submit_unlock(self, keys: list[Any]) -> None:
        leases = self.locks.remove(keys)
        if not leases:
            return

        def run() -> None:
            self.guard.call("unlock", None, lambda: self._release(leases))

        if self._closed or not self._lookups.submit(run):
            self.guard.failed("unlock", ResourceExhausted("lookup queue full; leases expire"))

    # -- load ------------------------------------------------------------

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task_id = self._new_id()
        keys, objects = list(keys), list(objects)

        def run() -> None:
            loaded = Bitmap(len(keys))
            self.guard.call("load", None, lambda: self._load(keys, objects, loaded))
            self._finish("load", task_id, loaded)

        self._submit(self._loads, "load", task_id, run, Bitmap(len(keys)))
        return task_id

    def query_load_result(self, task_id: int) -> Any:
        return self._take("load", task_id)

    # -- status and close --------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": not self.guard.down(),
            "type": type(self).__name__,
            "target": self.target,
            "failures": self.guard.failures(),
            "skipped": self.guard.skipped,
            "locked_keys": len(self.locks),
            "queued": {
                lane.name: lane.tasks.qsize() for lane in (self._lookups, self._loads, self._stores)
            },
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lane in (self._lookups, self._loads, self._stores):
            lane.stop(CLOSE_GRACE_S)
        leases = self.locks.drain()
        if leases:  # best effort: a lease the daemon does not hear of expires
            self.guard.call("unlock", None, lambda: self._release(leases))
        self._fetch_client.close()
        self._store_client.close()
        for notifier in self._notifiers.values():
            notifier.close()

    # -- internals -----------------------------------------------------------

    def _new_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _submit(
        self, lane: _Lane, kind: str, task_id: int, run: Callable[[], None], refused: Any
    ) -> None:
        if not self._closed and lane.submit(run):
            return
        self.guard.failed(kind, ResourceExhausted(f"{lane.name} queue full or closed"))
        self._finish(kind, task_id, refused)

    def _finish(self, kind: str, task_id: int, result: Any) -> None:
        with self._lock:
            done = self._results[kind]
            done[task_id] = result
            while len(done) > RESULTS_MAX:
                done.popitem(last=False)
        if not self._closed:
            with contextlib.suppress(OSError):  # closed under a task past its grace
                self._notifiers[kind].notify()

    def _take(self, kind: str, task_id: int) -> Any:
        with self._lock:
            return self._results[kind].pop(task_id, None)

    def _namespace(self, key: Any) -> str:
        fields = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        ns = self._namespaces.get(fields)
        if ns is None:
            ns = object_namespace(key, self.config.namespace_salt, self.config.kv_format)
            if len(self._namespaces) >= 1024:  # models x ranks x groups: small
                self._namespaces.clear()
            self._namespaces[fields] = ns
        return ns

    def _by_namespace(self, keys: Sequence[Any]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._namespace(key), []).append(i)
        return groups

    def _chains(self, keys: Sequence[Any]) -> Iterator[tuple[str, int, int]]:
        """``(namespace, start, end)`` of consecutive keys of one namespace, as
        LMCache lists each row's chunks in order; at most LOOKUP_KEYS_MAX each."""
        start = 0
        while start < len(keys):
            ns = self._namespace(keys[start])
            end = start + 1
            while (
                end < len(keys)
                and end - start < LOOKUP_KEYS_MAX
                and self._namespace(keys[end]) == ns
            ):
                end += 1
            yield ns, start, end
            start = end

    def _store(self, keys: Sequence[Any], objects: Sequence[Any]) -> int:
        """Bytes newly stored; raises on the first failed batch."""
        stored, new_keys, sizes = 0, [], []
        metas: dict[tuple[Any, ...], bytes] = {}
        try:
            for ns, idxs in self._by_namespace(keys).items():
                for start, end in load_groups([objects[i].get_size() for i in idxs]):
                    items = []
                    for i in idxs[start:end]:
                        obj = objects[i]
                        layout = (
                            tuple(map(tuple, obj.get_shapes())),
                            tuple(obj.get_dtypes()),
                            obj.get_memory_format(),
                            obj.get_size(),
                        )
                        if layout not in metas:
                            metas[layout] = object_meta(obj)
                        items.append((bytes_key(keys[i].chunk_hash), obj.byte_array, metas[layout]))
                    existed = self._store_client.put_many(ns, items)
                    for i, was in zip(idxs[start:end], existed, strict=True):
                        if not was:
                            size = int(objects[i].get_size())
                            stored += size
                            new_keys.append(keys[i])
                            sizes.append(size)
        finally:
            if new_keys:
                self._notify_keys_stored(new_keys, sizes)
        return stored

    def _lookup(self, keys: Sequence[Any], found: Any) -> None:
        """Lease the stored keys and set their bits; a failure keeps what was leased."""
        try:
            for ns, start, end in self._chains(keys):
                self._lookup_chain(ns, keys, start, end, found)
        except Exception as exc:
            self.guard.failed("lookup", exc)

    def _lookup_chain(self, ns: str, keys: Sequence[Any], start: int, end: int, found: Any) -> None:
        kvd_keys = [bytes_key(keys[i].chunk_hash) for i in range(start, end)]
        hits = self._lease(ns, keys, kvd_keys, start, 0, len(kvd_keys), found)
        after = hits + 1  # kvd_keys[hits] is the first miss
        if after >= len(kvd_keys):
            return
        present = self._fetch_client.exists(ns, kvd_keys[after:])
        runs = 0
        i = 0
        while i < len(present) and runs < RUNS_AFTER_MISS_MAX:
            if not present[i]:
                i += 1
                continue
            j = i
            while j < len(present) and present[j]:
                j += 1
            self._lease(ns, keys, kvd_keys, start, after + i, after + j, found)
            runs += 1
            i = j

    def _lease(
        self,
        ns: str,
        keys: Sequence[Any],
        kvd_keys: Sequence[bytes],
        base: int,
        lo: int,
        hi: int,
        found: Any,
    ) -> int:
        """Look up ``kvd_keys[lo:hi]`` with a lease; set and record the hits."""
        result = self._fetch_client.lookup_ex(ns, kvd_keys[lo:hi], self.lease_ms)
        hits = int(result.prefix_len)
        if not hits:
            return 0
        locked = [keys[base + i] for i in range(lo, lo + hits)]
        expires_s = time.monotonic() + self.lease_ms / 1000
        if not self.locks.add(ns, result.lease_id, locked, expires_s):
            self._fetch_client.release(ns, result.lease_id)
            raise ResourceExhausted(f"{self.locks.keys_max} keys are locked already")
        found.set_range(base + lo, base + lo + hits)
        return hits

    def _release(self, leases: Sequence[tuple[str, int]]) -> None:
        for ns, lease_id in leases:
            self._fetch_client.release(ns, lease_id)

    def _load(self, keys: Sequence[Any], objects: Sequence[Any], loaded: Any) -> None:
        accessed: list[Any] = []
        try:
            for ns, idxs in self._by_namespace(keys).items():
                for start, end in load_groups([objects[i].get_size() for i in idxs]):
                    part = idxs[start:end]
                    views = [objects[i].byte_array for i in part]
                    kvd_keys = [bytes_key(keys[i].chunk_hash) for i in part]
                    sizes = self._fetch_client.get_many_into(ns, kvd_keys, views)
                    for i, view, size in zip(part, views, sizes, strict=True):
                        if size is None:
                            continue
                        if size != len(view):
                            self.guard.failed(
                                "load", ValueError(f"{size} bytes stored, {len(view)} expected")
                            )
                            continue
                        loaded.set(i)
                        accessed.append(keys[i])
        finally:
            if accessed:
                self._notify_keys_accessed(accessed)
