"""Triton kernel for DeepSeek-V4's compressor pooling along tree paths (`@triton.jit` code only).

The typed launcher `dsv4_compress_triton`, whose docstring states the math, and
its PyTorch twin `dsv4_compress_reference` are in
`vllm_tree_spec.kernels.dsv4_compress_launch`. The math is
`vllm_tree_spec.reference.dsv4.Compressor.pool`.

One program per query row. A row whose position t completes a block
((t + 1) % m == 0) and has an output slot pools its pooling window -- the
coff * m state rows named by its gather list (oldest first; built along the
row's ancestor path by `tree_window_slots_*(align="position")`, so committed
rows and the ancestors' scratch rows mix freely) -- into one entry:

    CSA (coff = 2): slots 0..m-1 take the a half [0, D) of their row (block w - 1),
                    slots m..2m-1 the b half [D, 2D) (block w)
    HCA (coff = 1): slots 0..m-1, the whole row
    per channel:    softmax over slots of the gate logits (Z + ape), weights x values, summed
    then            RMSNorm over D (weight), RoPE at the block start t + 1 - m on the last
                    ROPE_DIM channels (interleaved pairs, cos/sin from a table)

The softmax is streamed over BLOCK_T slots at a time (online max / rescale, fp32),
so HCA's 128-slot windows never sit in registers whole; the D channels of one
entry stay in one program because RMSNorm needs all of them. Every other row
returns at once (vLLM's compress kernels do the same).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_out", "stride_kv", "stride_score", "stride_gather", "stride_cs"])
def dsv4_compress_kernel(
    out_ptr,  # [num_entry_slots, D] entries (fp32 / bf16 / fp16)
    kv_ptr,  # [num_state_slots, COFF * D] state value rows C_j ([a | b] halves for CSA)
    score_ptr,  # [num_state_slots, COFF * D] state gate rows Z_j + ape[j % m]
    gather_ptr,  # [R, COFF * RATIO] state slots of each row's pooling window, oldest first, -1 = none
    positions_ptr,  # [R] position t of each row
    write_ptr,  # [R] entry slot the row writes, -1 = none
    norm_weight_ptr,  # [D] RMSNorm weight
    cos_sin_ptr,  # [num_positions, ROPE_DIM] fp32: cos of the ROPE_DIM / 2 pairs, then their sin
    eps,
    stride_out,
    stride_kv,
    stride_score,
    stride_gather,
    stride_cs,
    RATIO: tl.constexpr,  # m
    COFF: tl.constexpr,  # 2 = CSA (overlapped a/b halves), 1 = HCA
    D: tl.constexpr,  # entry width (512 main, 128 indexer)
    ROPE_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # pooling slots per step
    BLOCK_D: tl.constexpr,  # next_pow2(D)
):
    r = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + r).to(tl.int64)
    dst = tl.load(write_ptr + r).to(tl.int64)
    if (((pos + 1) % RATIO) != 0) | (dst < 0):
        return
    G: tl.constexpr = COFF * RATIO
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for t0 in tl.static_range(0, G, BLOCK_T):
        ti = t0 + tl.arange(0, BLOCK_T)
        slot = tl.load(gather_ptr + r * stride_gather + ti, mask=ti < G, other=-1).to(tl.int64)
        valid = slot >= 0
        if COFF == 2:
            col = tl.where(ti >= RATIO, D, 0)  # b half for the own block, a half for the previous one
        else:
            col = ti * 0
        msk = valid[:, None] & d_ok[None, :]
        kv = tl.load(kv_ptr + slot[:, None] * stride_kv + col[:, None] + offs_d[None, :], mask=msk, other=0.0)
        sc = tl.load(score_ptr + slot[:, None] * stride_score + col[:, None] + offs_d[None, :], mask=msk,
                     other=float("-inf"))  # fmt: skip
        kv = kv.to(tl.float32)
        sc = sc.to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(sc, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # channels that have seen nothing yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(sc - m_use[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p * kv, 0)
        m_i = m_new
    pooled = acc / tl.where(l_i > 0, l_i, 1.0)  # [BLOCK_D]; padding channels (l = acc = 0) stay 0

    # RMSNorm over the D real channels
    w = tl.load(norm_weight_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    ms = tl.sum(pooled * pooled, 0) / D
    y = pooled * tl.rsqrt(ms + eps) * w

    # RoPE at the block start on the last ROPE_DIM channels: pairs (2q, 2q + 1), q >= (D - ROPE_DIM) / 2
    block_start = pos + 1 - RATIO
    ev, od = tl.split(tl.reshape(y, [BLOCK_D // 2, 2]))
    q = tl.arange(0, BLOCK_D // 2)
    is_rope = (q >= (D - ROPE_DIM) // 2) & (q < D // 2)
    i = tl.where(is_rope, q - (D - ROPE_DIM) // 2, 0)
    cos = tl.load(cos_sin_ptr + block_start * stride_cs + i, mask=is_rope, other=1.0)
    sin = tl.load(cos_sin_ptr + block_start * stride_cs + ROPE_DIM // 2 + i, mask=is_rope, other=0.0)
    out = tl.reshape(tl.join(ev * cos - od * sin, ev * sin + od * cos), [BLOCK_D])
    tl.store(out_ptr + dst * stride_out + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
