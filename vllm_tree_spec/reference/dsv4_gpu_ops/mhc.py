"""The mHC (manifold hyper-connection) ops of vLLM 0.32's NVIDIA DeepSeek-V4 model (TileLang kernels,
`vllm/model_executor/kernels/mhc/tilelang.py`; callers: `vllm/models/deepseek_v4/nvidia/model.py`
`DeepseekV4DecoderLayer.forward` and `DeepseekV4Model.forward`).

The residual stream is hc = hc_mult copies [T, hc, H] bf16. With x = residual flattened to [T, hc * H] fp32:

    mixes  = (x @ fn.T) * rsqrt(sum(x^2) / (hc * H) + rms_eps)          fn [hc * (2 + hc), hc * H] fp32
    pre    = sigmoid(mixes[:hc] * s0 + base[:hc]) + hc_pre_eps          [T, hc]
    post   = sigmoid(mixes[hc:2hc] * s1 + base[hc:2hc]) * post_mult     [T, hc]  (returned [T, hc, 1])
    comb   = softmax_rows(mixes[2hc:] * s2 + base[2hc:]) + sinkhorn_eps, then column-normalize
             (c / (colsum + eps)), then (repeat - 1) x (row-normalize, column-normalize)     [T, hc, hc]
    layer_input = sum_i pre_i * residual_i  (fp32, rounded to bf16); with norm_weight: that bf16 value
             * rsqrt(mean(unrounded^2) + norm_eps) * norm_weight, rounded to bf16

    post block: out_j = post_j * x_layer + sum_i comb[i, j] * residual_i   (fp32, stored bf16)
    head:  out = sum_i (sigmoid(mixes_i * s0 + base_i) + hc_eps) * residual_i, with fn [hc, hc * H]

The GPU computes x @ fn.T with DeepGEMM's TF32 GEMM (or TileLang); this reference uses float32 (documented
difference: TF32 inputs carry 10 mantissa bits). `mhc_fused_post_pre_tilelang`'s fused kernel feeds the
GEMM the fp32 post-block output and stores it as bf16; the pre block then reads the bf16 copy.
"""

from __future__ import annotations

import torch


def _check(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor) -> None:
    if residual.dtype != torch.bfloat16:
        raise TypeError(f"residual must be bfloat16, got {residual.dtype}")
    for name, t in (("fn", fn), ("hc_scale", hc_scale), ("hc_base", hc_base)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")


def _mixes(x: torch.Tensor, fn: torch.Tensor, rms_numel: int, rms_eps: float) -> torch.Tensor:
    """x [T, K] fp32 -> fn-projected, RMS-scaled mixes [T, n_out]."""
    return (x @ fn.t()) * torch.rsqrt(x.square().sum(-1, keepdim=True) / rms_numel + rms_eps)


def _sinkhorn(logits: torch.Tensor, eps: float, repeat: int) -> torch.Tensor:
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _pre_from_mixes(mixes, residual, hc_scale, hc_base, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                    sinkhorn_repeat, norm_weight, norm_eps):
    """mixes [T, hc3] fp32, residual [T, hc, H] bf16 -> (post [T, hc, 1], comb [T, hc, hc], layer_input [T, H])."""
    t, hc, _ = residual.shape
    pre = torch.sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_pre_eps
    post = torch.sigmoid(mixes[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc]) * hc_post_mult_value
    comb_logits = mixes[:, 2 * hc:].view(t, hc, hc) * hc_scale[2] + hc_base[2 * hc:].view(1, hc, hc)
    comb = _sinkhorn(comb_logits, hc_sinkhorn_eps, sinkhorn_repeat)
    collapsed = (pre.unsqueeze(-1) * residual.float()).sum(dim=1)  # [T, H] fp32
    rounded = collapsed.to(torch.bfloat16)
    if norm_weight is None:
        layer_input = rounded
    else:
        rrms = torch.rsqrt(collapsed.square().mean(-1, keepdim=True) + norm_eps)
        layer_input = (rounded.float() * rrms * norm_weight.to(torch.bfloat16).float()).to(torch.bfloat16)
    return post.unsqueeze(-1), comb, layer_input


def mhc_pre_tilelang(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                     rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                     sinkhorn_repeat: int, n_splits: int = 1, norm_weight: torch.Tensor | None = None,
                     norm_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual [..., hc, H] bf16 -> (post [..., hc, 1] fp32, comb [..., hc, hc] fp32, layer_input [..., H] bf16)."""
    _check(residual, fn, hc_scale, hc_base)
    hc, h = residual.shape[-2:]
    if fn.shape != (hc * (2 + hc), hc * h):
        raise ValueError(f"fn must be [{hc * (2 + hc)}, {hc * h}], got {tuple(fn.shape)}")
    outer = residual.shape[:-2]
    r = residual.reshape(-1, hc, h)
    mixes = _mixes(r.reshape(r.shape[0], hc * h).float(), fn, hc * h, rms_eps)
    post, comb, li = _pre_from_mixes(mixes, r, hc_scale, hc_base, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                     sinkhorn_repeat, norm_weight, norm_eps)
    return post.view(*outer, hc, 1), comb.view(*outer, hc, hc), li.view(*outer, h)


def mhc_pre_broadcast_tilelang(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor,
                               hc_base: torch.Tensor, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                               hc_post_mult_value: float, sinkhorn_repeat: int, n_splits: int = 1,
                               norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                               fn_broadcast: torch.Tensor | None = None):
    """First layer: residual [T, H] bf16 broadcast to hc copies; fn_broadcast [hc3, H] = fn summed over copies.
    -> (residual_out [T, hc, H] bf16, post [T, hc, 1], comb [T, hc, hc], layer_input [T, H] bf16)."""
    if norm_weight is None:
        raise ValueError("broadcast mHC pre requires the fused RMSNorm (norm_weight)")
    if fn_broadcast is None:
        raise ValueError("broadcast mHC pre requires fn_broadcast")
    _check(residual, fn, hc_scale, hc_base)
    if residual.dim() != 2:
        raise ValueError(f"broadcast mHC pre takes residual [T, H], got {tuple(residual.shape)}")
    t, h = residual.shape
    hc = fn.shape[1] // h
    if fn_broadcast.shape != (hc * (2 + hc), h):
        raise ValueError(f"fn_broadcast must be [{hc * (2 + hc)}, {h}], got {tuple(fn_broadcast.shape)}")
    mixes = _mixes(residual.float(), fn_broadcast, h, rms_eps)
    r = residual.unsqueeze(1).expand(t, hc, h).contiguous()
    post, comb, li = _pre_from_mixes(mixes, r, hc_scale, hc_base, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                     sinkhorn_repeat, norm_weight, norm_eps)
    return r, post, comb, li


def _post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
          comb_res_mix: torch.Tensor) -> torch.Tensor:
    """-> fp32 [..., hc, H]: out_j = post_j * x + sum_i comb[i, j] * residual_i."""
    hc = residual.shape[-2]
    post = post_layer_mix.reshape(*residual.shape[:-2], hc, 1).float()
    mixed = torch.einsum("...ij,...ih->...jh", comb_res_mix.float(), residual.float())
    return mixed + post * x.unsqueeze(-2).float()


def mhc_post_tilelang(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                      comb_res_mix: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16, residual [T, hc, H] bf16, post [T, hc, 1], comb [T, hc, hc] -> [T, hc, H] bf16."""
    return _post(x, residual, post_layer_mix, comb_res_mix).to(residual.dtype)


def mhc_fused_post_pre_tilelang(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
                                comb_res_mix: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor,
                                hc_base: torch.Tensor, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
                                hc_post_mult_value: float, sinkhorn_repeat: int, n_splits: int = 1, tile_n: int = 1,
                                norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6):
    """Post block then the next pre block -> (residual_cur [..., hc, H] bf16, post [..., hc, 1], comb, layer_input)."""
    _check(residual, fn, hc_scale, hc_base)
    if x.dtype != torch.bfloat16 or post_layer_mix.dtype != torch.float32 or comb_res_mix.dtype != torch.float32:
        raise TypeError("x must be bfloat16 and post_layer_mix / comb_res_mix float32")
    hc, h = residual.shape[-2:]
    outer = residual.shape[:-2]
    new_r = _post(x, residual, post_layer_mix, comb_res_mix).reshape(-1, hc, h)  # fp32
    residual_cur = new_r.to(torch.bfloat16)
    mixes = _mixes(new_r.reshape(-1, hc * h), fn, hc * h, rms_eps)  # the fused kernel's GEMM sees fp32 new_r
    post, comb, li = _pre_from_mixes(mixes, residual_cur, hc_scale, hc_base, hc_pre_eps, hc_sinkhorn_eps,
                                     hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps)
    return (residual_cur.view(*outer, hc, h), post.view(*outer, hc, 1), comb.view(*outer, hc, hc),
            li.view(*outer, h))


def hc_head_fused_kernel_tilelang(hs_flat: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor,
                                  hc_base: torch.Tensor, rms_eps: float, hc_eps: float) -> torch.Tensor:
    """hs_flat [T, hc, H] bf16, fn [hc, hc * H] -> [T, H] bf16."""
    _check(hs_flat, fn, hc_scale, hc_base)
    t, hc, h = hs_flat.shape
    x = hs_flat.reshape(t, hc * h).float()
    mixes = _mixes(x, fn, hc * h, rms_eps)
    pre = torch.sigmoid(mixes * hc_scale[0] + hc_base) + hc_eps
    return (pre.unsqueeze(-1) * hs_flat.float()).sum(dim=1).to(torch.bfloat16)
