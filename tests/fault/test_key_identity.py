"""Key identity: the same tokens under a different model, revision, dtype,
TP rank, LoRA or salt must never meet another variant's blocks, and every
process computes the same keys whatever its ``PYTHONHASHSEED``.

For each connector the test builds the (namespace, key) addresses of one
token sequence through the connector's own builders, once per variant,
stores the base variant's blocks in a real daemon and asks for every other
variant's: 0 cross hits. LoRA "X" and salt "X" are two variants, and so are
names that try to fake the separator between fields.

What each engine's key carries decides what a connector can separate:
LMCache's key string has the model, world size, worker (rank), KV dtype and
tags (LoRA rides in a tag) but no revision; SGLang hands the backend page
hashes and a config without dtype or revision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvd.client import Client
from kvd.connectors.lmcache import kvd_address
from kvd.connectors.sglang import page_hashes, storage_namespace
from kvd.connectors.vllm import KvdConnector, block_keys
from tests.support import REPO, DaemonProcess

pytestmark = pytest.mark.fault

TOKENS = list(range(1000, 1064))
BLOCK = 16
Address = tuple[str, bytes]


# ---- vLLM ---------------------------------------------------------------------------
def vllm_addresses(
    model: str = "Qwen/Qwen3-0.6B",
    revision: str | None = None,
    dtype: str = "float16",
    cache_dtype: str = "auto",
    tp_rank: int = 0,
    lora: str = "",
    salt: str = "",
    namespace_salt: str = "",
) -> list[Address]:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
            "url": "kvd://127.0.0.1:1", "tp_rank": tp_rank, "namespace_salt": namespace_salt,
        }),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype=cache_dtype),
        model_config=SimpleNamespace(model=model, revision=revision, dtype=dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
    )  # fmt: skip
    connector = KvdConnector(config, "WORKER")
    try:
        return [(connector.namespace, k) for k in block_keys(TOKENS, BLOCK, lora, salt)]
    finally:
        connector.shutdown()


VLLM_VARIANTS: dict[str, Callable[[], list[Address]]] = {
    "model": lambda: vllm_addresses(model="Qwen/Qwen3-1.7B"),
    "revision": lambda: vllm_addresses(revision="abc123"),
    "dtype": lambda: vllm_addresses(dtype="bfloat16"),
    "kv_dtype": lambda: vllm_addresses(cache_dtype="fp8_e4m3"),
    "tp_rank": lambda: vllm_addresses(tp_rank=1),
    "lora X": lambda: vllm_addresses(lora="X"),
    "salt X": lambda: vllm_addresses(salt="X"),
    "namespace salt X": lambda: vllm_addresses(namespace_salt="X"),
    # Names that carry the other field's separator must not fake it.
    "lora with separator": lambda: vllm_addresses(lora="a\0salt=b"),
    "salt with separator": lambda: vllm_addresses(lora="a", salt="b\0salt="),
}


# ---- LMCache ------------------------------------------------------------------------
def lmcache_addresses(
    model: str = "Qwen/Qwen3-0.6B",
    world_size: int = 2,
    worker: int = 0,
    dtype: str = "half",
    tags: str = "",
    salt: str = "",
) -> list[Address]:
    # LMCache's CacheEngineKey.to_string(): model@world_size@worker_id@chunk_hash@dtype[@tags]
    out = []
    for chunk_hash in page_hashes(TOKENS, BLOCK):  # any chained digest serves as chunk hash
        text = f"{model}@{world_size}@{worker}@{chunk_hash[:16]}@{dtype}" + (
            f"@{tags}" if tags else ""
        )
        out.append(kvd_address(text, salt))
    return out


LMCACHE_VARIANTS: dict[str, Callable[[], list[Address]]] = {
    "model": lambda: lmcache_addresses(model="Qwen/Qwen3-1.7B"),
    "revision (in the model name)": lambda: lmcache_addresses(model="Qwen/Qwen3-0.6B:abc123"),
    "dtype": lambda: lmcache_addresses(dtype="bfloat16"),
    "tp_rank": lambda: lmcache_addresses(worker=1),
    "world_size": lambda: lmcache_addresses(world_size=4),
    "lora X (tag)": lambda: lmcache_addresses(tags="lora_id%X"),
    "salt X": lambda: lmcache_addresses(salt="X"),
    "tag that looks like a salt": lambda: lmcache_addresses(tags="salt%X"),
}


# ---- SGLang -------------------------------------------------------------------------
def sglang_addresses(
    model: str = "Qwen/Qwen3-0.6B", tp_rank: int = 0, salt: str = "", **fields: Any
) -> list[Address]:
    from kvd.connectors.common import text_key

    config = SimpleNamespace(
        model_name=model, tp_rank=tp_rank, tp_size=2, is_mla_model=False,
        is_page_first_layout=True, **fields,
    )  # fmt: skip
    namespace = storage_namespace(config, salt)
    return [(namespace, text_key(h)) for h in page_hashes(TOKENS, BLOCK)]


SGLANG_VARIANTS: dict[str, Callable[[], list[Address]]] = {
    "model": lambda: sglang_addresses(model="Qwen/Qwen3-1.7B"),
    "revision (in the model path)": lambda: sglang_addresses(model="/models/qwen3@abc123"),
    "tp_rank": lambda: sglang_addresses(tp_rank=1),
    "salt X": lambda: sglang_addresses(salt="X"),
    "pp_rank": lambda: sglang_addresses(pp_rank=1, pp_size=2),
}

CONNECTORS: dict[str, tuple[Callable[[], list[Address]], dict[str, Any]]] = {
    "vllm": (vllm_addresses, VLLM_VARIANTS),
    "lmcache": (lmcache_addresses, LMCACHE_VARIANTS),
    "sglang": (sglang_addresses, SGLANG_VARIANTS),
}


def test_every_variant_has_its_own_addresses() -> None:
    """Pairwise: no two variants (base included) of one connector share an address."""
    for name, (base, variants) in CONNECTORS.items():
        seen: dict[Address, str] = {a: "base" for a in base()}
        assert len(seen) == len(TOKENS) // BLOCK
        for variant, build in variants.items():
            addresses = build()
            assert len(set(addresses)) == len(addresses)
            for address in addresses:
                assert address not in seen, f"{name}: {variant} meets {seen[address]}"
                seen[address] = variant


def test_zero_cross_hits_in_a_daemon(shared_daemon: DaemonProcess) -> None:
    """Base blocks stored; every other variant looks up and gets its own blocks only."""
    cross_hits = 0
    with Client(shared_daemon.target, timeout_s=10) as client:
        for name, (base, variants) in CONNECTORS.items():
            for ns, key in base():
                client.put(ns, key, f"{name}/base".encode() + key)
            for variant, build in variants.items():
                addresses = build()
                by_ns: dict[str, list[bytes]] = {}
                for ns, key in addresses:
                    by_ns.setdefault(ns, []).append(key)
                for ns, keys in by_ns.items():
                    cross_hits += sum(client.exists(ns, keys))
                    cross_hits += client.lookup(ns, keys)
                    cross_hits += sum(v is not None for v in client.get_many(ns, keys))
                # The variant's own blocks go in too, so later variants meet them if they collide.
                for ns, key in addresses:
                    client.put(ns, key, f"{name}/{variant}".encode() + key)
    assert cross_hits == 0


def test_sglang_kv_dtype_separates() -> None:
    from kvd.connectors.sglang import KvdHiCacheStorage

    def addresses(dtype: str) -> list[Address]:
        config = SimpleNamespace(
            model_name="m", tp_rank=0, tp_size=1, is_mla_model=False,
            is_page_first_layout=True, extra_config={"url": "kvd://127.0.0.1:1"},
        )  # fmt: skip
        backend = KvdHiCacheStorage(config, {})
        try:
            backend.register_mem_pool_host(SimpleNamespace(dtype=dtype, page_size=BLOCK))
            return [(backend.namespace, h.encode()) for h in page_hashes(TOKENS, BLOCK)]
        finally:
            backend.close()

    assert not set(addresses("torch.float16")) & set(addresses("torch.bfloat16"))


# ---- PYTHONHASHSEED -----------------------------------------------------------------------
_KEYS_SCRIPT = """
import json, sys
from types import SimpleNamespace
from kvd.connectors.common import int_key, namespace, text_key
from kvd.connectors.lmcache import kvd_address
from kvd.connectors.sglang import page_hashes, storage_namespace
from kvd.connectors.vllm import block_keys
from kvd.client.keys import chain_keys
tokens = list(range(1000, 1064))
out = {
    "chain": [k.hex() for k in chain_keys(tokens, 16, extra=b"x")],
    "vllm": [k.hex() for k in block_keys(tokens, 16, "lora", "salt")],
    "sglang": page_hashes(tokens, 16),
    "sglang_ns": storage_namespace(SimpleNamespace(
        model_name="m", tp_rank=1, tp_size=2, is_mla_model=False, pp_size=2, pp_rank=1,
        is_page_first_layout=True), "salt"),
    "lmcache": [[ns, k.hex()] for ns, k in
                [kvd_address("m@2@1@abcdef@half@lora_id%X@7", "s")]],
    "namespace": namespace("e", {"b": 1, "a": "x/y", "c": None}),
    "int_key": [int_key(v).hex() for v in (0, -1, 2**200, -(2**63))],
    "text_key": [text_key(v).hex() for v in ("ab", "zz", "x" * 100)],
}
json.dump(out, sys.stdout, sort_keys=True)
"""


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    """Two client processes with different hash seeds, run side by side."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _KEYS_SCRIPT],
            cwd=REPO,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONHASHSEED": seed},
            text=True,
        )
        for seed in ("1", "4242")
    ]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        outputs.append(json.loads(out))
    assert outputs[0] == outputs[1], "keys differ between processes"
