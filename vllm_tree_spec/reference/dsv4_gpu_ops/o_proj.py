"""DeepSeek-V4's output projection on the NVIDIA path: inverse RoPE + FP8 quantization of the attention output,
then DeepGEMM's grouped FP8 einsum with `wo_a` (caller: `vllm/models/deepseek_v4/nvidia/ops/o_proj.py`
`deep_gemm_fp8_o_proj`; `wo_b` is an ordinary linear afterwards).

`fused_inv_rope_fp8_quant(o [T, H, 512] bf16, positions, cos_sin_cache, n_groups, heads_per_group, ...)`
(a Triton kernel, `common/ops/fused_inv_rope_fp8_quant.py`): per head, GPT-J RoPE by -position on the last 64
channels (fp32); without quantization the result is stored in o's dtype; with it, per 128 values
s = 2^ceil(log2(max(amax, 1e-10) / 448)) and e4m3(clamp(x / s, +-448)). Returns ([T, G, hpg * 512] view of a
[G, T, D] buffer, scales [T, G, D / 128] view of a [G, D / 128, align4(T)] float32 buffer (SM90), or UE8M0
bytes packed four per int32 [T, G, D / 512] over [G, D / 512, align4(T)] (SM100)).

`fp8_einsum("bhr,hdr->bhd", ...)`:

    z[b, h, d] = sum_r (A[b, h, r] * sa[b, h, r // 128]) * (W[h, d, r] * sw[h, d // 128, r // 128])

A [tokens, groups, group_in] e4m3 with scales sa [tokens, groups, group_in / 128] (SM90 recipe (1, 128, 128):
float32; SM100 recipe (1, 1, 128): UE8M0 packed four per int32); W [groups, o_lora, group_in] e4m3 with
128 x 128 block scales sw. The GPU accumulates each 128-wide K block in the tensor cores' fp32 and applies
the scales per block; this reference computes in float32 from the dequantized operands. Output bf16 into z.
"""

from __future__ import annotations

import torch

from vllm_tree_spec.reference.dsv4_gpu_ops.rope import cos_sin_at, rope_last


def _align4(n: int) -> int:
    return -(-n // 4) * 4


def fused_inv_rope_fp8_quant(o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, n_groups: int,
                             heads_per_group: int, nope_dim: int = 448, rope_dim: int = 64,
                             quant_group_size: int = 128, tma_aligned_scales: bool = False,
                             quantize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d_head = o.shape
    if h != n_groups * heads_per_group or d_head != nope_dim + rope_dim or d_head % quant_group_size:
        raise ValueError(f"o {tuple(o.shape)} does not match {n_groups} groups x {heads_per_group} heads of "
                         f"{nope_dim} + {rope_dim} channels in {quant_group_size}-blocks")
    d = heads_per_group * d_head
    x = rope_last(o.float(), cos_sin_at(cos_sin_cache, positions[:t]).unsqueeze(1), inverse=True)  # [T, H, 512]
    x = x.view(t, n_groups, d)
    if not quantize:
        buf = torch.empty(n_groups, t, d, dtype=o.dtype, device=o.device)
        buf.copy_(x.transpose(0, 1))
        return buf.transpose(0, 1), torch.empty(0, dtype=torch.int32 if tma_aligned_scales else torch.float32)
    nb = d // quant_group_size
    blocks = x.view(t, n_groups, nb, quant_group_size)
    amax = blocks.abs().amax(-1).clamp(min=1e-10)
    scales = torch.exp2(torch.ceil(torch.log2(amax * torch.tensor(1.0 / 448.0, dtype=torch.float32))))
    q = torch.clamp(blocks / scales.unsqueeze(-1), -448.0, 448.0).to(torch.float8_e4m3fn).view(t, n_groups, d)
    buf = torch.empty(n_groups, t, d, dtype=torch.float8_e4m3fn, device=o.device)
    buf.copy_(q.transpose(0, 1))
    ta = _align4(t)
    if tma_aligned_scales:
        if (d_head // quant_group_size) % 4:
            raise ValueError("packed UE8M0 scales need a multiple of 4 blocks per head")
        codes = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).view(t, n_groups, nb // 4, 4)
        packed = (codes << (torch.arange(4, device=o.device, dtype=torch.int32) * 8)).sum(-1).to(torch.int32)
        inner = nb // 4
        sbuf = torch.zeros(n_groups * inner * ta, dtype=torch.int32, device=o.device)
        sview = sbuf.as_strided((n_groups, t, inner), (inner * ta, 1, ta))
        sview.copy_(packed.transpose(0, 1))
    else:
        inner = nb
        sbuf = torch.zeros(n_groups * inner * ta, dtype=torch.float32, device=o.device)
        sview = sbuf.as_strided((n_groups, t, inner), (inner * ta, 1, ta))
        sview.copy_(scales.transpose(0, 1))
    return buf.transpose(0, 1), sview.transpose(0, 1)


def _unpack_ue8m0(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [..., ceil(n / 4)] (four UE8M0 bytes each, little-endian) -> float32 [..., n]."""
    b = packed.contiguous().view(torch.uint8).reshape(*packed.shape[:-1], -1)[..., :n]
    return torch.exp2(b.to(torch.float32) - 127.0)


def fp8_einsum(equation: str, a: tuple, w: tuple, out: torch.Tensor, recipe: tuple = (1, 128, 128)) -> torch.Tensor:
    if equation != "bhr,hdr->bhd":
        raise NotImplementedError(f"only DeepSeek-V4's o_proj einsum 'bhr,hdr->bhd' is emulated, got {equation!r}")
    a_vals, a_scale = a
    w_vals, w_scale = w
    if a_vals.dtype != torch.float8_e4m3fn or w_vals.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_einsum takes e4m3 operands, got {a_vals.dtype} and {w_vals.dtype}")
    tokens, groups, k = a_vals.shape
    if w_vals.dim() != 3 or w_vals.shape[0] != groups or w_vals.shape[2] != k:
        raise ValueError(f"W must be [groups={groups}, d, {k}], got {tuple(w_vals.shape)}")
    d = w_vals.shape[1]
    kb = k // 128
    if a_scale.dtype == torch.int32:
        sa = _unpack_ue8m0(a_scale, kb)
    else:
        sa = a_scale.float()
    sa = sa.reshape(tokens, groups, kb)
    if w_scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        sw = torch.exp2(w_scale.view(torch.uint8).to(torch.float32) - 127.0)
    else:
        sw = w_scale.float()
    sw = sw.reshape(groups, -(-d // 128), kb)
    a_deq = a_vals.float() * sa.repeat_interleave(128, dim=-1)[..., :k]
    w_deq = w_vals.float() * sw.repeat_interleave(128, dim=1)[:, :d].repeat_interleave(128, dim=-1)[..., :k]
    result = torch.einsum("bhr,hdr->bhd", a_deq, w_deq)
    out.copy_(result.to(out.dtype))
    return out
