"""`torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert` (CUDA only; caller:
`vllm/models/deepseek_v4/attention.py` `DeepseekV4Attention._fused_qnorm_rope_kv_insert`, fp8_ds_mla branch).

    q_out = fused(q_in [N, H, 512] bf16, kv [N, 512] bf16, k_cache [num_pages, page_bytes] uint8 (in place),
                  slot_mapping [M] int64 (M <= N), position_ids [N] int64, cos_sin_cache [P, 64] float32,
                  q_head_padded, eps, cache_block_size) -> [N, q_head_padded, 512] bf16 (newly allocated)

Q side, every row: per-head RMSNorm without weight (fp32: x * rsqrt(mean(x^2) + eps)), GPT-J RoPE on the last
64 channels at position_ids, one rounding to bf16; heads H .. q_head_padded - 1 are zero. q_in is read-only.
KV side, rows t < M with slot_mapping[t] >= 0: GPT-J RoPE (fp32) of kv, rounded to bf16, UE8M0 FP8 of the 448
NoPE channels (exponent ceil(log2(max(amax_64, 1e-4) / 448)) per 64 values, e4m3 RNE of x * 2^-e clamped to
+-448), the 64 RoPE channels stored as bf16, scale byte 7 = 0, all at page slot // cache_block_size, row
slot % cache_block_size of the page layout in layout.py (page stride = k_cache.stride(0), padding included).
Rows t >= M (DP padding) and slots -1 write nothing. Compiled head paddings: 8, 16, 32, 64, 128.
"""

from __future__ import annotations

import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import layout
from vllm_tree_spec.reference.dsv4_gpu_ops.rope import cos_sin_at, rope_last

COMPILED_HEAD_PADDINGS = (8, 16, 32, 64, 128)


def fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(q_in: torch.Tensor, kv: torch.Tensor, k_cache: torch.Tensor,
                                                      slot_mapping: torch.Tensor, position_ids: torch.Tensor,
                                                      cos_sin_cache: torch.Tensor, q_head_padded: int, eps: float,
                                                      cache_block_size: int) -> torch.Tensor:
    if q_in.dim() != 3 or q_in.shape[-1] != layout.HEAD_DIM or kv.dim() != 2 or kv.shape[-1] != layout.HEAD_DIM:
        raise ValueError(f"q_in must be [N, H, 512] and kv [N, 512], got {tuple(q_in.shape)}, {tuple(kv.shape)}")
    if not (q_in.is_contiguous() and kv.is_contiguous()):
        raise ValueError("q_in and kv must be contiguous")
    n, h, _ = q_in.shape
    if q_head_padded not in COMPILED_HEAD_PADDINGS or q_head_padded < h:
        raise ValueError(f"q_head_padded={q_head_padded} must be one of {COMPILED_HEAD_PADDINGS} and >= {h} heads")
    if slot_mapping.shape[0] > n or position_ids.shape[0] != n:
        raise ValueError(f"slot_mapping ({slot_mapping.shape[0]}) must not exceed, and position_ids "
                         f"({position_ids.shape[0]}) must equal, the {n} rows")
    if k_cache.dtype != torch.uint8:
        raise ValueError(f"k_cache must be the uint8 fp8_ds_mla page view, got {k_cache.dtype}")
    cs = cos_sin_at(cos_sin_cache, position_ids)  # [N, 64]

    x = q_in.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = rope_last(x, cs.unsqueeze(1))
    q_out = torch.zeros(n, q_head_padded, layout.HEAD_DIM, dtype=q_in.dtype, device=q_in.device)
    q_out[:, :h] = x.to(q_in.dtype)

    m = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    if bool(keep.any()):
        rows = rope_last(kv[:m][keep].float(), cs[:m][keep])
        rows = rows.to(torch.bfloat16).to(torch.float32)  # the kernel rounds to bf16 before quantizing
        data, scale = layout.quantize_rows(rows, reciprocal=False)
        layout.write_rows(k_cache, slot_mapping[keep], cache_block_size, data, scale)
    return q_out
