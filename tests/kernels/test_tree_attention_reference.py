"""The PyTorch tree-attention reference against the causal-path oracle (float64) and literal masks.

Needs no Triton. The oracle never sees the packed mask or the depths: each
row is plain causal attention over its own root-to-node history.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _tree_attention_cases import make_case, mixed_trees, random_tree
from vllm_tree_spec.tree import Tree, TreeBatch, pack_mask
from vllm_tree_spec.tree_attention import (
    causal_attention,
    tree_attention,
    tree_attention_mask,
    tree_attention_path_oracle,
    tree_attention_reference,
)

CPU = torch.device("cpu")
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 3},
    "softcap": {"softcap": 2.5},
    "sinks": {"sinks": "random"},
    "all": {"sliding_window": 6, "softcap": 4.0, "sinks": "random"},
}


def _features(name: str, num_heads: int, seed: int = 0) -> dict:
    kw = dict(FEATURES[name])
    if kw.get("sinks") == "random":
        kw["sinks"] = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return kw


def test_mask_literal_example():
    """The tree of tree.py (parents [-1, -1, 0, 0, 3]) after 2 context tokens, no prefill rows."""
    tree = Tree(torch.tensor([-1, -1, 0, 0, 3]))
    mask = tree_attention_mask(6, 8, tree.ancestor_mask, tree.depth)
    #                      ctx  ctx root n0 n1 n2 n3 n4
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 0, 0],  # root
            [1, 1, 1, 1, 0, 0, 0, 0],  # n0
            [1, 1, 1, 0, 1, 0, 0, 0],  # n1
            [1, 1, 1, 1, 0, 1, 0, 0],  # n2
            [1, 1, 1, 1, 0, 0, 1, 0],  # n3
            [1, 1, 1, 1, 0, 0, 1, 1],  # n4
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    # The tree block is the tree's own row mask (root first).
    assert torch.equal(mask[:, 2:], tree.attention_mask())


def test_mask_window_counts_positions_not_slots():
    """Window 2: a depth-1 node sees the root (1 position back) even when it is 5 slots later."""
    tree = Tree(torch.full((6,), -1))  # 6 children of the root, all at depth 1
    mask = tree_attention_mask(7, 10, tree.ancestor_mask, tree.depth, sliding_window=2)
    root = 3
    assert mask[1:, root].all() and not mask[1:, : root].any()  # every node: root + itself only
    assert torch.equal(mask[1:, root + 1 :], torch.eye(6, dtype=torch.bool))
    assert torch.equal(mask[0], torch.tensor([0, 0, 1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool))


def test_mask_rejects_too_few_query_rows():
    tree = Tree.chain(3)
    with pytest.raises(ValueError, match="q_len"):
        tree_attention_mask(3, 10, tree.ancestor_mask)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_reference_matches_path_oracle_fp64(feature, heads):
    hq, hkv = heads
    gen = torch.Generator().manual_seed(1)
    case = make_case(
        mixed_trees(gen), [13, 1, 40, 0, 7], num_heads=hq, num_kv_heads=hkv, head_dim=16,
        page_size=4, dtype=torch.float64, prefill_rows=[0, 1, 5, 0, 2], device=CPU,
    )  # fmt: skip
    kw = _features(feature, hq)
    ref = tree_attention_reference(*case.args, compute_dtype=torch.float64, **kw)
    orc = tree_attention_path_oracle(*case.oracle_args, **kw)
    torch.testing.assert_close(ref, orc, atol=1e-12, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    ctx=st.lists(st.integers(0, 20), min_size=3, max_size=3),
    window=st.one_of(st.none(), st.integers(1, 8)),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_path_oracle_random_trees(sizes, ctx, window, seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(n, gen) for n in sizes]
    case = make_case(
        trees, ctx[: len(trees)], num_heads=2, num_kv_heads=1, head_dim=8, page_size=3,
        dtype=torch.float64, seed=seed, device=CPU,
    )  # fmt: skip
    ref = tree_attention_reference(*case.args, sliding_window=window, compute_dtype=torch.float64)
    orc = tree_attention_path_oracle(*case.oracle_args, sliding_window=window)
    torch.testing.assert_close(ref, orc, atol=1e-12, rtol=1e-12)


def test_chain_tree_is_causal_attention():
    """A chain of k drafts is ordinary causal attention over the last k + 1 tokens."""
    case = make_case([Tree.chain(5)], [11], num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float64, device=CPU)
    ref = tree_attention_reference(*case.args, compute_dtype=torch.float64)
    slots = torch.arange(17)
    bt = case.block_table[0].long()
    k = case.key_cache[bt[slots // 16], slots % 16]
    v = case.value_cache[bt[slots // 16], slots % 16]
    torch.testing.assert_close(ref, causal_attention(case.q, k, v, scale=16**-0.5), atol=1e-12, rtol=0)


def test_dispatch_torch_backend_on_cpu():
    case = make_case([Tree.chain(2), Tree(torch.tensor([-1, -1]))], [5, 3], device=CPU)
    out = tree_attention(*case.args, backend="auto")
    torch.testing.assert_close(out, tree_attention_reference(*case.args))
    with pytest.raises(ValueError, match="Triton backend only"):
        tree_attention(*case.args, backend="torch", num_splits=2)
    with pytest.raises(ValueError, match="sliding_window"):
        tree_attention(*case.args, backend="torch", sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        tree_attention(*case.args, backend="torch", softcap=-1.0)
    with pytest.raises(ValueError, match="backend"):
        tree_attention(*case.args, backend="cuda")


def test_packed_mask_has_32_plus_columns():
    """Trees wider than one 32-bit word (40 nodes) use two mask words per row."""
    gen = torch.Generator().manual_seed(3)
    tree = random_tree(40, gen)
    assert TreeBatch.from_trees([tree]).packed_mask.shape == (40, 2)
    assert torch.equal(pack_mask(tree.ancestor_mask), tree.packed_ancestor_mask)
    case = make_case([tree], [9], head_dim=8, dtype=torch.float64, device=CPU)
    ref = tree_attention_reference(*case.args, compute_dtype=torch.float64)
    orc = tree_attention_path_oracle(*case.oracle_args)
    torch.testing.assert_close(ref, orc, atol=1e-12, rtol=1e-12)
