"""A real vLLM engine driven over a pipe, for tests and ``kvd bench engine``.

Runs in the engine's own environment (vLLM's CPU build, torch), never in
kvd's: ``python -m kvd.tools.bench.vllm_engine --model DIR [--kvd URL]`` starts
vLLM's offline ``LLM`` once (~40 s on 2 CPUs), with kvd's connector when
``--kvd`` is given, then answers one JSON request per line on stdin with one
JSON line on the protocol pipe (the process's original stdout; vLLM's own
output, its engine-core child's included, goes to stderr):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 16, "logprobs": 5}
      -> {"outputs": [{"tokens": [...], "logprobs": [[[id, lp], ...], ...],
                       "finish_reason": "length"}, ...], "wall_s": 1.2}
    {"op": "reset_prefix_cache"} -> {"reset": true}
    {"op": "events"} -> {"events": [{"type": "BlockStored", "block_hashes": [hex...],
                         "parent": hex or null, "tokens": 256, "medium": "CPU"}, ...]}
    {"op": "quit"} -> {"bye": true}

``--kv-events`` turns on vLLM's KV-cache events, published over ZeroMQ on
an ipc socket in that directory; the driver subscribes to them, and the
``events`` op returns those received so far.

A request with ``max_tokens`` 1 measures time to first token: offline, the
wall time of a one-token generation is the prefill plus one sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

# vLLM's CPU backend: a bounded KV space (GiB) and one core left to the
# rest of the process, so 2-CPU machines give comparable timings.
ENGINE_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}
BLOCK_TOKENS = 128
# SmolLM2-135M takes 8,192 positions; a 4,096-token prompt needs room for its output.
MAX_MODEL_LEN = 8192


def kv_transfer_config(url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads kvd's connector."""
    return {
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": url, **extra},
    }


def _engine(args: argparse.Namespace) -> Any:
    from vllm import LLM  # type: ignore[import-not-found,unused-ignore]

    options: dict[str, Any] = {
        "model": args.model,
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "block_size": args.block_size,
        "enable_prefix_caching": args.prefix_caching,
        "dtype": args.dtype,
        "seed": 0,
    }
    if args.kvd:
        options["kv_transfer_config"] = kv_transfer_config(args.kvd, json.loads(args.extra))
    elif args.kv_transfer_config:  # another connector, e.g. vLLM's own OffloadingConnector
        options["kv_transfer_config"] = json.loads(args.kv_transfer_config)
    if args.load_failure_policy and "kv_transfer_config" in options:
        options["kv_transfer_config"]["kv_load_failure_policy"] = args.load_failure_policy
    if args.kv_events:
        options["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": _events_endpoint(args.kv_events),
        }
    return LLM(**options)


def _events_endpoint(directory: str) -> str:
    return f"ipc://{os.path.join(directory, 'kv-events.sock')}"


class EventListener:
    """vLLM's KV-cache events, as its ZeroMQ publisher sends them."""

    def __init__(self, directory: str) -> None:
        import zmq  # type: ignore[import-not-found,unused-ignore]

        self._zmq = zmq
        self._socket: Any = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(_events_endpoint(directory))
        self.received: list[dict[str, Any]] = []

    def drain(self, wait_s: float = 1.0) -> list[dict[str, Any]]:
        """Events received until ``wait_s`` passes without one."""
        import msgspec  # type: ignore[import-not-found,unused-ignore]
        from vllm.distributed.kv_events import (  # type: ignore[import-not-found,unused-ignore]
            KVEventBatch,
        )

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while self._socket.poll(int(wait_s * 1000)):
            _topic, _seq, payload = self._socket.recv_multipart()
            for event in decoder.decode(payload).events:
                self.received.append(_event_json(event))
        received, self.received = self.received, []
        return received


def _event_json(event: Any) -> dict[str, Any]:
    def hexed(value: Any) -> Any:
        return value.hex() if isinstance(value, bytes) else value

    return {
        "type": type(event).__name__,
        "block_hashes": [hexed(h) for h in getattr(event, "block_hashes", [])],
        "parent": hexed(getattr(event, "parent_block_hash", None)),
        "tokens": len(getattr(event, "token_ids", []) or []),
        "medium": getattr(event, "medium", None),
    }


def _generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # type: ignore[import-not-found,unused-ignore]

    top = int(request.get("logprobs", 0))
    params = SamplingParams(
        max_tokens=int(request.get("max_tokens", 1)),
        temperature=0.0,
        logprobs=top or None,
    )
    prompts = [{"prompt_token_ids": list(ids)} for ids in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    outputs = []
    for result in results:
        completion = result.outputs[0]
        logprobs = []
        for step in completion.logprobs or []:
            ranked = sorted(step.items(), key=lambda kv: kv[1].rank)[:top]
            logprobs.append([[int(token), float(lp.logprob)] for token, lp in ranked])
        outputs.append(
            {
                "tokens": [int(t) for t in completion.token_ids],
                "logprobs": logprobs,
                "finish_reason": str(completion.finish_reason),
                "text": completion.text,
            }
        )
    return {"outputs": outputs, "wall_s": wall_s}


def serve(llm: Any, requests: TextIO, answers: TextIO, events: EventListener | None = None) -> None:
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        answer: dict[str, Any]
        if op == "quit":
            answer = {"bye": True}
        elif op == "reset_prefix_cache":  # the engine's own cache only, not a connector's
            answer = {"reset": bool(llm.reset_prefix_cache())}
        elif op == "events":
            answer = {"events": events.drain() if events is not None else []}
        elif op == "generate":
            try:
                answer = _generate(llm, request)
            except Exception as exc:  # the test reads the failure; the engine stays up
                answer = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            answer = {"error": f"unknown op {op!r}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
        if op == "quit":
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--kvd", default="", help="kvd URL for the connector; empty: none")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    parser.add_argument("--kv-transfer-config", default="", help="another connector's (JSON)")
    parser.add_argument(
        "--load-failure-policy", default="", help="vLLM's kv_load_failure_policy; empty: its own"
    )
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache")
    parser.add_argument("--block-size", type=int, default=BLOCK_TOKENS)
    parser.add_argument("--kv-events", default="", help="a directory: publish KV-cache events")
    # float32: bf16 matmuls have no fast kernel on CPUs without AVX-512 BF16
    # (a 2K-token prefill took 60-80 s in bf16 against 16 s in fp32 on an
    # AVX2-only EPYC).
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    for name, value in ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # The protocol keeps the original stdout; everything else prints to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = _engine(args)
    events = EventListener(args.kv_events) if args.kv_events else None
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    serve(llm, sys.stdin, answers, events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
