"""The CPU_ATTN override against a per-node oracle: each node attends to prefix + root + its path.

Covers what the tiny Llama engine tests do not: sliding windows (measured in
positions), softcap, attention sinks, GQA ratios, several requests with
different trees and shuffled cache blocks, bf16 caches. K/V are written with
vLLM's own cache op, so the test also pins our reading of the cache layout, for
each ISA: vec, vec16 and (bf16, CPUs with AMX tiles only) amx, and for both paths
of branching trees: the C++ tree kernel and the split (vLLM's kernel + side log-sum-exp + merge).
"""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode


def _random_tree(rng: random.Random, n: int) -> Tree:
    return Tree([rng.randint(-1, i - 1) for i in range(n)], [rng.randrange(100) for _ in range(n)])


def _oracle(q, k_all, v_all, req: TreeRequestStep, scale, window, softcap, sinks, g):
    """Per node: softmax over prefix + root + ancestors-or-self (positions root + depth), in float64."""
    out = []
    depth = req.tree.depth.tolist()
    for i in range(req.num_nodes):
        keys = list(range(req.root_pos + 1)) + [req.root_pos + 1 + j for j in req.tree.path_to(i)]
        kpos = list(range(req.root_pos + 1)) + [req.root_pos + depth[j] for j in req.tree.path_to(i)]
        qpos = req.root_pos + depth[i]
        if window:
            keep = [t for t, p in enumerate(kpos) if p > qpos - window]
            keys = [keys[t] for t in keep]
        kk = k_all[keys].double().repeat_interleave(g, dim=1)  # [s, H, D]
        vv = v_all[keys].double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,shd->hs", q[req.root_row + 1 + i].double(), kk) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
            p = torch.softmax(s, dim=1)[:, :-1]
        else:
            p = torch.softmax(s, dim=1)
        out.append(torch.einsum("hs,shd->hd", p, vv))
    return torch.stack(out)


def _causal_oracle(q, k, v, scale, window, softcap, sinks, g):
    """Rows 0..L-1 of plain causal attention over one contiguous sequence, in float64."""
    L = q.shape[0]
    pos = torch.arange(L)
    vis = pos[None, :] <= pos[:, None]
    if window:
        vis &= pos[None, :] > pos[:, None] - window
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, dim=1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis[None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, L, 1)], dim=2)
        p = torch.softmax(s, dim=2)[..., :-1]
    else:
        p = torch.softmax(s, dim=2)
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, dim=1))


AMX = [pytest.mark.amx, pytest.mark.skipif(not kv_layout.amx_available(),
                         reason="ISA amx: this CPU has no AMX tiles, so vLLM's amx cache and attention ops cannot run "
                                "(the amx layout's model is tested in test_kv_layout_amx.py / test_cpu_tree_split.py)")]



@pytest.mark.vllm
@pytest.mark.parametrize("dtype,head_dim,hkv,g,window,softcap,sinks,isa", [
    (torch.float32, 32, 2, 2, 0, 0.0, False, "vec"),
    (torch.float32, 64, 1, 4, 6, 0.0, False, "vec"),
    (torch.float32, 32, 2, 1, 0, 5.0, True, "vec"),
    (torch.float32, 48, 2, 3, 9, 3.0, True, "vec16"),   # head_dim % 32 != 0
    (torch.bfloat16, 32, 2, 2, 0, 0.0, False, "vec"),
    pytest.param(torch.bfloat16, 32, 2, 2, 0, 0.0, False, "amx", marks=AMX),
    pytest.param(torch.bfloat16, 64, 1, 4, 6, 3.0, True, "amx", marks=AMX),
    pytest.param(torch.bfloat16, 128, 2, 3, 0, 0.0, True, "amx", marks=AMX),
])
@pytest.mark.parametrize("path", ["decode", "kernel", "split"])
def test_tree_rows_match_path_oracle(dtype, head_dim, hkv, g, window, softcap, sinks, isa, path, monkeypatch):
    from vllm import _custom_ops as ops

    from vllm_tree_spec.integration import cpu_attention
    from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionImpl

    monkeypatch.setenv(cpu_attention.MODE_ENV, path)
    if cpu_attention.tree_attention_mode() != path:
        pytest.skip(cpu_attention.tree_kernel.available()[1])

    rng = random.Random(head_dim * 7 + g)
    torch.manual_seed(head_dim + g)
    bs = 16 if isa == "vec16" else 32
    kv_layout.self_test(isa, dtype, head_dim, bs, hkv)
    h = hkv * g
    num_blocks = 40
    kv_cache = torch.zeros(num_blocks, hkv, bs, 2 * head_dim, dtype=dtype)
    view = kv_cache.view(num_blocks, hkv, 2 * bs, head_dim)
    kc, vc = view.chunk(2, dim=2)
    perm = torch.randperm(num_blocks)
    reqs, q_rows, block_table = [], 0, torch.zeros(5, 8, dtype=torch.int32)
    k_per_req, v_per_req = [], []
    # n = 0: a request without a tree; the last request drafts a chain (no merge: the kernel's causal rows)
    for b, (ctx, n) in enumerate([(37, 6), (5, 3), (20, 0), (70, 9), (44, 5)]):
        tree = _random_tree(rng, n) if b < 4 else Tree.chain(n, list(range(n)))
        blocks = perm[b * 8: b * 8 + 8]
        block_table[b] = blocks.to(torch.int32)
        seq_len = ctx + 1 + n
        k = torch.randn(seq_len, hkv, head_dim).to(dtype)
        v = torch.randn(seq_len, hkv, head_dim).to(dtype)
        pos = torch.arange(seq_len)
        slots = blocks[pos // bs].long() * bs + pos % bs
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        reqs.append(TreeRequestStep(f"r{b}", b, q_rows + ctx, ctx, tree, Mode.GREEDY, None, {}))
        k_per_req.append(k)
        v_per_req.append(v)
        q_rows += seq_len  # pretend each request scheduled its whole sequence
    query = torch.randn(q_rows, h, head_dim).to(dtype)
    output = torch.zeros(q_rows, h, head_dim, dtype=dtype)

    impl = object.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = h, head_dim, hkv
    impl.num_queries_per_kv, impl.scale = g, 1 / math.sqrt(head_dim)
    impl.sliding_window, impl.logits_soft_cap = (window or -1), softcap
    impl.sinks = torch.randn(h) if sinks else None
    impl.alibi_slopes = None
    impl.kv_cache_dtype, impl.is_fp8_kv_cache = "auto", False
    seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = seq_lens.cumsum(0)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=seq_lens, block_table=block_table, num_actual_tokens=q_rows,
                         causal=True, dynamic_causal=None)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    impl._tree_forward(layer, TreeStep([r for r in reqs if r.num_nodes]), query, kv_cache, md, output)

    tol = 2e-5 if dtype == torch.float32 else 2e-2
    offset = 0
    for req, k, v in zip(reqs, k_per_req, v_per_req):
        shifted = TreeRequestStep(req.req_id, req.req_index, req.root_row - offset, req.root_pos, req.tree,
                                  req.mode, None, {})
        q_req = query[offset: offset + req.seq_len]
        if req.num_nodes:
            expected = _oracle(q_req, k, v, shifted, impl.scale, window, softcap, impl.sinks, g)
            got = output[req.root_row + 1: req.root_row + 1 + req.num_nodes].double()
            assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
        # every row before the nodes (prefill rows and the root) is plain causal attention
        causal = _causal_oracle(q_req[: req.root_pos + 1], k[: req.root_pos + 1], v[: req.root_pos + 1],
                                impl.scale, window, softcap, impl.sinks, g)
        got = output[offset: req.root_row + 1].double()
        assert torch.allclose(got, causal, atol=tol, rtol=tol), (got - causal).abs().max()
        offset += req.seq_len


@pytest.mark.vllm
def test_chain_only_step_runs_vllms_kernel_on_its_metadata(monkeypatch):
    """A step whose trees are all chains needs no split plan: its tree mask is the causal mask and its
    positions are linear, so vLLM's call on vLLM's metadata is exact; a branching tree takes the tree path.
    Either way the layer is counted as having applied the mask."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_tree_spec.integration import cpu_attention
    from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionImpl

    calls = []
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward",
                        lambda self, layer, q, k, v, kv, md, out, *a: calls.append("stock") or out.fill_(7.0))
    monkeypatch.setattr(TreeCPUAttentionImpl, "_tree_forward", lambda self, *a: calls.append("tree"))
    monkeypatch.setattr(cpu_attention.kv_layout, "self_test", lambda *a: None)
    impl = object.__new__(TreeCPUAttentionImpl)
    impl.alibi_slopes, impl.head_size, impl.num_kv_heads = None, 32, 2
    layer = SimpleNamespace(isa="vec", layer_name="model.layers.0.self_attn.attn")
    kv, query, out = torch.zeros(4, 2, 16, 64), torch.randn(9, 4, 32), torch.zeros(9, 4, 32)
    chain = TreeRequestStep("a", 0, 2, 2, Tree.chain(3, [1, 2, 3]), Mode.GREEDY, None, {})
    fork = TreeRequestStep("b", 1, 6, 5, Tree([-1, -1], [4, 5]), Mode.GREEDY, None, {})
    for reqs, want in (([chain], "stock"), ([chain, fork], "tree")):
        step = TreeStep(reqs)
        calls.clear()
        impl.forward(layer, query, None, None, kv, SimpleNamespace(tree_step=step), out)
        assert calls == [want] and step.applied == {layer.layer_name}, (calls, step.applied)
    assert torch.all(out == 7.0)  # the chain-only step's rows came from the stock call
