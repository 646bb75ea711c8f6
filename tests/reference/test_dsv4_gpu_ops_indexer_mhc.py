"""The reference pack's indexer (DeepGEMM logits + schedule, top-k), o_proj and mHC ops against float64
formulas and their contracts (the stale-schedule failure, NaN past the lengths, top-k order, scale layouts)."""

import math

import pytest
import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import indexer, layout, mhc, moe_routing, o_proj
from vllm_tree_spec.reference.dsv4_gpu_ops.rope import rope_last

BS = 64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cos_sin(max_pos=512, theta=10000.0):
    inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = torch.arange(max_pos, dtype=torch.float64).unsqueeze(-1) * inv
    return torch.cat((f.cos(), f.sin()), -1).float()


def _index_cache(num_pages, seed=0):
    """An indexer key cache view inside interleaved blocks, filled with random keys; returns (view, keys fp32)."""
    stride = layout.page_bytes(BS, layout.INDEX_ROW_BYTES) + 500
    storage = torch.zeros(num_pages * stride, dtype=torch.uint8)
    view = torch.as_strided(storage, (num_pages, BS, layout.INDEX_ROW_BYTES), (stride, layout.INDEX_ROW_BYTES, 1))
    g = _gen(seed)
    k = torch.randn(num_pages * BS, 128, generator=g)
    exp = torch.ceil(torch.log2(k.abs().amax(-1, keepdim=True) / 448))
    vals = layout.quantize_e4m3(k, exp)
    layout.write_index_keys(view, torch.arange(num_pages * BS), BS, vals, torch.exp2(exp).squeeze(-1))
    deq = vals.view(torch.float8_e4m3fn).float() * torch.exp2(exp)
    return view, deq


# ---------------------------------------------------------------------------
# DeepGEMM paged MQA logits and its schedule


def _decode_inputs(seed=0):
    cache, keys = _index_cache(6, seed)
    g = _gen(seed + 1)
    b, next_n, h = 2, 2, 8
    q = (torch.randn(b, next_n, h, 128, generator=g) * 20).to(torch.float8_e4m3fn)
    w = torch.randn(b * next_n, h, generator=g)
    lens = torch.tensor([[70, 71], [3, 130]], dtype=torch.int32)
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    return cache, keys, q, w, lens, block_tables


def test_paged_mqa_logits_match_float64_through_page_tables():
    cache, keys, q, w, lens, bt = _decode_inputs()
    sched = indexer.get_paged_mqa_logits_metadata(lens, BS, 132)
    assert sched.shape == (133, 2) and sched.dtype == torch.int32
    logits = indexer.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(-2), w, lens, bt, sched, 256, False)
    for i in range(2):
        for j in range(2):
            r, n = i * 2 + j, int(lens[i, j])
            ks = torch.stack([keys[int(bt[i, k // BS]) * BS + k % BS] for k in range(n)]).double()
            ref = ((q[i, j].double() @ ks.t()).relu() * w[r].double().unsqueeze(-1)).sum(0)
            assert torch.allclose(logits[r, :n].double(), ref, rtol=1e-4, atol=1e-3)
            assert torch.isnan(logits[r, n:]).all()  # unspecified past the length (clean_logits=False)
    clean = indexer.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(-2), w, lens, bt, sched, 256, True)
    assert torch.isinf(clean[0, 70:]).all()


def test_paged_mqa_logits_refuse_a_stale_schedule():
    cache, keys, q, w, lens, bt = _decode_inputs()
    sched = indexer.get_paged_mqa_logits_metadata(lens, BS, 132)
    tree_lens = lens.clone()
    tree_lens[1, 0] = 2  # a tree row's depth length, set after the schedule was built
    with pytest.raises(indexer.StaleScheduleError, match="rebuild the schedule"):
        indexer.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(-2), w, tree_lens, bt, sched, 256, False)
    fresh = indexer.get_paged_mqa_logits_metadata(tree_lens, BS, 132)
    indexer.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(-2), w, tree_lens, bt, fresh, 256, False)
    with pytest.raises(ValueError, match="2-D"):
        indexer.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(-2), w, lens.view(-1), bt, sched, 256, False)


def test_schedule_splits_the_pages_across_slots():
    lens = torch.tensor([[130], [5], [64]], dtype=torch.int32)  # 3 + 1 + 1 pages
    sched = indexer.get_paged_mqa_logits_metadata(lens, BS, 4)
    assert sched[:4].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]] and sched[4, 0] == 3


def test_prefill_logits_and_local_topk():
    g = _gen(2)
    m, n, h = 4, 50, 4
    q = (torch.randn(m, h, 128, generator=g) * 10).to(torch.float8_e4m3fn)
    k = (torch.randn(n, 128, generator=g) * 10).to(torch.float8_e4m3fn)
    ks_scale = torch.rand(n, generator=g) + 0.5
    w = torch.randn(m, h, generator=g)
    ks = torch.tensor([0, 0, 20, 20], dtype=torch.int32)
    ke = torch.tensor([5, 12, 50, 21], dtype=torch.int32)
    logits = indexer.fp8_fp4_mqa_logits((q, None), (k, ks_scale), w, ks, ke, False)
    ref = ((torch.einsum("mhd,nd->mhn", q.double(), k.double()) * ks_scale.double()).relu()
           * w.double().unsqueeze(-1)).sum(1)
    for r in range(m):
        assert torch.allclose(logits[r, ks[r]:ke[r]].double(), ref[r, ks[r]:ke[r]], rtol=1e-4, atol=1e-3)
    out = torch.empty(m, 8, dtype=torch.int32)
    indexer.top_k_per_row_prefill(logits, ks, ke, out, m, logits.stride(0), logits.stride(1), 8)
    assert out[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]  # fewer than k valid: all of them, then -1
    top = torch.sort(ref[2, 20:50], descending=True, stable=True).indices[:8]
    assert out[2].tolist() == top.tolist()  # local to the row's range
    assert out[3].tolist() == [0] + [-1] * 7


def test_decode_topk_rows_ties_and_lengths():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 9.0, float("nan")],
                           [5.0, 4.0, float("nan"), 0.0, 0.0, 0.0]])
    seq_lens = torch.tensor([[5], [2]], dtype=torch.int32)
    out = torch.empty(2, 3, dtype=torch.int32)
    indexer.radix_topk(logits, seq_lens, out, torch.empty(1), 3, 5)
    assert out.tolist() == [[4, 1, 2], [0, 1, -1]]  # ties -> lower column; NaN past the length never read
    out2 = torch.empty(2, 3, dtype=torch.int32)
    indexer.top_k_per_row_decode(logits, 1, seq_lens.view(-1), out2, 2, logits.stride(0), logits.stride(1), 3)
    assert torch.equal(out, out2)
    bad = torch.tensor([[5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="NaN"):
        indexer.radix_topk(logits[1:], bad, torch.empty(1, 2, dtype=torch.int32), torch.empty(1), 2, 5)


def test_indexer_q_quant_folds_its_scale_into_the_weights():
    g = _gen(3)
    q = torch.randn(3, 4, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 7, 300])
    cs = _cos_sin()
    q8, wo = indexer.fused_indexer_q_rope_quant(pos, q, cs, w, 128 ** -0.5, 4 ** -0.5)
    roped = rope_last(q.float(), cs[pos].unsqueeze(1))
    roped = torch.cat((q.float()[..., :64], roped[..., 64:].to(torch.bfloat16).float()), -1)
    s = torch.exp2(torch.ceil(torch.log2(roped.abs().amax(-1) / 448)))
    assert torch.allclose(q8.float() * s.unsqueeze(-1), roped, rtol=0.07, atol=1e-2)
    assert torch.allclose(wo, w.float() * s * 128 ** -0.5 * 0.5, rtol=1e-6)


def test_cp_gather_copies_keys_in_request_order():
    cache, keys = _index_cache(3, 5)
    bt = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 70, 75], dtype=torch.int32)
    dst_k = torch.empty(75, 128, dtype=torch.float8_e4m3fn)
    dst_s = torch.empty(75, 4, dtype=torch.uint8)
    indexer.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, bt, cu)
    deq = dst_k.float() * dst_s.view(torch.float32)
    slots = [2 * BS + i for i in range(64)] + [i for i in range(6)] + [BS + i for i in range(5)]
    assert torch.equal(deq, keys[slots])


# ---------------------------------------------------------------------------
# o_proj: inverse RoPE + FP8 quantization, grouped FP8 einsum


@pytest.mark.parametrize("tma", [False, True])
def test_inverse_rope_quant_layout_and_values(tma):
    g = _gen(4)
    t, groups, hpg = 5, 2, 2
    cs = _cos_sin()
    pos = torch.tensor([0, 3, 9, 100, 511])
    x = torch.randn(t, groups * hpg, 512, generator=g)
    o = rope_last(x, cs[pos].unsqueeze(1)).to(torch.bfloat16)  # attention output carries RoPE
    out, scales = o_proj.fused_inv_rope_fp8_quant(o, pos, cs, groups, hpg, tma_aligned_scales=tma)
    assert out.shape == (t, groups, hpg * 512) and out.dtype == torch.float8_e4m3fn
    assert out.transpose(0, 1).is_contiguous()  # a [G, T, D] buffer
    if tma:
        assert scales.dtype == torch.int32 and scales.shape == (t, groups, hpg * 512 // 512)
        s = torch.exp2(scales.contiguous().view(torch.uint8).float() - 127)
    else:
        assert scales.dtype == torch.float32 and scales.shape == (t, groups, hpg * 4)
        assert scales.stride() == (1, 8 * 8, 8)  # [G, 8 blocks, align4(T) = 8] underneath
        s = scales
    deq = out.float() * s.repeat_interleave(128, -1)
    back = deq.reshape(t, groups * hpg, 512)
    assert torch.allclose(back, rope_last(o.float(), cs[pos].unsqueeze(1), inverse=True), rtol=0.07, atol=0.05)
    plain, empty = o_proj.fused_inv_rope_fp8_quant(o, pos, cs, groups, hpg, quantize=False)
    assert plain.dtype == torch.bfloat16 and empty.numel() == 0
    assert torch.allclose(plain.float().reshape(t, -1, 512), x, atol=5e-2)  # inverse RoPE undoes the rotation


def test_fp8_einsum_matches_float64():
    g = _gen(5)
    t, groups, k, d = 3, 2, 256, 128
    a = (torch.randn(t, groups, k, generator=g) * 50).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-6, 3, (t, groups, k // 128), generator=g).float())
    w = (torch.randn(groups, d, k, generator=g) * 50).to(torch.float8_e4m3fn)
    sw = torch.exp2(torch.randint(-9, -3, (groups, d // 128, k // 128), generator=g).float())
    z = torch.empty(t, groups, d, dtype=torch.bfloat16)
    o_proj.fp8_einsum("bhr,hdr->bhd", (a, sa), (w, sw), z)
    ref = torch.einsum("bhr,hdr->bhd", a.double() * sa.double().repeat_interleave(128, -1),
                       w.double() * sw.double().repeat_interleave(128, 1).repeat_interleave(128, -1))
    assert torch.allclose(z.double(), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(NotImplementedError):
        o_proj.fp8_einsum("bhd,hdr->bhr", (a, sa), (w, sw), z)


# ---------------------------------------------------------------------------
# mHC


def _mhc_inputs(seed=6, t=3, hc=4, h=64):
    g = _gen(seed)
    res = torch.randn(t, hc, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc * (2 + hc), hc * h, generator=g) * 0.05
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(hc * (2 + hc), generator=g) * 0.1
    return res, fn, scale, base


def _pre64(res, fn, scale, base, rms_eps, pre_eps, sk_eps, post_mult, repeat):
    t, hc, h = res.shape
    x = res.double().reshape(t, -1)
    mixes = (x @ fn.double().t()) / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + pre_eps
    post = torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]) * post_mult
    c = torch.softmax(mixes[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), -1) + sk_eps
    c = c / (c.sum(-2, keepdim=True) + sk_eps)
    for _ in range(repeat - 1):
        c = c / (c.sum(-1, keepdim=True) + sk_eps)
        c = c / (c.sum(-2, keepdim=True) + sk_eps)
    return pre, post, c


def test_mhc_pre_post_fused_head_match_float64():
    res, fn, scale, base = _mhc_inputs()
    args = (1e-6, 1e-6, 1e-6, 2.0, 20)
    nw = (torch.rand(64, generator=_gen(7)) + 0.5).to(torch.bfloat16)
    post, comb, li = mhc.mhc_pre_tilelang(res, fn, scale, base, *args, norm_weight=nw, norm_eps=1e-6)
    pre64, post64, comb64 = _pre64(res, fn, scale.double(), base.double(), *args)
    assert torch.allclose(post.squeeze(-1).double(), post64, atol=1e-5)
    assert torch.allclose(comb.double(), comb64, atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(3, 4), atol=1e-4)  # Sinkhorn ends column-normalized
    col = (pre64.unsqueeze(-1) * res.double()).sum(1)
    ref_li = col / torch.sqrt(col.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    assert torch.allclose(li.double(), ref_li, rtol=2e-2, atol=2e-2)
    x = torch.randn(3, 64, generator=_gen(8)).to(torch.bfloat16)
    out = mhc.mhc_post_tilelang(x, res, post, comb)
    ref_out = torch.einsum("tij,tih->tjh", comb.double(), res.double()) + post.double() * x.double().unsqueeze(1)
    assert torch.allclose(out.double(), ref_out, rtol=1e-2, atol=2e-2)
    r2, p2, c2, l2 = mhc.mhc_fused_post_pre_tilelang(x, res, post, comb, fn, scale, base, *args, norm_weight=nw)
    assert torch.equal(r2, out)
    p3, c3, l3 = mhc.mhc_pre_tilelang(r2, fn, scale, base, *args, norm_weight=nw)
    # the fused kernel's GEMM reads the fp32 post output, the separate pre the bf16 copy: bf16-level agreement
    assert torch.allclose(p2, p3, atol=5e-3) and torch.allclose(c2, c3, atol=5e-3)
    head_fn = torch.randn(4, 4 * 64, generator=_gen(9)) * 0.05
    head = mhc.hc_head_fused_kernel_tilelang(res, head_fn, scale[:1], base[:4], 1e-6, 1e-6)
    x64 = res.double().reshape(3, -1)
    mixes = (x64 @ head_fn.double().t()) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mixes * scale[0].double() + base[:4].double()) + 1e-6
    assert torch.allclose(head.double(), (pre.unsqueeze(-1) * res.double()).sum(1), rtol=1e-2, atol=2e-2)


def test_mhc_broadcast_equals_pre_on_the_repeated_residual():
    res, fn, scale, base = _mhc_inputs()
    x = res[:, 0]
    fn_b = fn.view(fn.shape[0], 4, 64).sum(1)
    nw = torch.ones(64, dtype=torch.bfloat16)
    r, post, comb, li = mhc.mhc_pre_broadcast_tilelang(x, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20,
                                                       norm_weight=nw, fn_broadcast=fn_b)
    assert torch.equal(r, x.unsqueeze(1).expand(-1, 4, -1))
    p2, c2, l2 = mhc.mhc_pre_tilelang(r, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20, norm_weight=nw)
    assert torch.allclose(post, p2, atol=1e-5) and torch.allclose(comb, c2, atol=1e-5)
    assert torch.allclose(li.float(), l2.float(), atol=1e-2)
    with pytest.raises(ValueError, match="norm_weight"):
        mhc.mhc_pre_broadcast_tilelang(x, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20, fn_broadcast=fn_b)


def test_moe_routing():
    logits = torch.tensor([[0.0, 1.0, 1.0, -2.0, 30.0]])
    bias = torch.tensor([0.0, 0.5, 0.5, 5.0, 0.0])
    w, ids = moe_routing.biased_topk_cpu(logits, logits, bias, 3, True, "sqrtsoftplus", 0, 1.5, True)
    sp = torch.sqrt(torch.nn.functional.softplus(logits[0].double()))
    sp[4] = math.sqrt(30.0)
    assert ids.tolist() == [[4, 3, 1]]  # the bias steers selection (3 beats 1 and 2); ties -> lower id (1)
    assert torch.allclose(w[0].double(), sp[[4, 3, 1]] / sp[[4, 3, 1]].sum() * 1.5)  # unbiased weights
    w2, ids2 = moe_routing.hash_topk_cpu(logits, torch.tensor([[2, 0, 4]]), 3, "sqrtsoftplus", 0, 5, 1.0)
    assert ids2.tolist() == [[2, 0, 4]] and torch.allclose(w2.sum(), torch.tensor(1.0))
