"""Prefill rate of the end-to-end test's real model, for the replay's TTFT model.

``kvd bench replay`` turns saved prefill tokens into time with a prefill
rate. When the end-to-end test's model is installed (``make e2e-deps``:
SmolLM2-135M-Instruct, fp32, on this machine's CPU) the rate is measured
here: one forward pass over a ``PROMPT_TOKENS``-token chat, best of
``REPEATS`` after a warm-up. Without it, the caller's parameter is used.

The rate is measured at one prompt length. Attention makes longer prompts
slower per token, and the trace's prompts average ~12,000 tokens, so the
modeled TTFT without kvd is a lower bound, and so is the saving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

PROMPT_TOKENS = 2048
WARMUP_TOKENS = 128
REPEATS = 3


@dataclass(frozen=True)
class PrefillRate:
    tokens_per_s: float
    source: str  # how it was obtained, for the report


def measure(prompt_tokens: int = PROMPT_TOKENS) -> PrefillRate | None:
    """Tokens/s of one prefill on the real model; None when it is not installed."""
    from kvd.tools import demo

    try:
        model, tokenizer = demo.load_model()
    except (ImportError, OSError):
        return None
    import torch  # type: ignore[import-not-found,unused-ignore]

    ids = demo.conversation(tokenizer, prompt_tokens)[:prompt_tokens]
    best_s = float("inf")
    with torch.inference_mode():
        _forward(model, torch, ids[:WARMUP_TOKENS])
        for _ in range(REPEATS):
            start = time.perf_counter()
            _forward(model, torch, ids)
            best_s = min(best_s, time.perf_counter() - start)
    threads = torch.get_num_threads()
    return PrefillRate(
        len(ids) / best_s,
        f"measured: {demo.MODEL_FILE}, fp32, CPU ({threads} threads), {len(ids)}-token prompt",
    )


def _forward(model: Any, torch: Any, ids: list[int]) -> None:
    model(input_ids=torch.tensor([ids]), use_cache=True)


def resolve(tokens_per_s: float, fallback: float) -> PrefillRate:
    """The given rate when set (> 0); else a measured one; else ``fallback``."""
    if tokens_per_s > 0:
        return PrefillRate(tokens_per_s, "parameter")
    measured = measure()
    if measured is not None:
        return measured
    return PrefillRate(fallback, "default (the real model is not installed: make e2e-deps)")
