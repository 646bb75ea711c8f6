"""The CSA lightning indexer's CUDA ops: DeepGEMM's paged MQA logits with its schedule, prefill MQA logits,
the FP8 key gather and the top-k kernels.

Callers (vLLM 0.32): `vllm/model_executor/layers/sparse_attn_indexer.py` `sparse_attn_indexer` (decode:
`fp8_fp4_paged_mqa_logits` -> `get_indexer_topk(...)` = `torch.ops._C.cooperative_topk` (<= 64 rows) or
`persistent_topk` on SM90/SM100, `top_k_per_row_decode` elsewhere; prefill: `cp_gather_indexer_k_quant_cache`
-> `fp8_fp4_mqa_logits` -> `top_k_per_row_prefill`), and `vllm/v1/attention/backends/mla/indexer.py`
`DeepseekV32IndexerMetadataBuilder.build` (the schedule, `get_paged_mqa_logits_metadata`, from the decode
rows' seq_lens). The DeepGEMM entry points are what `vllm.utils.deep_gemm` resolves into its `_*_impl` slots.

Decode rows. The builder gives each decode row r its own compressed length seq_lens and a block-table row:
flattened (one row per query token, `seq_len_r = (prefix + i + 1) // 4` in query order, the request's page row
repeated) or, on SM90 for next_n in {1, 2, 4}, native ([B, next_n] lengths, one page row per request).
    logits[r, k] = sum_h weights[r, h] * relu((q[r, h] . K[k]) * scale[k])     for k < len_r
with q e4m3 [B, next_n, H, 128] (its per-token scale already folded into weights by
`fused_indexer_q_rope_quant`), K[k] the e4m3 key of local entry k found through the row's page table
(indexer page layout in layout.py), logits [B * next_n, max_model_len] float32. Columns >= len_r are
unspecified on the GPU (clean_logits=False); this reference writes NaN there so a reader past the length
is caught.

Schedule. DeepGEMM splits the rows' key pages across SMs from the lengths; the plan is only valid for the
lengths it was built from. `get_paged_mqa_logits_metadata` returns the [num_slots + 1, 2] int32 tensor
DeepGEMM returns: rows 0..num_slots-1 are (first row, first page) of each slot's share of the work, row
num_slots is (batch, fingerprint of the lengths) (DeepGEMM: (batch, 0)). `fp8_fp4_paged_mqa_logits` checks
the fingerprint against its own context_lens and raises `StaleScheduleError` on a mismatch: a tree step that
rewrites seq_lens after the builder ran, without rebuilding the schedule, fails loudly here.

Top-k. Rows select the top_k largest logits among their valid columns; ties go to the lower column (the
CUDA radix kernels' order among ties is unspecified). A row with n <= top_k valid columns returns 0..n-1;
the rest of the row is -1. Prefill indices are local to the row's range ([ks, ke) -> k - ks).
"""

from __future__ import annotations

import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import layout


class StaleScheduleError(RuntimeError):
    """The paged-MQA-logits schedule was built for other context lengths."""


_FP_MOD = 2_147_483_629  # a prime below 2^31


def _fingerprint(context_lens: torch.Tensor) -> int:
    h = 1_000_003 * context_lens.dim() + context_lens.shape[0]
    for v in context_lens.reshape(-1).tolist():
        h = (h * 1_000_003 + int(v) + 7) % _FP_MOD
    return h


def _row_lens(context_lens: torch.Tensor) -> torch.Tensor:
    """[B] (old API: per request) or [B, next_n] (per row) -> the per-batch work length [B]."""
    return context_lens if context_lens.dim() == 1 else context_lens.amax(dim=-1)


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int, num_slots: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM's `get_paged_mqa_logits_metadata` (the impl vLLM calls with the slot count it derived)."""
    if indices is not None:
        raise NotImplementedError("varlen (SM100 `indices`) paged MQA logits are not emulated; emulate SM90")
    if context_lens.dtype != torch.int32:
        raise TypeError(f"context_lens must be int32, got {context_lens.dtype}")
    lens = _row_lens(context_lens).to(torch.int64).clamp(min=0)
    pages = (lens + block_size - 1) // block_size  # work units per batch
    prefix = torch.cat((torch.zeros(1, dtype=torch.int64), pages.cumsum(0)))
    total = int(prefix[-1])
    sched = torch.empty(num_slots + 1, 2, dtype=torch.int32)
    for i in range(num_slots):
        start = i * total // num_slots
        b = int(torch.searchsorted(prefix, torch.tensor([start]), right=True)[0]) - 1
        b = min(b, lens.shape[0])
        sched[i, 0] = b
        sched[i, 1] = start - int(prefix[b]) if b < lens.shape[0] else 0
    sched[num_slots, 0] = lens.shape[0]
    sched[num_slots, 1] = _fingerprint(context_lens)
    return sched.to(context_lens.device)


def _check_schedule(schedule: torch.Tensor, context_lens: torch.Tensor) -> None:
    if schedule.dim() != 2 or schedule.shape[1] != 2 or schedule.dtype != torch.int32:
        raise ValueError(f"schedule_metadata must be int32 [num_slots + 1, 2], got {schedule.dtype} "
                         f"{tuple(schedule.shape)}")
    batch, fp = (int(v) for v in schedule[-1].tolist())
    if batch != context_lens.shape[0] or fp != _fingerprint(context_lens):
        raise StaleScheduleError(
            "paged MQA logits called with context_lens other than those its schedule was built from "
            "(rebuild the schedule with get_paged_mqa_logits_metadata after changing the decode seq_lens)")


def _paged_keys(kv_cache: torch.Tensor, block_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys 0..n-1 of one page-table row -> (values [n, 128] fp32 e4m3, scale [n] fp32)."""
    bs = kv_cache.shape[1]
    k = torch.arange(n, device=kv_cache.device)
    slots = block_row[k // bs].to(torch.int64) * bs + k % bs
    return layout.read_index_keys(kv_cache, slots, bs)


def fp8_fp4_paged_mqa_logits(q: tuple, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, schedule_metadata: torch.Tensor, max_model_len: int,
                             clean_logits: bool, indices: torch.Tensor | None = None) -> torch.Tensor:
    """Decode logits [B * next_n, max_model_len] float32 (see the module docstring)."""
    q_vals, q_scale = q
    if q_scale is not None:
        raise NotImplementedError("the MXFP4 indexer (q scales) is not emulated")
    if indices is not None:
        raise NotImplementedError("varlen (SM100 `indices`) paged MQA logits are not emulated; emulate SM90")
    if q_vals.dtype != torch.float8_e4m3fn or q_vals.dim() != 4:
        raise ValueError(f"q must be float8_e4m3fn [B, next_n, H, D], got {q_vals.dtype} {tuple(q_vals.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != layout.INDEX_ROW_BYTES:
        raise ValueError(f"kv_cache must be [pages, block_size, 1, {layout.INDEX_ROW_BYTES}], "
                         f"got {tuple(kv_cache.shape)}")
    if context_lens.dim() != 2:
        raise ValueError(f"context_lens must be 2-D [B, next_n] (DeepGEMM asserts it), got {tuple(context_lens.shape)}")
    _check_schedule(schedule_metadata, context_lens)
    b, next_n, h, d = q_vals.shape
    if context_lens.shape != (b, next_n) and context_lens.shape != (b, 1):
        raise ValueError(f"context_lens {tuple(context_lens.shape)} does not match q rows ({b}, {next_n})")
    if weights.shape[0] < b * next_n:
        raise ValueError(f"weights has {weights.shape[0]} rows for {b * next_n} query rows")
    lens = context_lens.expand(b, next_n) if context_lens.shape[1] == 1 and next_n > 1 else context_lens
    if int(lens.max()) > max_model_len:
        raise ValueError(f"a context length {int(lens.max())} exceeds max_model_len {max_model_len}")
    fill = float("-inf") if clean_logits else float("nan")
    logits = torch.full((b * next_n, max_model_len), fill, dtype=torch.float32, device=q_vals.device)
    qf = q_vals.float()
    for i in range(b):
        n_max = int(lens[i].max())
        if n_max <= 0:
            continue
        vals, scale = _paged_keys(kv_cache, block_tables[i], n_max)  # [n, D], [n]
        for j in range(next_n):
            r = i * next_n + j
            n = int(lens[i, j])
            if n <= 0:
                continue
            dots = (qf[i, j] @ vals[:n].t()) * scale[:n]  # [H, n]
            logits[r, :n] = (dots.relu() * weights[r].float().unsqueeze(-1)).sum(0)
    return logits


def fp8_fp4_mqa_logits(q: tuple, kv: tuple, weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                       cu_seqlen_ke: torch.Tensor, clean_logits: bool) -> torch.Tensor:
    """Prefill logits [M, N] float32 over a gathered key workspace; valid columns [ks[m], ke[m])."""
    q_vals, q_scale = q
    k_vals, k_scale = kv
    if q_scale is not None:
        raise NotImplementedError("the MXFP4 indexer (q scales) is not emulated")
    if q_vals.dtype != torch.float8_e4m3fn or k_vals.dtype != torch.float8_e4m3fn:
        raise ValueError("q and k must be float8_e4m3fn")
    dots = torch.einsum("mhd,nd->mhn", q_vals.float(), k_vals.float()) * k_scale.float().view(1, 1, -1)
    logits = (dots.relu() * weights.float().unsqueeze(-1)).sum(1)  # [M, N]
    cols = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    valid = (cols >= cu_seqlen_ks.unsqueeze(1)) & (cols < cu_seqlen_ke.unsqueeze(1))
    return logits.masked_fill(~valid, float("-inf") if clean_logits else float("nan"))


def cp_gather_indexer_k_quant_cache(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                                    block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """In place: keys 0..len_b-1 of request b (through block_table[b]) -> rows cu[b].. of dst_k / dst_scale."""
    bs = kv_cache.shape[1]
    cu = cu_seq_lens.tolist()
    for b_ in range(len(cu) - 1):
        n = cu[b_ + 1] - cu[b_]
        if n <= 0:
            continue
        k = torch.arange(n, device=kv_cache.device)
        slots = block_table[b_][k // bs].to(torch.int64) * bs + k % bs
        flat, blk, off = layout._row_offsets(slots, bs, layout.INDEX_ROW_BYTES, kv_cache)
        idx = (off * layout.INDEX_DIM).unsqueeze(-1) + torch.arange(layout.INDEX_DIM, device=kv_cache.device)
        dst_k[cu[b_]:cu[b_ + 1]] = flat[blk.unsqueeze(-1), idx].view(torch.float8_e4m3fn).view(dst_k.dtype)
        sidx = (bs * layout.INDEX_DIM + off * 4).unsqueeze(-1) + torch.arange(4, device=kv_cache.device)
        dst_scale[cu[b_]:cu[b_ + 1]] = flat[blk.unsqueeze(-1), sidx]


def _topk_rows(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """Per row r: the top k columns of logits[r, starts[r]:ends[r]], as offsets from starts[r]; -1 padded."""
    out[:, :k] = -1
    for r in range(logits.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        n = max(e - s, 0)
        if n == 0:
            continue
        if n <= k:
            out[r, :n] = torch.arange(n, dtype=out.dtype, device=out.device)
            continue
        row = logits[r, s:e]
        if torch.isnan(row).any():
            raise ValueError(f"top-k row {r} reads NaN logits inside its valid range [{s}, {e})")
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        out[r, :k] = order.to(out.dtype)


def _decode_row_ends(seq_lens: torch.Tensor, next_n: int, num_rows: int) -> torch.Tensor:
    if seq_lens.numel() == num_rows:
        return seq_lens.reshape(-1).to(torch.int64)
    offs = torch.arange(next_n, device=seq_lens.device)
    return (seq_lens.reshape(-1, 1).to(torch.int64) - next_n + 1 + offs).clamp(min=0).reshape(-1)[:num_rows]


def top_k_per_row_decode(logits: torch.Tensor, next_n: int, seq_lens: torch.Tensor, raw_topk_indices: torch.Tensor,
                         num_rows: int, stride0: int, stride1: int, topk_tokens: int) -> None:
    view = torch.as_strided(logits, (num_rows, logits.shape[-1]), (stride0, stride1), logits.storage_offset())
    ends = _decode_row_ends(seq_lens, next_n, num_rows)
    _topk_rows(view, torch.zeros_like(ends), ends, raw_topk_indices, topk_tokens)


def top_k_per_row_prefill(logits: torch.Tensor, cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                          raw_topk_indices: torch.Tensor, num_rows: int, stride0: int, stride1: int,
                          topk_tokens: int) -> None:
    view = torch.as_strided(logits, (num_rows, logits.shape[-1]), (stride0, stride1), logits.storage_offset())
    _topk_rows(view, cu_seqlen_ks[:num_rows], cu_seqlen_ke[:num_rows], raw_topk_indices, topk_tokens)


def radix_topk(logits: torch.Tensor, seq_lens: torch.Tensor, topk_indices: torch.Tensor, workspace: torch.Tensor,
               topk_tokens: int, max_seq_len: int) -> None:
    """`torch.ops._C.cooperative_topk` / `persistent_topk`: rows of logits with per-row lengths from seq_lens
    ([B, next_n] per row, or [B, 1] / [B] per request with one row each)."""
    num_rows = logits.shape[0]
    next_n = num_rows // max(seq_lens.shape[0], 1)
    ends = _decode_row_ends(seq_lens, next_n, num_rows).clamp(max=max(max_seq_len, 0))
    _topk_rows(logits, torch.zeros_like(ends), ends, topk_indices, topk_tokens)


def fused_indexer_q_rope_quant(positions: torch.Tensor, index_q: torch.Tensor, index_q_cos_sin_cache: torch.Tensor,
                               index_weights: torch.Tensor, index_weights_softmax_scale: float,
                               index_weights_head_scale: float, use_fp4: bool = False,
                               weights_out_dtype: torch.dtype = torch.float32):
    """The indexer query quantization (`common/ops/fused_indexer_q.fused_indexer_q_rope_quant`, FP8 branch;
    CuTeDSL kernel on CUDA when available, else Triton; caller `DeepseekV4Indexer.forward`).

    q [T, H, 128] bf16: GPT-J RoPE (fp32) on the last 64 channels at positions, rounded to bf16; one scale per
    (token, head) s = 2^ceil(log2(max(amax, 1e-4) / 448)); q_fp8 = e4m3(q / s). The scale is not stored: it is
    folded into weights_out = weights * s * softmax_scale * head_scale (float32) -> (q_fp8, weights_out)."""
    if use_fp4:
        raise NotImplementedError("the MXFP4 indexer is not emulated (refuse it in the engine config)")
    if weights_out_dtype != torch.float32:
        raise ValueError("the FP8 indexer path returns float32 weights")
    t, h, d = index_q.shape
    rope_dim = index_q_cos_sin_cache.shape[-1]
    cs = index_q_cos_sin_cache.float().index_select(0, positions.to(torch.int64)).unsqueeze(1)  # [T, 1, 64]
    x = index_q.float()
    half = rope_dim // 2
    rot = x[..., d - rope_dim:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    cos, sin = cs[..., :half], cs[..., half:]
    r = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    r = r.to(torch.bfloat16).float()
    q = torch.cat((x[..., :d - rope_dim], r), dim=-1)
    amax = q.abs().amax(-1).clamp(min=1e-4)  # [T, H]
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q_fp8 = (q / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    w = index_weights.float() * scale
    w = w * torch.tensor(index_weights_softmax_scale, dtype=torch.float32)
    w = w * torch.tensor(index_weights_head_scale, dtype=torch.float32)
    return q_fp8, w
