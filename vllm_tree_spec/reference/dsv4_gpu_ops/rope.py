"""GPT-J (interleaved-pair) RoPE on the last 64 channels from vLLM's float32 cos_sin_cache, as the V4 kernels apply it.

cos_sin_cache [max_pos, 64] float32 holds [cos(32) | sin(32)] per position
(`DeepseekV4ScalingRotaryEmbedding._compute_cos_sin_cache`). Pair p = (x[2p], x[2p+1]) of the rotated part is
rotated by angle p: (e c - o s, e s + o c). All arithmetic in float32, as in the CUDA and Triton kernels.
"""

from __future__ import annotations

import torch


def rope_last(x: torch.Tensor, cos_sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """x [..., D] float32; cos_sin [..., 64] float32, broadcastable to x's leading dims (add head dims first)."""
    rope_dim = cos_sin.shape[-1]
    half = rope_dim // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    new_even = even * cos - odd * sin
    new_odd = even * sin + odd * cos
    return torch.cat((nope, torch.stack((new_even, new_odd), dim=-1).flatten(-2)), dim=-1)


def cos_sin_at(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, 64] float32 rows of the cache at positions [N] (int)."""
    if cos_sin_cache.dtype != torch.float32:
        raise TypeError(f"the V4 kernels read cos_sin_cache as float32, got {cos_sin_cache.dtype}")
    return cos_sin_cache.index_select(0, positions.to(torch.int64))
