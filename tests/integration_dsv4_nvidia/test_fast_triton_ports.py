"""The speed ports (fast_triton_ports.py) equal vLLM's interpreted Triton kernels they stand in for, and the
interpreter's float narrowing is fixed (nvidia_emulation._fix_interpreter_downcasts).

The o_proj inverse-RoPE quantization, the gather-dequantize, the partial-state save and the indexer compressor
ports are checked in test_pack_vs_vllm.py (they are pack references); the metadata-kernel ports of the CPU
path (token -> request map, slot mappings, SWA lists) by tests/integration_dsv4/test_dsv4_cpu_kernels.py.
"""

import pytest
import torch

pytestmark = pytest.mark.vllm


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_interpreter_narrowing_rounds_to_nearest_even():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, e4m3_ptr, bf16_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        x = tl.load(x_ptr + o)
        tl.store(e4m3_ptr + o, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        tl.store(bf16_ptr + o, x.to(tl.bfloat16))

    # e4m3 carry over a binade (1.95 -> 2), e4m3 ties to even (1.0625 -> 1, 1.3125 -> 1.25), bf16 carry and tie
    x = torch.tensor([1.95, 0.49, 1.0625, 1.3125, 1.9990234375, 1.00390625, 1.01171875, -5.99, 3.0, 0.0,
                      1e-3, -448.0, 2.0, 7.5, -0.3, 100.0])
    e4m3 = torch.empty(16, dtype=torch.uint8)
    bf16 = torch.empty(16, dtype=torch.bfloat16)
    cast[(1,)](x, e4m3, bf16, 16)
    assert torch.equal(e4m3, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(bf16, x.to(torch.bfloat16))


def test_q_kv_rmsnorm_port():
    import fast_triton_ports
    from vllm.models.common.ops.fused_qk_rmsnorm import fused_q_kv_rmsnorm

    g = _gen(0)
    qr_kv = torch.randn(5, 128 + 512, generator=g).to(torch.bfloat16)
    qr, kv = qr_kv.split([128, 512], dim=-1)
    wq, wk = torch.rand(128, generator=g).to(torch.bfloat16), torch.rand(512, generator=g).to(torch.bfloat16)
    ours = fast_triton_ports.fused_q_kv_rmsnorm(qr, kv, wq, wk, 1e-6)
    theirs = fused_q_kv_rmsnorm(qr, kv, wq, wk, 1e-6)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("ratio,top_k", [(4, 512), (128, 128), (1, 0)])
def test_combine_topk_swa_indices_port(ratio, top_k):
    import fast_triton_ports

    original = fast_triton_ports.ORIGINALS[("vllm.models.deepseek_v4.common.ops.cache_utils",
                                            "_COMBINE_TOPK_SWA_INDICES_KERNEL")]
    g = _gen(1)
    qsl = torch.tensor([5, 9, 9, 140], dtype=torch.int32)  # a chunk's slice of query_start_loc (not from 0)
    seq_lens = torch.tensor([4, 300, 131], dtype=torch.int32)
    gather_lens = torch.tensor([4, 127, 131], dtype=torch.int32)
    n = int(qsl[-1] - qsl[0])
    topk = torch.randint(0, 80, (n, max(top_k, 128)), generator=g, dtype=torch.int32)
    width = (top_k + 128 + 127) // 128 * 128
    args = (topk, qsl, seq_lens, gather_lens, 1000, 90)
    kw = dict(TOP_K=top_k, COMPRESS_RATIO=ratio, WINDOW_SIZE=128)
    ours = (torch.full((n, width), -1, dtype=torch.int32), torch.empty(n, dtype=torch.int32))
    theirs = (torch.full((n, width), -1, dtype=torch.int32), torch.empty(n, dtype=torch.int32))
    fast_triton_ports.combine_topk_swa_indices(*ours, *args, **kw)
    original(*theirs, *args, **kw)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_c128a_metadata_port():
    import fast_triton_ports

    original = fast_triton_ports.ORIGINALS[("vllm.models.deepseek_v4.sparse_mla", "_BUILD_C128A_TOPK_METADATA_KERNEL")]
    positions = torch.tensor([127, 300, 5, 255, 640, 129, 1000])
    t2r = torch.tensor([0, 1, 1, 2, 0, 1, 2], dtype=torch.int32)
    bt = torch.randperm(30, generator=_gen(2)).view(3, 10).to(torch.int32)
    slots = torch.tensor([3, -1, 7, 9, 1, 2, 4])

    def buffers():
        return (torch.full((8, 128), 77, dtype=torch.int32), torch.full((8,), 77, dtype=torch.int32),
                torch.full((8, 128), 77, dtype=torch.int32))

    ours, theirs = buffers(), buffers()
    args = (positions, 128, 128, 4, t2r, bt, 2, slots)
    fast_triton_ports.build_c128a_topk_metadata(*ours, *args)
    original(*theirs, *args)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_short_context_topk_port():
    import fast_triton_ports

    original = fast_triton_ports.ORIGINALS[("vllm.models.deepseek_v4.attention", "_fill_short_context_topk_indices")]
    positions = torch.tensor([0, 3, 4, 2046, 900])
    ours = torch.full((6, 512), 5, dtype=torch.int32)
    theirs = ours.clone()
    fast_triton_ports._ShortContextTopk()[(5,)](ours, positions, TOP_K=512, COMPRESS_RATIO=4, PADDED_TOP_K=512)
    original[(5,)](theirs, positions, TOP_K=512, COMPRESS_RATIO=4, PADDED_TOP_K=512, num_warps=8)
    assert torch.equal(ours, theirs)
