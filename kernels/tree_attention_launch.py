"""Typed launcher for the tree-attention Triton kernel (kernels in `tree_attention.py`).

Imports Triton; import this module lazily (`vllm_tree_spec.tree_attention`
does). Runs natively on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from .tree_attention import tree_attention_combine_kernel, tree_attention_kernel

MAX_HEAD_DIM = 256
MAX_GQA_GROUP = 128
_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TreeAttentionConfig:
    """Tile sizes of one launch (chosen by `pick_config` unless given)."""

    block_m: int  # (query row, query head) pairs per program; rows per tile = block_m // G
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def pick_config(head_dim: int, dtype: torch.dtype, group: int, max_query_len: int) -> TreeAttentionConfig:
    """Heuristic tiles: a tree x G heads in tiles of <= 64 (row, head) pairs, K/V tiles that fit SMEM.

    Measured on an H200 (bf16, D 128, G 4; `run_all.py --only tune_tree_attention`): 64 pairs, 64 keys,
    4 warps, 2 stages was the fastest of 36 configs or within 7 % of it on every workload (batch 1-64,
    16-64 rows, ctx 1k-8k), and 1.03-1.77x the earlier 128-pair / 8-warp / 3-stage tiles; more programs
    of smaller tiles fill the 132 SMs better than fewer large ones.
    """
    head_dim_p = max(16, _next_pow2(head_dim))
    rows_x_heads = group * max(1, max_query_len)
    block_m = max(16, _next_pow2(group), min(64, _next_pow2(rows_x_heads)))
    big = dtype == torch.float32 or head_dim_p > 128
    block_n = 32 if big else 64
    num_warps = 8 if block_m * head_dim_p >= 128 * 128 else 4
    num_stages = 2
    return TreeAttentionConfig(block_m, block_n, num_warps, num_stages)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(num_programs: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Split the KV range when the grid under-fills the GPU (small batch, long context).

    Aims at >= 2 programs per SM while keeping >= 4 key tiles per split.
    """
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1
    want = triton.cdiv(2 * sms, num_programs)
    cap = max(1, max_seq_len // (4 * block_n))
    return int(max(1, min(want, cap, 64)))


def _check(name: str, t: torch.Tensor, dtypes, dim: int | None = None) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")


def tree_attention_triton(
    q: torch.Tensor,  # [T_q, H_q, D] fp16 / bf16 / fp32, pre-roped
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] same dtype as q
    value_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D] same dtype as q
    block_table: torch.Tensor,  # [B, max_blocks] int32 physical block ids
    seq_lens: torch.Tensor,  # [B] int32/int64 tokens in the cache (incl. this step's query tokens)
    query_start_loc: torch.Tensor,  # [B + 1] int32/int64 query row offsets
    cu_num_nodes: torch.Tensor,  # [B + 1] int32/int64 draft-node offsets
    packed_mask: torch.Tensor,  # [T_nodes, W] int32 ancestor-or-self bits, local columns
    depth: torch.Tensor | None = None,  # [T_nodes] int32/int64 node depths (needed with sliding_window)
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H_q] sink logits (fp32 preferred)
    out: torch.Tensor | None = None,  # [T_q, H_q, D] q.dtype, written in place
    lse_out: torch.Tensor | None = None,  # [T_q, H_q] fp32, written in place: ln sum_{visible k} exp(s_k)
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: TreeAttentionConfig | None = None,
) -> torch.Tensor:  # [T_q, H_q, D]
    """Tree attention over a paged KV cache.

    For request b with q_len = query_start_loc[b+1] - query_start_loc[b] query
    rows, N = cu_num_nodes[b+1] - cu_num_nodes[b] draft nodes and S = seq_lens[b]
    cached tokens, query row r sits at slot first + r (first = S - q_len); the
    last N rows are draft nodes 0..N-1 at slots start + i (start = S - N), the
    root is at slot start - 1 and any earlier rows are causal. Row r, query head
    h, kv head g = h // (H_q / H_kv):

        visible(r, k) = k <= first + r  and  (k < start  or  anc[i(r), k - start])
                        [and pos(k) > pos(r) - W  with a sliding window W]
        pos(k) = k for k < start,  pos(node j) = start - 1 + depth[j]
        s_k    = scale * <q[r, h], K[k, g]>     [then softcap * tanh(s_k / softcap)]
        out[r, h] = sum_{visible k} exp(s_k) V[k, g] / (sum_{visible k} exp(s_k) [+ exp(sinks[h])])

    anc[i, j] is bit j % 32 of packed_mask[cu_num_nodes[b] + i, j // 32] and
    slot k of request b is key_cache[block_table[b, k // block_size], k % block_size].
    fp32 accumulation; output in q.dtype. Rows of `out` past query_start_loc[-1]
    (CUDA-graph padding) hold unspecified values.

    max_query_len / max_seq_len size the grid and the KV split; pass them (vLLM
    metadata has them on the host) to avoid a device->host sync and to keep the
    launch CUDA-graph capturable. num_splits > 1 splits each tile's key range
    and merges the parts in a second kernel (flash-decoding); None = heuristic.

    lse_out receives each row's natural log-sum-exp over its visible keys, for
    merging this attention with another over disjoint keys (-inf where no key
    is visible; that row's output is then unspecified). It needs sinks=None,
    and the launch then always takes the split path (its parts carry the
    log-sum-exp).

    Raises TypeError / ValueError / NotImplementedError for unsupported inputs
    (fp8 or mixed-dtype caches, head_dim > 256, more than 128 query heads per kv
    head, non-contiguous head_dim, bad sizes); there is no silent fallback.
    """
    # -- validation ---------------------------------------------------------
    if q.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"q must be [T_q, H_q, D] and key_cache [num_blocks, block_size, H_kv, D]; "
            f"got {tuple(q.shape)} and {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise NotImplementedError(f"q dtype {q.dtype} is not supported; use fp16, bf16 or fp32")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise NotImplementedError(
            f"KV cache dtype {key_cache.dtype}/{value_cache.dtype} differs from q dtype {q.dtype}; "
            f"quantised (fp8) or mixed-precision KV caches are not supported by this kernel"
        )
    t_q, hq, d = q.shape
    num_blocks, page_size, hkv, d_k = key_cache.shape
    if d_k != d:
        raise ValueError(f"q head_dim {d} != cache head_dim {d_k}")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head_dim {d} > {MAX_HEAD_DIM} is not supported")
    if hq % hkv != 0:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    group = hq // hkv
    if group > MAX_GQA_GROUP:
        raise NotImplementedError(f"{group} query heads per kv head > {MAX_GQA_GROUP} is not supported")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {t.stride()}")
    _check("block_table", block_table, (torch.int32,), 2)
    _check("seq_lens", seq_lens, _INDEX_DTYPES, 1)
    _check("query_start_loc", query_start_loc, _INDEX_DTYPES, 1)
    _check("cu_num_nodes", cu_num_nodes, _INDEX_DTYPES, 1)
    _check("packed_mask", packed_mask, (torch.int32,), 2)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1 or cu_num_nodes.shape[0] != batch + 1:
        raise ValueError(
            f"{batch} requests need query_start_loc and cu_num_nodes of length {batch + 1}; "
            f"got {query_start_loc.shape[0]} and {cu_num_nodes.shape[0]}"
        )
    if batch > 65535:
        raise NotImplementedError(f"batch {batch} > 65535 requests (CUDA grid z limit) is not supported")
    if block_table.shape[0] < batch or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [>= {batch}, max_blocks] with contiguous rows")
    if packed_mask.stride(1) != 1:
        raise ValueError("packed_mask rows must be contiguous")
    if sliding_window is not None:
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 position, got {sliding_window}")
        if depth is None:
            raise ValueError("sliding_window needs the node depths (depth [T_nodes]) for depth-aware positions")
    if depth is not None:
        _check("depth", depth, _INDEX_DTYPES, 1)
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if lse_out is not None:
        if sinks is not None:
            raise ValueError("lse_out is the log-sum-exp over keys; it cannot be combined with sinks")
        if lse_out.shape != (t_q, hq) or lse_out.dtype != torch.float32:
            raise ValueError(f"lse_out must be [T_q, H_q] = [{t_q}, {hq}] float32, got {tuple(lse_out.shape)} "
                             f"{lse_out.dtype}")
    if sinks is not None:
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must be [H_q] = [{hq}], got {tuple(sinks.shape)}")
        _check("sinks", sinks, _FLOAT_DTYPES)
    device = q.device
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"the Triton tree-attention kernel needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            f"before importing triton or use backend='torch'"
        )
    tensors = [key_cache, value_cache, block_table, seq_lens, query_start_loc, cu_num_nodes, packed_mask]
    tensors += [t for t in (depth, sinks) if t is not None]
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all inputs must be on {device}; found a tensor on {t.device}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T_q, H_q, D] {q.dtype} with contiguous head_dim; got {tuple(out.shape)}")
    if batch == 0 or t_q == 0:
        return out

    # -- sizes (host) -------------------------------------------------------
    if max_query_len is None:  # device->host sync; pass it in hot paths
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if scale is None:
        scale = d**-0.5
    cfg = config or pick_config(d, q.dtype, group, max_query_len)
    if cfg.block_m < group or cfg.block_m < 16 or cfg.block_n < 16:
        raise ValueError(f"config {cfg}: block_m must be >= max(16, G = {group}) and block_n >= 16")
    rows_per_tile = cfg.block_m // group
    num_tiles = triton.cdiv(max_query_len, rows_per_tile)
    if num_splits is None:
        num_splits = pick_num_splits(batch * hkv * num_tiles, max_seq_len, cfg.block_n, device)
    num_splits = int(num_splits)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    head_dim_p = max(16, triton.next_power_of_2(d))

    dummy = torch.empty(1, dtype=torch.float32, device=device)
    has_sinks = sinks is not None
    sinks_arg = sinks if has_sinks else dummy
    depth_arg = depth if depth is not None else dummy
    packed_arg = packed_mask if packed_mask.numel() else torch.zeros(1, 1, dtype=torch.int32, device=device)
    split_kv = num_splits > 1 or lse_out is not None
    # NOTE: Triton's interpreter (3.9) multiplies the raw uint16 bits of bf16
    # tl.dot operands; run the dots on fp32 copies there. Never set on GPU.
    upcast = interpret and q.dtype == torch.bfloat16
    if split_kv:
        part = torch.empty(num_splits, t_q, hq, d, dtype=torch.float32, device=device)
        lse = torch.empty(num_splits, t_q, hq, dtype=torch.float32, device=device)
        dst, s_ot, s_oh, s_os, s_ls, s_lt = part, part.stride(1), part.stride(2), part.stride(0), lse.stride(0), hq
    else:
        lse = dummy
        dst, s_ot, s_oh, s_os, s_ls, s_lt = out, out.stride(0), out.stride(1), 0, 0, 0
    grid = (num_tiles * num_splits, hkv, batch)
    tree_attention_kernel[grid](
        dst, lse, q, key_cache, value_cache,
        block_table, seq_lens, query_start_loc, cu_num_nodes, packed_arg, depth_arg, sinks_arg,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        num_tiles,
        num_splits,
        s_ot, s_oh, s_os, s_ls, s_lt,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), packed_arg.stride(0),
        G=group,
        HEAD_DIM=d,
        HEAD_DIM_P=head_dim_p,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PAGE_SIZE=page_size,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=has_sinks,
        SPLIT_KV=split_kv,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if split_kv:
        tree_attention_combine_kernel[(t_q, hq)](
            out, part, lse, sinks_arg,
            num_splits,
            out.stride(0), out.stride(1), part.stride(0), lse.stride(0),
            NUM_HEADS=hq,
            HEAD_DIM=d,
            HEAD_DIM_P=head_dim_p,
            SPLITS_P=max(2, triton.next_power_of_2(num_splits)),
            HAS_SINKS=has_sinks,
            num_warps=4 if head_dim_p >= 128 else 2,
        )  # fmt: skip
        if lse_out is not None:  # the parts' log2-sum-exp -> ln over all splits
            torch.logsumexp(lse * math.log(2.0), dim=0, out=lse_out)
    return out
