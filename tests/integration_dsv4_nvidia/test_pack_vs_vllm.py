"""The reference pack against vLLM's own kernels that run here: its Triton kernels in Triton's interpreter
(the same source the GPU compiles) and its PyTorch references.

* the window-KV FP8 bytes of the fused q-norm/RoPE/KV insert equal vLLM's Triton quantize-and-insert applied to
  the RoPE'd bf16 row (vLLM's own CUDA test checks the CUDA op the same way);
* the paged gather-dequantize, the partial-state save, the inverse-RoPE FP8 quantization of o_proj (both scale
  layouts) and the indexer q quantization equal vLLM's Triton kernels byte for byte;
* the compressor (C4 and C128 at head 512, the indexer at head 128) equals vLLM's Triton compressor (the
  non-CuTeDSL path) on every stored entry;
* the mHC ops equal vLLM's PyTorch references (`model_executor/kernels/mhc/torch.py`).
"""

import sys

import pytest
import torch

from vllm_tree_spec.reference.dsv4_gpu_ops import compressor, indexer, layout, mhc, o_proj, qnorm_rope_kv_insert

pytestmark = pytest.mark.vllm
BS = 64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cos_sin(max_pos=1024, theta=160000.0):
    inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = torch.arange(max_pos, dtype=torch.float64).unsqueeze(-1) * inv
    return torch.cat((f.cos(), f.sin()), -1).float()


def _pages(num_pages, row_bytes=layout.ROW_BYTES, extra=1000):
    stride = layout.page_bytes(BS, row_bytes) + extra
    storage = torch.zeros(num_pages * stride, dtype=torch.uint8)
    return storage, torch.as_strided(storage, (num_pages, BS, row_bytes), (stride, row_bytes, 1))


def test_kv_insert_bytes_equal_vllm_triton_quantizer():
    from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

    from vllm_tree_spec.reference.dsv4_gpu_ops.rope import rope_last

    g = _gen(0)
    n = 12
    q = torch.randn(n, 8, 512, generator=g).to(torch.bfloat16)
    kv = (torch.randn(n, 512, generator=g) * torch.logspace(-2, 1, n).unsqueeze(-1)).to(torch.bfloat16)
    pos = torch.randint(0, 1000, (n,), generator=g)
    cs = _cos_sin()
    slots = torch.randperm(3 * BS, generator=g)[:n]
    ours_storage, ours = _pages(3)
    qnorm_rope_kv_insert.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, ours.flatten(1), slots, pos, cs, 8, 1e-6, BS)
    theirs_storage, theirs = _pages(3)
    roped = rope_last(kv.float(), cs[pos]).to(torch.bfloat16)
    quantize_and_insert_k_cache(roped, theirs.flatten(1), slots, block_size=BS)
    assert torch.equal(ours_storage, theirs_storage)


def test_dequantize_gather_equals_vllm_triton():
    from vllm.models.deepseek_v4.common.ops.cache_utils import dequantize_and_gather_k_cache

    storage, cache = _pages(4)
    rows = torch.randn(4 * BS, 512, generator=_gen(1)).to(torch.bfloat16).float()
    data, scale = layout.quantize_rows(rows, reciprocal=False)
    layout.write_rows(cache, torch.arange(4 * BS), BS, data, scale)
    seq_lens = torch.tensor([70, 5, 140], dtype=torch.int32)
    gather = torch.tensor([20, 5, 9], dtype=torch.int32)
    bt = torch.tensor([[3, 1, 0], [2, 0, 0], [1, 3, 2]], dtype=torch.int32)
    for lens, sl in ((gather, seq_lens), (None, torch.tensor([70, 5, 3], dtype=torch.int32))):
        ours = torch.zeros(3, 160, 512, dtype=torch.bfloat16)
        theirs = torch.zeros(3, 160, 512, dtype=torch.bfloat16)
        layout.dequantize_and_gather_k_cache(ours, cache, sl, lens, bt, BS, 7)
        dequantize_and_gather_k_cache(theirs, cache, sl, lens, bt, BS, 7)
        assert torch.equal(ours, theirs)


class _Meta:
    def __init__(self, slot_mapping):
        self.slot_mapping = slot_mapping


@pytest.mark.parametrize("ratio,head", [(4, 512), (128, 512), (4, 128)])
def test_compressor_equals_vllm_triton(ratio, head):
    from vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache import compress_norm_rope_store_triton

    g = _gen(2)
    overlap = ratio == 4
    sw = (2 if overlap else 1) * head
    state_bs = 4 if ratio == 4 else 8
    n = 2 * ratio + 4
    nblk = -(-n // state_bs) + 1
    state = torch.randn(nblk, state_bs, 2 * sw, generator=g)
    bt = torch.randperm(nblk, generator=g).view(1, -1).to(torch.int32)
    pos = torch.arange(n)
    emit = [p for p in range(n) if (p + 1) % ratio == 0]
    kv_slots = torch.full((n,), -1, dtype=torch.int64)
    for j, p in enumerate(emit):
        kv_slots[p] = 3 * j + 1
    row_bytes = layout.ROW_BYTES if head == 512 else layout.INDEX_ROW_BYTES
    w = (torch.rand(head, generator=g) + 0.5).to(torch.bfloat16)
    args = dict(state_cache=state, num_actual=n, token_to_req_indices=torch.zeros(n, dtype=torch.int32),
                positions=pos, slot_mapping=pos.clone(), block_table=bt, block_size=state_bs, state_width=sw,
                cos_sin_cache=_cos_sin(), k_cache_metadata=_Meta(kv_slots), pdl_kwargs={}, head_dim=head,
                rope_head_dim=64, compress_ratio=ratio, overlap=overlap, use_fp4_cache=False, rms_norm_weight=w,
                rms_norm_eps=1e-6, quant_block=64 if head == 512 else 128,
                token_stride=576 if head == 512 else 128, scale_dim=8 if head == 512 else 4)
    ours_storage, ours = _pages(2, row_bytes)
    theirs_storage, theirs = _pages(2, row_bytes)
    compressor.compress_norm_rope_store(kv_cache=ours, **args)
    compress_norm_rope_store_triton(kv_cache=theirs, **args)
    assert torch.equal(ours_storage, theirs_storage)


def test_save_partial_states_equals_vllm_triton():
    import fast_triton_ports

    kernel = fast_triton_ports.ORIGINALS[("vllm.models.deepseek_v4.compressor", "_SAVE_PARTIAL_STATES_KERNEL")]
    g = _gen(3)
    n, sw, ratio = 9, 1024, 4
    kv, score = torch.randn(n, sw, generator=g), torch.randn(n, sw, generator=g)
    ape = torch.randn(ratio, sw, generator=g)
    pos = torch.randint(0, 100, (n,), generator=g)
    slots = torch.tensor([5, -1, 0, 7, 2, 11, -1, 3, 9])
    ours, theirs = torch.zeros(3, 4, 2 * sw), torch.zeros(3, 4, 2 * sw)
    compressor.save_partial_states(kv, score, ape, pos, ours, slots, 4)
    kernel(kv=kv, score=score, ape=ape, positions=pos, state_cache=theirs, slot_mapping=slots, block_size=4,
           state_width=sw, compress_ratio=ratio, pdl_kwargs={})
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("tma", [False, True])
def test_inverse_rope_fp8_quant_equals_vllm_triton(tma):
    from vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant import fused_inv_rope_fp8_quant

    g = _gen(4)
    t, groups, hpg = 5, 2, 2
    o = (torch.randn(t, groups * hpg + 2, 512, generator=g) * 3).to(torch.bfloat16)[:, :groups * hpg]  # padded heads
    pos = torch.randint(0, 1000, (t,), generator=g)
    cs = _cos_sin()
    for quantize in (True, False):
        ours = o_proj.fused_inv_rope_fp8_quant(o, pos, cs, groups, hpg, tma_aligned_scales=tma, quantize=quantize)
        theirs = fused_inv_rope_fp8_quant(o, pos, cs, groups, hpg, tma_aligned_scales=tma, quantize=quantize)
        assert ours[0].shape == theirs[0].shape and ours[0].stride() == theirs[0].stride()
        assert torch.equal(ours[0].view(torch.uint8) if quantize else ours[0],
                           theirs[0].view(torch.uint8) if quantize else theirs[0])
        if quantize:
            assert ours[1].shape == theirs[1].shape and ours[1].stride() == theirs[1].stride()
            assert torch.equal(ours[1], theirs[1])


def test_indexer_q_quant_equals_vllm_triton():
    from vllm.models.deepseek_v4.common.ops.fused_indexer_q import _FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL

    g = _gen(5)
    t, h = 3, 4
    q = (torch.randn(t, h, 128, generator=g) * 2).to(torch.bfloat16)
    w = torch.randn(t, h, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 17, 900])
    cs = _cos_sin()
    q8, wo = indexer.fused_indexer_q_rope_quant(pos, q, cs, w, 128 ** -0.5, h ** -0.5)
    tq8 = torch.empty_like(q, dtype=torch.float8_e4m3fn)
    two = torch.empty_like(w, dtype=torch.float32)
    _FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL(pos, q, cs, w, 128 ** -0.5, h ** -0.5, tq8, two, fp8_max=448.0,
                                              use_fnuz=False)
    assert torch.equal(q8.view(torch.uint8), tq8.view(torch.uint8))
    assert torch.equal(wo, two)


def test_mhc_equals_vllm_torch_references():
    import importlib

    vt = importlib.import_module("vllm.model_executor.kernels.mhc.torch")

    g = _gen(6)
    t, hc, h = 4, 4, 256
    res = torch.randn(t, hc, h, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc * (2 + hc), hc * h, generator=g) * 0.02
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(hc * (2 + hc), generator=g) * 0.1
    args = (1e-6, 1e-6, 1e-6, 2.0, 20)
    post, comb, li = mhc.mhc_pre_tilelang(res, fn, scale, base, *args)
    vpost, vcomb, vli = vt.mhc_pre_torch(res, fn, scale, base, *args)
    assert torch.allclose(post, vpost, atol=1e-5) and torch.allclose(comb, vcomb, atol=1e-5)
    assert torch.equal(li, vli)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    assert torch.equal(mhc.mhc_post_tilelang(x, res, post, comb), vt.mhc_post_torch(x, res, post, comb))
