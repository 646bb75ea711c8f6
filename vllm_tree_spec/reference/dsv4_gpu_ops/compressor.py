"""The DeepSeek-V4 compressor kernels: partial-state save and compress -> RMSNorm -> RoPE -> quantize -> store.

Callers: `vllm/models/deepseek_v4/compressor.py` `DeepseekCompressor.forward`. On CUDA the main compressor
(head 512) is the CuTeDSL kernel `_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL`
(`nvidia/ops/sparse_attn_compress_cutedsl.py`); the indexer compressor (head 128) is the Triton kernel
`compress_norm_rope_store_triton` (`common/ops/fused_compress_quant_cache.py`). Both take the same arguments.

State cache [num_pages, block_size, 2 * sw] float32, sw = coff * head (coff = 2 for ratio 4, else 1): one row
per token, [kv | score + ape[pos % ratio]] (`save_partial_states`, written for every token with a slot).

For each token t < num_actual with slot_mapping[t] >= 0 and (p + 1) % ratio == 0 (p = positions[t]):
  window rows at positions p - (1 + overlap) * ratio + 1 .. p, fetched **by position through the state block
  table** of request token_to_req_indices[t] (`block_table[req, q // block_size]`, row q % block_size);
  positions < 0 are masked (score -inf, kv 0). With overlap (ratio 4), the first `ratio` rows use the first
  half of the row (channels [0, head)), the last `ratio` rows the second half ([head, 2 head)).
  compressed = sum_rows softmax_rows(score) * kv (per channel); normed = compressed * rsqrt(mean(c^2) + eps) * w.
  The entry is stored at k_cache_metadata.slot_mapping[t] (if >= 0) of kv_cache (page stride =
  kv_cache.stride(0)), RoPE at the block start (p // ratio) * ratio:
    head 512 (fp8_ds_mla row): NoPE = UE8M0 FP8 of bf16(normed) (exponent from absmax * (1/448)), RoPE part =
      bf16(GPT-J rope(normed)), scale byte 7 = 0;
    head 128 (indexer key): r = bf16(rope(normed)); one exponent e for all 128 values; e4m3(r * 2^-e) and
      the float32 scale 2^e.
A tree step's branch node that completes a block needs its *ancestors'* rows here, not the rows of the
positions' canonical slots: that is the compressor's by-position fetch.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import layout
from vllm_tree_spec.reference.dsv4_gpu_ops.rope import cos_sin_at, rope_last

C128_STATE_BLOCK_SIZE = 8  # the CuTeDSL C128 kernel's fixed state-cache block size


def save_partial_states(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                        state_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """In place: state row at slot_mapping[t] = [kv[t] | score[t] + ape[positions[t] % ratio]]."""
    sw = kv.shape[-1]
    if state_cache.shape[-1] != 2 * sw:
        raise ValueError(f"state rows must be 2 * {sw} wide, got {state_cache.shape[-1]}")
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    rows = torch.cat((kv[:n][keep].float(), score[:n][keep].float()
                      + ape[(positions[:n][keep] % ape.shape[0]).to(torch.int64)]), dim=-1)
    state_cache[slots // block_size, slots % block_size] = rows


def _compress(state_cache: torch.Tensor, block_table: torch.Tensor, block_size: int, req: torch.Tensor,
              pos: torch.Tensor, head: int, sw: int, ratio: int, overlap: bool) -> torch.Tensor:
    """Pooled (pre-norm) entries [E, head] for emitting tokens at positions pos [E] of requests req [E]."""
    width = (1 + int(overlap)) * ratio
    w = torch.arange(width, device=pos.device)
    p = pos.unsqueeze(-1) - width + 1 + w  # [E, width]
    valid = p >= 0
    pc = p.clamp(min=0)
    blocks = block_table[req.unsqueeze(-1).expand_as(pc), pc // block_size].to(torch.int64)
    rows = state_cache[blocks, pc % block_size].float()  # [E, width, 2 sw]
    offset = (w >= ratio).to(torch.int64) * head if overlap else torch.zeros_like(w)
    ch = offset.unsqueeze(-1) + torch.arange(head, device=pos.device)  # [width, head]
    kv = rows.gather(-1, ch.unsqueeze(0).expand(rows.shape[0], -1, -1))
    score = rows.gather(-1, (ch + sw).unsqueeze(0).expand(rows.shape[0], -1, -1))
    score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    return (torch.softmax(score, dim=1) * kv).sum(dim=1)


def compress_norm_rope_store(state_cache: torch.Tensor, num_actual: int, token_to_req_indices: torch.Tensor,
                             positions: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                             block_size: int, state_width: int, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                             k_cache_metadata: Any, pdl_kwargs: dict, head_dim: int, rope_head_dim: int,
                             compress_ratio: int, overlap: bool, use_fp4_cache: bool,
                             rms_norm_weight: torch.Tensor, rms_norm_eps: float, quant_block: int,
                             token_stride: int, scale_dim: int, store_full_kv: bool = False,
                             store_full_fp8: bool = False, fp8_scale: torch.Tensor | None = None) -> None:
    """The compressor entry point with vLLM's launcher signature (fp8_ds_mla / FP8-indexer layouts)."""
    if use_fp4_cache:
        raise NotImplementedError("the MXFP4 indexer cache is not emulated (refuse it in the engine config)")
    if store_full_kv or store_full_fp8:
        raise NotImplementedError("the plain-row (FlashInfer) cache layout is not emulated")
    if kv_cache.ndim != 3:
        raise ValueError(f"kv_cache must be the 3-D paged view [pages, entries, bytes], got ndim={kv_cache.ndim}")
    if rope_head_dim != layout.ROPE_DIM:
        raise ValueError(f"rope_head_dim must be {layout.ROPE_DIM}, got {rope_head_dim}")
    if head_dim == layout.HEAD_DIM:
        ok = (compress_ratio == 4 and overlap and state_width == 2 * head_dim) or \
             (compress_ratio == 128 and not overlap and state_width == head_dim)
        if not ok:
            raise ValueError("the CuTeDSL compressor supports the DeepSeek-V4 C4 (ratio 4, overlap, state 1024) and "
                             f"C128 (ratio 128, state 512) layouts, got ratio {compress_ratio}, overlap {overlap}, "
                             f"state width {state_width}")
        if compress_ratio == 128 and block_size != C128_STATE_BLOCK_SIZE:
            raise ValueError(f"the CuTeDSL C128 compressor requires state-cache block_size="
                             f"{C128_STATE_BLOCK_SIZE}, got {block_size}")
    elif head_dim != layout.INDEX_DIM:
        raise ValueError(f"head_dim must be {layout.HEAD_DIM} or {layout.INDEX_DIM}, got {head_dim}")
    if positions.numel() == 0 or num_actual == 0:
        return
    n = num_actual
    pos = positions[:n].to(torch.int64)
    kv_slots = k_cache_metadata.slot_mapping[:n]
    emit = (slot_mapping[:n] >= 0) & ((pos + 1) % compress_ratio == 0) & (kv_slots >= 0)
    if not bool(emit.any()):
        return
    idx = emit.nonzero().squeeze(-1)
    req = token_to_req_indices[idx].to(torch.int64)
    pooled = _compress(state_cache, block_table, block_size, req, pos[idx], head_dim, state_width,
                       compress_ratio, overlap)
    w = rms_norm_weight.float()
    normed = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + rms_norm_eps) * w
    cs = cos_sin_at(cos_sin_cache, (pos[idx] // compress_ratio) * compress_ratio)
    roped = rope_last(normed, cs)
    slots = kv_slots[idx].to(torch.int64)
    entries = kv_cache.shape[1]
    if head_dim == layout.HEAD_DIM:
        rows = torch.cat((normed[:, :layout.NOPE_DIM], roped[:, layout.NOPE_DIM:]), dim=-1)
        rows = torch.cat((rows[:, :layout.NOPE_DIM].to(torch.bfloat16).float(), rows[:, layout.NOPE_DIM:]), dim=-1)
        data, scale = layout.quantize_rows(rows, reciprocal=True)
        layout.write_rows(kv_cache, slots, entries, data, scale)
    else:
        r = roped.to(torch.bfloat16).float()
        exp = layout.ue8m0_exponent(r.abs().amax(-1, keepdim=True), reciprocal=True)  # [E, 1]
        vals = layout.quantize_e4m3(r, exp)
        layout.write_index_keys(kv_cache, slots, entries, vals, torch.exp2(exp).squeeze(-1))
