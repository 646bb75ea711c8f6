"""DeepSeek-V4 compressor pooling for tree rows: Triton launcher and PyTorch twin.

Kernel in `dsv4_compress.py`; Triton is imported lazily inside the launcher.

What it computes (`vllm_tree_spec.reference.dsv4.Compressor.pool`, docs/reference-model.md).
For every row r with (t + 1) % m == 0 (t = positions[r]) and write_slots[r] != -1,
with window slots s_i = gather[r, i], i = 0..coff*m-1 (oldest first, -1 = masked):

    value_i, logit_i = state_kv[s_i, h_i : h_i + D], state_score[s_i, h_i : h_i + D]
        h_i = 0 (a half) for i < m and D (b half) for i >= m when coff = 2 (CSA, m = 4);
        h_i = 0 when coff = 1 (HCA)
    pooled  = sum_i softmax_i(logit_i) * value_i             per channel, masked slots excluded
    y       = pooled * rsqrt(mean(pooled^2) + eps) * norm_weight
    out[write_slots[r]] = RoPE_{t + 1 - m}(y)                last rope_dim channels, interleaved
                                                             pairs (2j, 2j + 1), angle from cos_sin

`state_score` holds the gate logits with the position bias already added
(Z_j + ape[j mod m]), as vLLM's compressor state cache and the reference store
them; the bias never touches the values. Rows that complete no block, or whose
write slot is -1, are not touched. Accumulation is fp32.

What it does not cover: computing the state rows themselves (per-token
projections `W_KV h`, `W_Z h + ape`, written by vLLM's save-partial-states
kernel at each row's own slot, unchanged for trees); the FP8 UE8M0 (main) /
FP4 + Hadamard (indexer) quantisation and vLLM's 584- / 132-byte row packing
(the reference model has no quantisation either): `out` is a float
[num_slots, D] buffer.

Inputs for a tree step: `gather` = `tree_window_slots_*(rows, state_row_slots,
state_block_table, ..., window=coff * m, align="position")` and `write_slots` =
`tree_entry_slots_*(...).write` (dsv4_tree_meta_launch.py, dsv4_tree_meta_reference.py). Main and indexer
compressors of a CSA layer are two calls (D = head_dim / index_head_dim).
"""

from __future__ import annotations

import os

import torch

_FLOAT_OUT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def rope_cos_sin_table(theta: float, rope_dim: int, num_positions: int, dtype=torch.float32,
                       device=None) -> torch.Tensor:  # fmt: skip
    """[num_positions, rope_dim] = cat(cos, sin) of position * theta^(-2j / rope_dim), j < rope_dim / 2.

    Built in float64 (positions up to 1M at theta 160000 lose all precision in
    fp32 angles), then cast: vLLM's `cos_sin_cache` layout. YaRN-scaled tables
    (`rope_scaling`) have the same layout and can be passed instead.
    """
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angle = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angle.cos(), angle.sin()), dim=1).to(dtype=dtype, device=device)


def _coff(ratio: int, state_width: int, d: int) -> int:
    coff = state_width // d
    if coff not in (1, 2) or coff * d != state_width:
        raise ValueError(f"state rows of width {state_width} are not 1 or 2 x the entry width {d}")
    return coff


def dsv4_compress_reference(
    out: torch.Tensor,  # [num_entry_slots, D], written in place
    state_kv: torch.Tensor,  # [num_state_slots, coff * D]
    state_score: torch.Tensor,  # [num_state_slots, coff * D]
    gather: torch.Tensor,  # [R, coff * m]
    positions: torch.Tensor,  # [R]
    write_slots: torch.Tensor,  # [R]
    norm_weight: torch.Tensor,  # [D]
    cos_sin: torch.Tensor,  # [num_positions, rope_dim]
    *,
    ratio: int,
    eps: float,
) -> torch.Tensor:
    """PyTorch twin (module docstring); computes in float32 (float64 if the state is float64). Returns the
    rows that emitted ([E] int64)."""
    d = out.shape[-1]
    coff = _coff(ratio, state_kv.shape[-1], d)
    rope_dim = cos_sin.shape[-1]
    cdt = torch.float64 if state_kv.dtype == torch.float64 else torch.float32
    pos = positions.long()
    emit = (((pos + 1) % ratio) == 0) & (write_slots.long() >= 0)
    rows = emit.nonzero().flatten()
    if rows.numel() == 0:
        return rows
    g = gather.long()[rows]  # [E, coff * m]
    valid = g >= 0
    kv = state_kv[g.clamp(min=0)].to(cdt)  # [E, coff * m, coff * D]
    sc = state_score[g.clamp(min=0)].to(cdt)
    if coff == 2:  # a halves of the previous block, b halves of the own block
        values = torch.cat((kv[:, :ratio, :d], kv[:, ratio:, d:]), dim=1)
        logits = torch.cat((sc[:, :ratio, :d], sc[:, ratio:, d:]), dim=1)
    else:
        values, logits = kv, sc
    values = values.masked_fill(~valid[..., None], 0.0)
    logits = logits.masked_fill(~valid[..., None], float("-inf"))
    pooled = (torch.softmax(logits, dim=1) * values).sum(dim=1)  # [E, D]
    y = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(cdt)
    cs = cos_sin.to(cdt)[pos[rows] + 1 - ratio]  # [E, rope_dim]
    cos, sin = cs[:, : rope_dim // 2], cs[:, rope_dim // 2 :]
    nope, rot = y[:, : d - rope_dim], y[:, d - rope_dim :]
    ev, od = rot[:, 0::2], rot[:, 1::2]
    rotated = torch.stack((ev * cos - od * sin, ev * sin + od * cos), dim=-1).flatten(-2)
    out[write_slots.long()[rows]] = torch.cat((nope, rotated), dim=-1).to(out.dtype)
    return rows


def dsv4_compress_triton(
    out: torch.Tensor,  # [num_entry_slots, D] fp32 / bf16 / fp16 (fp64 under the interpreter only)
    state_kv: torch.Tensor,  # [num_state_slots, coff * D], rows contiguous
    state_score: torch.Tensor,  # [num_state_slots, coff * D], rows contiguous
    gather: torch.Tensor,  # [R, coff * m] int32/int64, -1 = masked slot
    positions: torch.Tensor,  # [R] int32/int64
    write_slots: torch.Tensor,  # [R] int32/int64, -1 = no entry
    norm_weight: torch.Tensor,  # [D]
    cos_sin: torch.Tensor,  # [num_positions, rope_dim] fp32 (rope_cos_sin_table)
    *,
    ratio: int,
    eps: float,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Pool every block-completing row's window into its entry (module docstring), in place; one launch.

    `state_kv` / `state_score` may be column views of one [num_slots, 2 * coff * D]
    state cache (vLLM's `[kv | score]` rows). No host synchronisation.
    """
    import triton

    from .dsv4_compress import dsv4_compress_kernel

    device = out.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"the Triton compressor kernel needs CUDA tensors (got {device}); on CPU set "
                           f"TRITON_INTERPRET=1 before importing triton, or use dsv4_compress_reference")  # fmt: skip
    if out.dtype not in _FLOAT_OUT or out.dim() != 2 or out.stride(1) != 1:
        raise TypeError(f"out must be a row-contiguous [num_slots, D] float tensor, got {out.dtype} "
                        f"{tuple(out.shape)}")  # fmt: skip
    d = out.shape[1]
    coff = _coff(ratio, state_kv.shape[-1], d)
    if coff == 2 and ratio != 4:
        raise ValueError(f"overlapped (a/b) state rows are CSA's, whose ratio is 4; got ratio {ratio}")
    rope_dim = cos_sin.shape[-1]
    if d % 2 or rope_dim % 2 or rope_dim > d:
        raise ValueError(f"D = {d} and rope_dim = {rope_dim} must be even with rope_dim <= D")
    for name, t in (("state_kv", state_kv), ("state_score", state_score)):
        if t.dim() != 2 or t.shape[1] != coff * d or t.stride(1) != 1 or t.device != device:
            raise ValueError(f"{name} must be a [num_slots, {coff * d}] tensor with contiguous rows on {device}")
    if gather.dim() != 2 or gather.shape[1] != coff * ratio or gather.stride(1) != 1:
        raise ValueError(f"gather must be [R, coff * m] = [R, {coff * ratio}], rows contiguous")
    r = gather.shape[0]
    for name, t in (("gather", gather), ("positions", positions), ("write_slots", write_slots)):
        if t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise TypeError(f"{name} must be int32/int64 on {device}")
    if positions.shape != (r,) or write_slots.shape != (r,):
        raise ValueError(f"positions and write_slots must be [R] = [{r}]")
    if norm_weight.shape != (d,) or cos_sin.dim() != 2 or cos_sin.stride(1) != 1:
        raise ValueError(f"norm_weight must be [{d}] and cos_sin a row-contiguous [num_positions, rope_dim] table")
    if r == 0:
        return
    block_d = triton.next_power_of_2(d)
    g = coff * ratio
    if block_t is None:  # keep a [BLOCK_T, BLOCK_D] fp32 tile pair at ~16 K elements
        block_t = max(1, min(triton.next_power_of_2(g), 16384 // block_d))
    if num_warps is None:
        num_warps = 8 if block_d * block_t >= 8192 else 4
    dsv4_compress_kernel[(r,)](
        out, state_kv, state_score, gather, positions, write_slots, norm_weight, cos_sin, float(eps),
        out.stride(0), state_kv.stride(0), state_score.stride(0), gather.stride(0), cos_sin.stride(0),
        RATIO=ratio,
        COFF=coff,
        D=d,
        ROPE_DIM=rope_dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip


def compress_flops_bytes(num_entries: int, ratio: int, d: int, coff: int) -> tuple[float, int]:
    """Rough work of `num_entries` entries: (flops, bytes read + written) with fp32 state rows."""
    g = coff * ratio
    flops = num_entries * (g * d * 5 + d * 8)
    return float(flops), num_entries * (2 * g * d * 4 + d * 4)


__all__ = ["compress_flops_bytes", "dsv4_compress_reference", "dsv4_compress_triton", "rope_cos_sin_table"]
