"""FlashMLA sparse attention for DeepSeek-V4 (vLLM 0.32 `vllm/third_party/flashmla/flash_mla_interface.py`).

Decode, `flash_mla_with_kvcache` (caller: `vllm/models/deepseek_v4/nvidia/flashmla.py`
`DeepseekV4FlashMLAAttention._forward_decode`): each query row t attends to the union of

    main:  k_cache rows indices[t, 0, :topk_length[t]]                (the SWA window list)
    extra: extra_k_cache rows extra_indices[t, 0, :extra_topk_length[t]]  (C4 top-k / C128 dense list)

where an index is `page * page_block_size + offset` into the fp8_ds_mla paged cache (layout.py), -1 is a
hole (skipped anywhere in the list), and entries past the length are ignored. One softmax runs over both
lists; the per-head sink adds exp(sink) to the denominator only (out *= 1 / (1 + exp(sink - lse))). A row
with nothing to attend gets out = 0 and lse = +inf. K = V (head_dim_v = 512). Output bf16, lse float32
[b, h_q, s_q] in natural log of the scaled scores.

Prefill, `flash_mla_sparse_fwd` (caller: `_forward_prefill`): q [s_q, h_q, 512] bf16 attends to rows of a
dense bf16 kv [s_kv, 1, 512] (vLLM gathers and dequantizes the compressed + window rows into a workspace
and builds `combine_topk_swa_indices`); invalid indices are < 0 or >= s_kv, topk_length caps each row.

Tile scheduler: `get_mla_metadata()` returns an empty `FlashMLASchedMeta`; the first decode call plans and
fills it, later calls must have the same shapes *and the same topk_length / extra_topk_length values*
(FlashMLA's documented reuse condition: one plan is shared by every layer of a type in a step). This
reference records those values at the first call and raises `ScheduleReuseError` on a different value,
which is how a tree adapter that changes index lengths for one layer only would fail on a GPU (there:
silently wrong tiles).

Kernel constraints mirrored as errors: h_q in {64, 128} for the FP8 sparse decode kernel; list widths a
multiple of the kernel's B_TOPK (64 for h_q = 64, 128 for h_q = 128); sparse decode requires
is_fp8_kvcache and causal=False; an index beyond the cache is an error (on a GPU: an illegal access).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import layout


class ScheduleReuseError(RuntimeError):
    """A FlashMLASchedMeta was reused with different shapes or index lengths than it was planned for."""


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Same fields as FlashMLA's; `planned_lengths` holds the reference's record of the planned lengths."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None
    planned_lengths: tuple | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    return FlashMLASchedMeta(), None


def _b_topk(h_q: int) -> int:
    return 64 if h_q == 64 else 128


def _gather_scope(cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None):
    """cache [num_pages, page_block_size, 1, 584] uint8 view; indices [b, s_q, k] int32
    -> (kv [b, s_q, k, 512] float32, valid [b, s_q, k] bool)."""
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != layout.ROW_BYTES:
        raise ValueError(f"k_cache must be [num_pages, page_block_size, 1, {layout.ROW_BYTES}] (fp8_ds_mla), "
                         f"got {tuple(cache.shape)}")
    b, s_q, k = indices.shape
    bs = cache.shape[1]
    valid = indices != -1
    if lengths is not None:
        if lengths.shape != (b,):
            raise ValueError(f"topk_length must be [batch_size={b}], got {tuple(lengths.shape)}")
        lens = lengths.to(torch.int64).view(b, 1, 1)
        valid &= torch.arange(k, device=indices.device).view(1, 1, k) < lens
    flat_idx = indices[valid].to(torch.int64)
    if flat_idx.numel() and (int(flat_idx.min()) < 0 or int(flat_idx.max()) >= cache.shape[0] * bs):
        raise IndexError(f"sparse index out of range [0, {cache.shape[0] * bs}) (an illegal memory access on GPU): "
                         f"min {int(flat_idx.min())}, max {int(flat_idx.max())}")
    kv = torch.zeros(b, s_q, k, layout.HEAD_DIM, dtype=torch.float32, device=indices.device)
    if flat_idx.numel():
        kv[valid] = layout.gather_dequant(cache, flat_idx, bs)
    return kv, valid


def _check_schedule(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config, lengths: tuple) -> None:
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata must come from get_mla_metadata(), got {type(meta).__name__}")
    if not meta.have_initialized:
        meta.have_initialized = True
        meta.config = config
        meta.planned_lengths = lengths
        meta.tile_scheduler_metadata = torch.zeros(1, 8, dtype=torch.int32)  # a plan exists; contents are opaque
        meta.num_splits = torch.zeros(1, dtype=torch.int32)
        return
    if meta.config != config:
        raise ScheduleReuseError(f"FlashMLASchedMeta reused with a different configuration: planned {meta.config}, "
                                 f"called with {config}")
    for name, planned, now in zip(("topk_length", "extra_topk_length"), meta.planned_lengths, lengths):
        if (planned is None) != (now is None) or (planned is not None and not torch.equal(planned, now)):
            raise ScheduleReuseError(f"FlashMLASchedMeta reused with different {name} values than it was planned "
                                     f"for (one plan serves every layer of a type within a step)")


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                           cache_seqlens: torch.Tensor | None, head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                           extra_k_cache: torch.Tensor | None = None,
                           extra_indices_in_kvcache: torch.Tensor | None = None,
                           topk_length: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decode. q [b, s_q, h_q, 512] bf16 -> (out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32)."""
    if indices is None:
        raise NotImplementedError("dense FlashMLA decode is not part of DeepSeek-V4's path (indices=None)")
    if num_splits is not None:
        raise ValueError("num_splits must be None")
    if causal:
        raise ValueError("causal must be False when sparse attention is enabled")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True when sparse attention is enabled")
    if head_dim_v != layout.HEAD_DIM or q.shape[-1] != layout.HEAD_DIM:
        raise ValueError(f"DeepSeek-V4 FlashMLA needs head_dim = head_dim_v = 512, got {q.shape[-1]}, {head_dim_v}")
    if q.dim() != 4 or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be [b, s_q, h_q, 512] bfloat16, got {tuple(q.shape)} {q.dtype}")
    b, s_q, h_q, _ = q.shape
    if h_q not in (64, 128):
        raise ValueError(f"the FP8 sparse decode kernel supports h_q in (64, 128), got {h_q}")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache go together")
    for name, idx in (("indices", indices), ("extra_indices_in_kvcache", extra_indices_in_kvcache)):
        if idx is None:
            continue
        if idx.dtype != torch.int32 or idx.dim() != 3 or idx.shape[:2] != (b, s_q):
            raise ValueError(f"{name} must be int32 [b={b}, s_q={s_q}, topk], got {idx.dtype} {tuple(idx.shape)}")
        if idx.shape[-1] % _b_topk(h_q):
            raise ValueError(f"{name} width {idx.shape[-1]} is not a multiple of the kernel's B_TOPK "
                             f"{_b_topk(h_q)} (h_q = {h_q})")
    config = FlashMLASchedMeta.Config(
        b, s_q, h_q, k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache, indices.shape[-1],
        None if extra_k_cache is None else extra_k_cache.shape[1],
        None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
    lengths = tuple(None if t is None else t.detach().clone() for t in (topk_length, extra_topk_length))
    _check_schedule(tile_scheduler_metadata, config, lengths)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5

    kv, valid = _gather_scope(k_cache, indices, topk_length)
    if extra_k_cache is not None:
        kv1, valid1 = _gather_scope(extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
        kv, valid = torch.cat((kv, kv1), dim=2), torch.cat((valid, valid1), dim=2)
    qf = q.float().view(b * s_q, h_q, -1)
    kvf = kv.view(b * s_q, -1, layout.HEAD_DIM)
    logits = torch.einsum("rhd,rkd->rhk", qf, kvf) * scale  # [R, h_q, K]
    logits = logits.masked_fill(~valid.view(b * s_q, 1, -1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [R, h_q]
    lonely = lse == float("-inf")
    probs = torch.exp(logits - torch.where(lonely, torch.zeros_like(lse), lse).unsqueeze(-1))
    o = torch.einsum("rhk,rkd->rhd", probs, kvf)
    if attn_sink is not None:
        if attn_sink.shape != (h_q,) or attn_sink.dtype != torch.float32:
            raise ValueError(f"attn_sink must be float32 [h_q={h_q}], got {attn_sink.dtype} {tuple(attn_sink.shape)}")
        o = o / (1.0 + torch.exp(attn_sink.view(1, h_q) - lse)).unsqueeze(-1)
    o = o.masked_fill(lonely.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(lonely, float("inf"))
    result = o.view(b, s_q, h_q, -1).to(torch.bfloat16)
    if out is not None:
        if out.shape != result.shape or out.dtype != torch.bfloat16:
            raise ValueError(f"out must be bfloat16 {tuple(result.shape)}, got {out.dtype} {tuple(out.shape)}")
        out.copy_(result)
        result = out
    return result, lse.view(b, s_q, h_q).transpose(1, 2).contiguous()


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill. q [s_q, h_q, d] bf16, kv [s_kv, 1, d] bf16, indices [s_q, 1, topk] int32
    -> (out [s_q, h_q, 512] bf16, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)."""
    if d_v != layout.HEAD_DIM:
        raise ValueError(f"d_v must be 512, got {d_v}")
    if q.dim() != 3 or kv.dim() != 3 or kv.shape[1] != 1 or indices.dim() != 3 or indices.shape[1] != 1:
        raise ValueError(f"expected q [s_q, h_q, d], kv [s_kv, 1, d], indices [s_q, 1, topk]; got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    idx = indices.view(s_q, topk).to(torch.int64)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=q.device).view(1, topk) < topk_length.view(s_q, 1).to(torch.int64)
    kv2 = kv.view(s_kv, -1)
    o = torch.empty(s_q, h_q, d_v, dtype=torch.float32, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    for r0 in range(0, s_q, 64):  # row chunks bound the gathered [rows, topk, d] block
        r1 = min(r0 + 64, s_q)
        gathered = kv2.index_select(0, idx[r0:r1].clamp(0, max(s_kv - 1, 0)).view(-1)).view(r1 - r0, topk, -1).float()
        logits = torch.einsum("shd,skd->shk", q[r0:r1].float(), gathered) * sm_scale
        logits = logits.masked_fill(~valid[r0:r1].unsqueeze(1), float("-inf"))
        max_logits[r0:r1] = logits.amax(dim=-1)
        lse[r0:r1] = torch.logsumexp(logits, dim=-1)
        lonely = lse[r0:r1] == float("-inf")
        probs = torch.exp(logits - torch.where(lonely, torch.zeros_like(lse[r0:r1]), lse[r0:r1]).unsqueeze(-1))
        o[r0:r1] = torch.einsum("shk,skd->shd", probs, gathered[..., :d_v])
    lonely = lse == float("-inf")
    if attn_sink is not None:
        o = o / (1.0 + torch.exp(attn_sink.view(1, h_q) - lse)).unsqueeze(-1)
    o = o.masked_fill(lonely.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(lonely, float("inf"))
    result = o.to(torch.bfloat16)
    if out is not None:
        if out.shape != result.shape:
            raise ValueError(f"out must be {tuple(result.shape)}, got {tuple(out.shape)}")
        out.copy_(result)
        result = out
    return result, max_logits, lse
