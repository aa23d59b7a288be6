"""kvd as an LMCache remote storage plugin.

Matched against LMCache 0.5.6 (PyPI, the current release):
``lmcache/v1/storage_backend/connector/__init__.py`` (``ConnectorAdapter``,
``ConnectorContext``, the ``remote_storage_plugins`` loader) and
``connector/base_connector.py`` (``RemoteConnector``).

LMCache configuration::

    remote_storage_plugins: ["kvd"]
    extra_config:
      remote_storage_plugin.kvd.module_path: kvd.connectors.lmcache
      remote_storage_plugin.kvd.class_name: KvdConnectorAdapter
      remote_storage_plugin.kvd.url: kvd://127.0.0.1:7070    # optional
      remote_storage_plugin.kvd.timeout_s: 2.0               # optional
      remote_storage_plugin.kvd.lease_ms: 10000              # optional

The adapter answers both ``plugin://kvd`` (what LMCache's RemoteBackend asks
for) and ``kvd://host:port`` (a legacy ``remote_url``). ``class_name:
KvdRemoteConnector`` works too (LMCache then wraps it itself and the address
comes from ``remote_storage_plugin.kvd.url``).

Keys: ``CacheEngineKey.to_string()`` is ``model@world_size@worker_id@hash@dtype``
(``@layer`` for layer keys, ``@tag%value`` for tags). Every field but the hash
(and layer) goes into the namespace, so blocks of another model, rank, world
size, dtype or tag set never meet; the hash (and layer) is the key. The
MemoryObj's shapes, dtypes and format travel in the value's ``meta``; a value
whose meta does not parse is a miss.

Every daemon error and deadline is a miss (``None``, ``False``, ``0``, an
empty prefix); nothing raises into LMCache.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvd.client import Client
from kvd.connectors.common import (
    DEFAULT_LEASE_MS,
    DEFAULT_TIMEOUT_S,
    Guard,
    config_value,
    decode_meta,
    encode_meta,
    get_many_with_meta,
    get_with_meta,
    namespace,
    parse_target,
    text_key,
    tls_config,
)

try:
    import torch  # type: ignore[import-not-found,unused-ignore]
    from lmcache.v1.memory_management import MemoryFormat  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.storage_backend.connector import ConnectorAdapter  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector  # type: ignore[import-untyped,import-not-found,unused-ignore]

    HAVE_LMCACHE = True
except ImportError:  # kvd itself never needs LMCache; the plugin does
    HAVE_LMCACHE = False
    ConnectorAdapter = object
    RemoteConnector = object

T = TypeVar("T")

PLUGIN_NAME = "kvd"
ENGINE = "lmcache"
# Daemon calls run on these threads, off LMCache's event loop; 8 keeps a
# prefetch of a few dozen chunks in flight without oversubscribing the host.
IO_THREADS = 8
# Leases taken by batched_async_contains, waiting for their batched get.
# Bounded: a lookup whose get never comes lets its lease expire on the daemon.
PENDING_LEASES_MAX = 4096
_SIGNATURE_FIELDS = ("model", "world_size", "worker_id")

# Aliases: inside the connector class ``list`` names RemoteConnector.list.
AnyList = list[Any]
Leases = list[tuple[str, int]]


def split_key_string(key_string: str) -> tuple[dict[str, str], str]:
    """(namespace fields, block id) of a ``CacheEngineKey.to_string()``."""
    parts = key_string.split("@")
    if len(parts) < 5:
        raise ValueError(f"not an LMCache key: {key_string!r}")
    fields = dict(zip(_SIGNATURE_FIELDS, parts[:3], strict=True))
    fields["dtype"] = parts[4]
    block = parts[3]
    tags = []
    for extra in parts[5:]:
        if "%" in extra:
            tags.append(extra)
        elif extra.isdigit():
            block = f"{block}@{extra}"  # LayerCacheEngineKey: one block per layer
        else:
            raise ValueError(f"not an LMCache key: {key_string!r}")
    if tags:
        fields["tags"] = "@".join(tags)
    return fields, block


def kvd_address(key_string: str, salt: str = "") -> tuple[str, bytes]:
    """The (namespace, key) that one LMCache key maps to."""
    fields, block = split_key_string(key_string)
    if salt:
        fields["salt"] = salt
    return namespace(ENGINE, fields), text_key(block)


def memory_meta(shapes: Sequence[Any], dtypes: Sequence[Any], fmt: int, size: int) -> bytes:
    return encode_meta(
        {
            "v": 1,
            "shapes": [list(map(int, s)) for s in shapes],
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "fmt": int(fmt),
            "bytes": size,
        }
    )


def parse_memory_meta(blob: bytes) -> tuple[list[list[int]], list[str], int, int] | None:
    meta = decode_meta(blob)
    if meta is None or meta.get("v") != 1:
        return None
    try:
        shapes = [[int(x) for x in s] for s in meta["shapes"]]
        dtypes = [str(d) for d in meta["dtypes"]]
        return shapes, dtypes, int(meta["fmt"]), int(meta["bytes"])
    except (KeyError, TypeError, ValueError):
        return None


def _torch_dtype(name: str) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _extra(config: Any, plugin_name: str, name: str, default: T) -> T:
    extra = getattr(config, "extra_config", None) or {}
    scoped = extra.get(f"remote_storage_plugin.{plugin_name}.{name}")
    if scoped is not None:
        return config_value({name: scoped}, name, default)
    return default


class KvdRemoteConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache ``RemoteConnector`` over a kvd daemon."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any = None,
        plugin_name: str = PLUGIN_NAME,
        url: str | None = None,
    ) -> None:
        if not HAVE_LMCACHE:
            raise ImportError("the kvd LMCache plugin needs lmcache installed")
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is not None:
            super().__init__(config, metadata)
        else:  # scheduler role without metadata: lookups only
            self.save_chunk_meta = True
            self.meta_shapes: AnyList = []
            self.meta_dtypes: AnyList = []
            self.meta_fmt = MemoryFormat.KV_2LTD
            self.full_chunk_size_bytes, self.single_token_size = 0, 0
        if url is None:
            url = _extra(config, plugin_name, "url", "")
            remote_url = getattr(config, "remote_url", None) or ""
            if not url and remote_url.startswith("kvd://"):
                url = remote_url
        self.target = parse_target(url or None)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.salt = _extra(config, plugin_name, "namespace_salt", "")
        self.lease_ms = _extra(config, plugin_name, "lease_ms", DEFAULT_LEASE_MS)
        timeout_s = _extra(config, plugin_name, "timeout_s", DEFAULT_TIMEOUT_S)
        token = _extra(config, plugin_name, "token", "") or None
        tls = tls_config(lambda name, default: _extra(config, plugin_name, name, default))
        self.client = Client(self.target, token=token, timeout_s=timeout_s, tls=tls)
        self.guard = Guard(f"lmcache[{plugin_name}]")
        self._executor = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvd-lmcache")
        self._leases: collections.OrderedDict[str, Leases] = collections.OrderedDict()
        self._leases_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<KvdRemoteConnector {self.target}>"

    # -- helpers ---------------------------------------------------------

    def _address(self, key: Any) -> tuple[str, bytes]:
        return kvd_address(key.to_string(), self.salt)

    async def _run(self, op: str, default: T, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self.guard.call, op, default, fn
            )
        except Exception as exc:  # executor shut down, loop closing
            self.guard.failed(op, exc)
            return default

    def _groups(self, keys: Sequence[Any]) -> list[tuple[str, list[bytes]]]:
        """Consecutive runs of keys that share a namespace, in order."""
        runs: list[tuple[str, list[bytes]]] = []
        for key in keys:
            ns, kvd_key = self._address(key)
            if runs and runs[-1][0] == ns:
                runs[-1][1].append(kvd_key)
            else:
                runs.append((ns, [kvd_key]))
        return runs

    def _to_memory_obj(self, value: bytes, meta_blob: bytes) -> Any:
        """A MemoryObj from LMCache's allocator holding ``value``, or None."""
        parsed = parse_memory_meta(meta_blob)
        if parsed is None:
            return None
        shape_lists, dtype_names, fmt, size = parsed
        if size != len(value):
            return None
        shapes = [torch.Size(s) for s in shape_lists]
        dtypes = [_torch_dtype(d) for d in dtype_names]
        memory_obj = self.local_cpu_backend.allocate(shapes, dtypes, MemoryFormat(fmt))
        if memory_obj is None:
            return None  # LMCache's buffer is full: a miss, LMCache retries later
        try:
            buffer = memoryview(memory_obj.byte_array).cast("B")
            if len(buffer) < len(value):
                raise ValueError(f"buffer of {len(buffer)} bytes for a {len(value)}-byte value")
            buffer[: len(value)] = value
            if len(value) < len(buffer):
                memory_obj = self.reshape_partial_chunk(memory_obj, len(value))
            return memory_obj
        except Exception:
            memory_obj.ref_count_down()
            raise

    def _get_sync(self, key: Any) -> Any:
        ns, kvd_key = self._address(key)
        found = get_with_meta(self.client, ns, kvd_key)
        return None if found is None else self._to_memory_obj(*found)

    def _get_many_sync(self, keys: Sequence[Any], stop_at_miss: bool) -> AnyList:
        out: AnyList = []
        try:
            for ns, kvd_keys in self._groups(keys):
                for found in get_many_with_meta(self.client, ns, kvd_keys):
                    memory_obj = None if found is None else self._to_memory_obj(*found)
                    if memory_obj is None and stop_at_miss:
                        return out
                    out.append(memory_obj)
        except Exception:
            for memory_obj in out:
                if memory_obj is not None:
                    memory_obj.ref_count_down()
            raise
        return out

    def _put_sync(self, keys: Sequence[Any], memory_objs: Sequence[Any]) -> None:
        by_ns: dict[str, list[tuple[bytes, memoryview, bytes]]] = {}
        for key, memory_obj in zip(keys, memory_objs, strict=True):
            ns, kvd_key = self._address(key)
            value = memoryview(memory_obj.byte_array).cast("B")
            meta = memory_meta(
                memory_obj.get_shapes(),
                memory_obj.get_dtypes(),
                memory_obj.get_memory_format().value,
                len(value),
            )
            by_ns.setdefault(ns, []).append((kvd_key, value, meta))
        for ns, items in by_ns.items():
            self.client.put_many(ns, items)

    def _prefix_sync(self, keys: Sequence[Any], lease_ms: int) -> tuple[int, Leases]:
        hits, leases = 0, Leases()
        for ns, kvd_keys in self._groups(keys):
            result = self.client.lookup_ex(ns, kvd_keys, lease_ms)
            if result.lease_id:
                leases.append((ns, result.lease_id))
            hits += result.prefix_len
            if result.prefix_len < len(kvd_keys):
                break
        return hits, leases

    def _release_sync(self, leases: Leases) -> None:
        for ns, lease_id in leases:
            self.client.release(ns, lease_id)

    def _remember_leases(self, lookup_id: str, leases: Leases) -> None:
        if not leases:
            return
        with self._leases_lock:
            self._leases.setdefault(lookup_id, []).extend(leases)
            while len(self._leases) > PENDING_LEASES_MAX:
                self._leases.popitem(last=False)  # its lease expires on the daemon

    def _take_leases(self, lookup_id: str) -> Leases:
        with self._leases_lock:
            return self._leases.pop(lookup_id, [])

    # -- RemoteConnector ---------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return await self._run("exists", False, lambda: self.exists_sync_raw(key))

    def exists_sync_raw(self, key: Any) -> bool:
        ns, kvd_key = self._address(key)
        return bool(self.client.exists(ns, [kvd_key])[0])

    def exists_sync(self, key: Any) -> bool:
        return self.guard.call("exists", False, lambda: self.exists_sync_raw(key))

    async def get(self, key: Any) -> Any:
        return await self._run("get", None, lambda: self._get_sync(key))

    async def put(self, key: Any, memory_obj: Any) -> None:
        # LMCache's InstrumentedRemoteConnector owns memory_obj's reference.
        await self._run("put", None, lambda: self._put_sync([key], [memory_obj]))

    async def list(self) -> builtins.list[str]:
        """kvd keeps keys as opaque bytes and offers no listing: always empty."""
        return []

    async def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        ok = await self._run("ping", False, lambda: bool(self.client.stats() is not None))
        return 0 if ok else 1

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: AnyList) -> AnyList:
        got: AnyList = await self._run("batched_get", [], lambda: self._get_many_sync(keys, False))
        return got if len(got) == len(keys) else [None] * len(keys)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: AnyList, memory_objs: AnyList) -> None:
        await self._run("batched_put", None, lambda: self._put_sync(keys, memory_objs))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: AnyList) -> int:
        """Longest stored prefix of ``keys``, in one Lookup per namespace run."""
        return self.guard.call("batched_contains", 0, lambda: self._prefix_sync(keys, 0)[0])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: AnyList, pin: bool = False) -> int:
        """Longest stored prefix; with ``pin`` the hits are leased until fetched."""
        lease_ms = self.lease_ms if pin else 0
        no_hits: tuple[int, Leases] = (0, [])
        hits, leases = await self._run(
            "batched_async_contains", no_hits, lambda: self._prefix_sync(keys, lease_ms)
        )
        self._remember_leases(lookup_id, leases)
        return hits

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: AnyList) -> AnyList:
        """The leading run of ``keys`` that loaded; the lookup's leases are released."""
        got: AnyList = await self._run(
            "batched_get_non_blocking", [], lambda: self._get_many_sync(keys, True)
        )
        leases = self._take_leases(lookup_id)
        if leases:
            await self._run("release", None, lambda: self._release_sync(leases))
        return got

    def remove_sync(self, key: Any) -> bool:
        ns, kvd_key = self._address(key)
        return self.guard.call("remove", False, lambda: self.client.delete(ns, [kvd_key]) > 0)


class KvdConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """What ``remote_storage_plugin.kvd.class_name`` names: builds ``KvdRemoteConnector``."""

    def __init__(self) -> None:
        if not HAVE_LMCACHE:
            raise ImportError("the kvd LMCache plugin needs lmcache installed")
        super().__init__("kvd://")

    def can_parse(self, url: str) -> bool:
        if url.startswith("kvd://"):
            return True
        if url.startswith("plugin://"):
            return url[len("plugin://") :].split(".", 1)[0] == PLUGIN_NAME
        return False

    def create_connector(self, context: Any) -> Any:
        url: str | None = context.url
        plugin_name = getattr(context, "plugin_name", None) or PLUGIN_NAME
        if url is not None and url.startswith("plugin://"):
            plugin_name = url[len("plugin://") :] or plugin_name
            url = None
        return KvdRemoteConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=plugin_name,
            url=url,
        )
