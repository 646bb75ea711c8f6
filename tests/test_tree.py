"""Property tests of the tree core (vllm_tree_spec/tree.py) over random parent arrays.

Every derived structure is checked against an independent walk of the parent
pointers, so a wrong cache, an off-by-one in row numbering or a packing bug
shows up on some random tree. Explicit edge cases (empty tree, k = 0 chains,
malformed paths and shape strings) follow the properties.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_tree_spec.tree import (
    NO_NODE,
    NO_PARENT,
    PAD_TOKEN_ID,
    Tree,
    TreeBatch,
    TreeError,
    TreeShape,
    pack_mask,
    unpack_mask,
)

PROPS = settings(max_examples=75, deadline=None)


@st.composite
def parent_arrays(draw, max_nodes: int = 40) -> list[int]:
    """Random topological parent arrays; half bushy (any earlier parent), half deep (a recent parent)."""
    n = draw(st.integers(0, max_nodes))
    deep = draw(st.booleans())
    parents = []
    for i in range(n):
        lo = max(NO_PARENT, i - 3) if deep else NO_PARENT
        parents.append(draw(st.integers(lo, i - 1)))
    return parents


@st.composite
def trees(draw, max_nodes: int = 40, with_tokens: bool | None = None) -> Tree:
    parents = draw(parent_arrays(max_nodes))
    tokens = with_tokens if with_tokens is not None else draw(st.booleans())
    if not tokens:
        return Tree(torch.tensor(parents, dtype=torch.long))
    toks = draw(st.lists(st.integers(0, 5), min_size=len(parents), max_size=len(parents)))
    return Tree(torch.tensor(parents, dtype=torch.long), torch.tensor(toks, dtype=torch.long))


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i != NO_PARENT:
        out.add(i)
        i = parents[i]
    return out


# ---------------------------------------------------------------------------
# Derived structure


@PROPS
@given(trees())
def test_mask_is_ancestor_or_self_and_depth_is_its_row_sum(tree: Tree):
    parents = tree.parents.tolist()
    n = tree.num_nodes
    mask = tree.ancestor_mask
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        expect = ancestors_or_self(parents, i)
        assert {j for j in range(n) if mask[i, j]} == expect
    # depth is 1 for root children, and the mask includes the node itself, so depth == row sum
    assert torch.equal(tree.depth, mask.sum(1))
    assert torch.equal(tree.positions(7), 7 + tree.depth)
    assert tree.max_depth == (int(tree.depth.max()) if n else 0)


@PROPS
@given(trees())
def test_attention_mask_adds_the_root_row_and_column(tree: Tree):
    n = tree.num_nodes
    att = tree.attention_mask()
    assert att.shape == (n + 1, n + 1)
    assert bool(att[:, 0].all())  # everyone sees the root
    assert not bool(att[0, 1:].any())  # the root sees no draft node
    assert torch.equal(att[1:, 1:], tree.ancestor_mask)


@PROPS
@given(trees())
def test_packed_mask_round_trips(tree: Tree):
    n = tree.num_nodes
    packed = tree.packed_ancestor_mask
    assert packed.dtype == torch.int32 and packed.shape == (n, (n + 31) // 32)
    assert torch.equal(unpack_mask(packed, n), tree.ancestor_mask)
    for i in range(n):  # bit (j % 32) of word j // 32
        for j in range(n):
            bit = (int(packed[i, j // 32]) >> (j % 32)) & 1
            assert bit == int(tree.ancestor_mask[i, j])


@PROPS
@given(st.integers(0, 3), st.integers(0, 100), st.integers(0, 2**31 - 1))
def test_pack_unpack_random_matrices(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(rows, 2, cols, generator=g) < 0.5  # extra leading dims are kept
    packed = pack_mask(m)
    assert packed.shape == (rows, 2, (cols + 31) // 32)
    assert torch.equal(unpack_mask(packed, cols), m)


def test_pack_sets_the_sign_bit_for_column_31():
    m = torch.zeros(1, 33, dtype=torch.bool)
    m[0, 31] = True
    m[0, 32] = True
    packed = pack_mask(m)
    assert packed.tolist() == [[-(2**31), 1]]
    assert torch.equal(unpack_mask(packed, 33), m)


@PROPS
@given(trees())
def test_children_and_sibling_rank_agree_with_parents(tree: Tree):
    parents = tree.parents.tolist()
    ch = tree.children
    assert len(ch) == tree.num_nodes + 1
    assert sorted(i for c in ch for i in c) == list(range(tree.num_nodes))
    for row, c in enumerate(ch):
        assert c == sorted(c)
        for r, i in enumerate(c):
            assert parents[i] == row - 1
            assert int(tree.sibling_rank[i]) == r
    assert tree.max_children == max((len(c) for c in ch), default=0)
    assert tree.leaves == [i for i in range(tree.num_nodes) if i not in parents]


@PROPS
@given(trees())
def test_leaf_paths_cover_every_leaf_and_node(tree: Tree):
    parents = tree.parents.tolist()
    lp = tree.leaf_paths
    assert lp.shape == (len(tree.leaves), tree.max_depth)
    ends = []
    covered = set()
    for row in lp.tolist():
        path = [x for x in row if x != NO_NODE]
        assert row[len(path) :] == [NO_NODE] * (len(row) - len(path))  # padding only at the end
        assert parents[path[0]] == NO_PARENT
        for a, b in zip(path, path[1:]):
            assert parents[b] == a
        ends.append(path[-1])
        covered.update(path)
    assert ends == tree.leaves  # one path per leaf, in leaf order
    assert covered == set(range(tree.num_nodes))


@PROPS
@given(trees())
def test_chain_cover_partitions_the_rows_into_parent_child_chains(tree: Tree):
    parents = tree.parents.tolist()
    chains = tree.chain_cover
    rows = [r for c in chains for r in c]
    assert sorted(rows) == list(range(tree.num_nodes + 1))  # every row (0 = root) exactly once
    assert chains[0][0] == 0
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            assert parents[b - 1] == a - 1  # each next row is a child of the previous one
        assert chain[-1] == 0 and tree.num_nodes == 0 or chain[-1] - 1 in tree.leaves  # down to a leaf
        if chain[0]:  # a later chain starts below a row of an earlier chain
            start = parents[chain[0] - 1] + 1
            assert any(start in c for c in chains[: chains.index(chain)])
    assert len(chains) == max(1, len(tree.leaves))


def test_chain_cover_example():
    assert Tree([-1, -1, 0, 0, 3]).chain_cover == [[0, 1, 3], [4, 5], [2]]
    assert Tree.chain(3).chain_cover == [[0, 1, 2, 3]]
    assert Tree([]).chain_cover == [[0]]


@PROPS
@given(trees())
def test_paths_round_trip_through_from_paths(tree: Tree):
    paths = tree.to_paths()
    assert len(set(paths)) == tree.num_nodes
    for i, p in enumerate(paths):
        assert len(p) == int(tree.depth[i])
    canon = Tree.from_paths(paths)
    # Same tree up to node order: map node i -> canonical index via its path.
    index = {p: j for j, p in enumerate(canon.to_paths())}
    assert set(index) == set(paths)
    for i, p in enumerate(paths):
        j = index[p]
        pi = int(tree.parents[i])
        expect = NO_PARENT if pi == NO_PARENT else index[paths[pi]]
        assert int(canon.parents[j]) == expect
    # The canonical form is a fixed point.
    assert torch.equal(Tree.from_paths(canon.to_paths()).parents, canon.parents)


@PROPS
@given(trees())
def test_first_child_next_sibling_walk_reaches_every_row_once(tree: Tree):
    fc, ns = tree.first_child.tolist(), tree.next_sibling.tolist()
    n = tree.num_nodes
    assert len(fc) == len(ns) == n + 1 and ns[0] == NO_NODE
    seen = [0] * (n + 1)
    stack = [0]
    while stack:
        row = stack.pop()
        seen[row] += 1
        kids = []
        c = fc[row]
        while c != NO_NODE:
            assert int(tree.parents[c - 1]) == row - 1
            kids.append(c)
            c = ns[c]
        assert kids == [i + 1 for i in tree.children[row]]  # sibling order = node order
        stack.extend(kids)
    assert seen == [1] * (n + 1)


@PROPS
@given(trees())
def test_subtree_prefix_is_a_tree_with_the_same_structure(tree: Tree):
    for k in {0, tree.num_nodes // 2, tree.num_nodes}:
        sub = tree.subtree(k)
        assert torch.equal(sub.parents, tree.parents[:k])
        assert torch.equal(sub.ancestor_mask, tree.ancestor_mask[:k, :k])


@PROPS
@given(trees(with_tokens=True))
def test_duplicate_siblings(tree: Tree):
    toks = tree.tokens.tolist()
    expect = []
    for c in tree.children:
        for jj, j in enumerate(c):
            first = next((i for i in c[:jj] if toks[i] == toks[j]), None)
            if first is not None:
                expect.append((first, j))
    assert sorted(tree.duplicate_siblings()) == sorted(expect)
    assert tree.with_tokens(tree.tokens).duplicate_siblings() == tree.duplicate_siblings()
    assert Tree(tree.parents).duplicate_siblings() == []


# ---------------------------------------------------------------------------
# Batch layout


@PROPS
@given(st.lists(trees(max_nodes=12), min_size=1, max_size=5))
def test_tree_batch_ragged_and_padded_agree(tree_list: list[Tree]):
    batch = TreeBatch.from_trees(tree_list)
    sizes = [t.num_nodes for t in tree_list]
    m = max(sizes)
    assert batch.batch_size == len(tree_list) and batch.max_nodes == m
    assert batch.cu_num_nodes.tolist() == [sum(sizes[:b]) for b in range(len(sizes) + 1)]
    assert batch.cu_num_rows.tolist() == [sum(s + 1 for s in sizes[:b]) for b in range(len(sizes) + 1)]
    assert batch.max_depth == max(t.max_depth for t in tree_list)
    dense_from_packed = unpack_mask(batch.packed_mask, max(m, 1))
    for b, t in enumerate(tree_list):
        s, e, n = int(batch.cu_num_nodes[b]), int(batch.cu_num_nodes[b + 1]), t.num_nodes
        toks = t.tokens if t.tokens is not None else torch.full((n,), PAD_TOKEN_ID)
        # ragged slice == padded row == the tree itself
        assert torch.equal(batch.parents[s:e], t.parents)
        assert torch.equal(batch.padded_parents[b, :n], t.parents)
        assert torch.equal(batch.tokens[s:e], toks)
        assert torch.equal(batch.padded_tokens[b, :n], toks)
        assert torch.equal(batch.depth[s:e], t.depth)
        assert torch.equal(batch.padded_depth[b, :n], t.depth)
        assert batch.valid[b].tolist() == [j < n for j in range(m)]
        assert torch.equal(batch.dense_mask[b, :n, :n], t.ancestor_mask)
        assert torch.equal(dense_from_packed[s:e, :n], t.ancestor_mask)
        assert not bool(dense_from_packed[s:e, n:].any())
        # padding
        assert (batch.padded_parents[b, n:] == NO_NODE).all()
        assert (batch.padded_tokens[b, n:] == PAD_TOKEN_ID).all()
        assert (batch.padded_depth[b, n:] == 0).all()
        assert not bool(batch.dense_mask[b, n:].any()) and not bool(batch.dense_mask[b, :, n:].any())
        # walk lists over rows
        assert torch.equal(batch.first_child[b, : n + 1], t.first_child)
        assert torch.equal(batch.next_sibling[b, : n + 1], t.next_sibling)
        assert (batch.first_child[b, n + 1 :] == NO_NODE).all()
        for r, ch in enumerate(t.children):
            row = batch.child_at[b, r].tolist()
            assert row[: len(ch)] == [i + 1 for i in ch]
            assert row[len(ch) :] == [NO_NODE] * (len(row) - len(ch))


def test_tree_batch_of_empty_trees():
    batch = TreeBatch.from_trees([Tree.chain(0), Tree.chain(2)])
    assert batch.cu_num_nodes.tolist() == [0, 0, 2]
    assert batch.cu_num_rows.tolist() == [0, 1, 4]
    assert batch.padded_parents.tolist() == [[NO_NODE, NO_NODE], [-1, 0]]
    assert batch.first_child.tolist() == [[NO_NODE, NO_NODE, NO_NODE], [1, 2, NO_NODE]]


# ---------------------------------------------------------------------------
# Constructors and errors


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3], [-2], [-1, -5]])
def test_tree_rejects_non_topological_parents(parents):
    with pytest.raises(TreeError, match="topological"):
        Tree(torch.tensor(parents))


@pytest.mark.parametrize("n", [5, 300])  # small trees are checked by a list scan, large ones by tensor ops
@pytest.mark.parametrize("bad", ["self", "later", "below_root"])
def test_both_parent_checks_name_the_first_bad_node(n, bad):
    parents = list(range(-1, n - 1))
    i = n - 2
    parents[i] = {"self": i, "later": i + 1, "below_root": -3}[bad]
    with pytest.raises(TreeError, match=rf"parents\[{i}\] = {parents[i]}: .* topological"):
        Tree(parents)
    assert Tree(list(range(-1, n - 1))).num_nodes == n


def test_tree_keeps_an_int64_cpu_tensor_without_a_copy():
    parents, tokens = torch.arange(4) - 1, torch.arange(4)
    tree = Tree(parents, tokens)
    assert tree.parents is parents and tree.tokens is tokens
    assert Tree(torch.tensor([[-1, 0]]), torch.tensor([3, 4], dtype=torch.int32)).parents.shape == (2,)


def test_tree_rejects_token_count_mismatch():
    with pytest.raises(TreeError, match="one token per node"):
        Tree(torch.tensor([-1, 0]), torch.tensor([5]))


def test_from_paths_orders_by_length_then_path():
    t = Tree.from_paths([(1, 0), (0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    assert t.to_paths() == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert t.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert torch.equal(Tree.from_paths("[(0,), (1,), (0, 0)]").parents, torch.tensor([-1, -1, 0]))
    assert torch.equal(Tree.from_paths([0, 1]).parents, torch.tensor([-1, -1]))  # bare ints = depth-1 ranks


@pytest.mark.parametrize(
    "paths, match",
    [
        ([(0, 0)], "no parent path"),
        ([(0,), (0, 1, 0)], "no parent path"),
        ([(0,), (0,)], "listed twice"),
        ([(0,), ()], "non-empty"),
        ([(-1,)], "ranks >= 0"),
        ("[(0,), (1,", "not a Python literal"),
    ],
)
def test_from_paths_errors(paths, match):
    with pytest.raises(TreeError, match=match):
        Tree.from_paths(paths)


@pytest.mark.parametrize("k", [0, 1, 2, 7])
def test_chain(k: int):
    t = Tree.chain(k)
    assert t.num_nodes == k and len(t) == k and t.is_chain()
    assert t.parents.tolist() == list(range(-1, k - 1))
    assert t.depth.tolist() == list(range(1, k + 1))
    assert t.max_depth == k and t.max_children == (1 if k else 0)
    assert t.leaves == ([k - 1] if k else [])
    assert t.leaf_paths.tolist() == ([list(range(k))] if k else [])
    assert t.to_paths() == [(0,) * d for d in range(1, k + 1)]
    assert t.ancestor_mask.shape == (k, k) and torch.equal(t.ancestor_mask, torch.ones(k, k, dtype=torch.bool).tril())
    assert t.packed_ancestor_mask.shape == (k, (k + 31) // 32)
    assert t.first_child.tolist() == list(range(1, k + 1)) + [NO_NODE]
    assert Tree.chain(k, list(range(10, 10 + k))).tokens.tolist() == list(range(10, 10 + k))


def test_chain_errors_and_non_chains():
    with pytest.raises(TreeError, match=">= 0"):
        Tree.chain(-1)
    with pytest.raises(TreeError, match="one token per node"):
        Tree.chain(3, [1, 2])
    assert not Tree(torch.tensor([-1, -1])).is_chain()
    assert not Tree(torch.tensor([-1, 0, 0])).is_chain()


# ---------------------------------------------------------------------------
# Shape strings


def test_shape_parse_documented_example():
    s = TreeShape.parse("s3_k2_d6")
    assert (s.steps, s.topk, s.draft_tokens, s.num_nodes, s.max_candidates) == (3, 2, 6, 5, 10)
    assert str(s) == "s3_k2_d6"
    assert TreeShape.parse("  s1_k1_d2 ") == TreeShape(1, 1, 2)


@PROPS
@given(st.integers(0, 6), st.integers(0, 6), st.integers(0, 80))
def test_shape_parse_accepts_exactly_the_valid_shapes(s: int, k: int, d: int):
    text = f"s{s}_k{k}_d{d}"
    valid = s >= 1 and k >= 1 and d >= 2 and d - 1 <= k + (s - 1) * k * k
    if valid:
        shape = TreeShape.parse(text)
        assert str(shape) == text and shape.num_nodes == d - 1
    else:
        with pytest.raises(TreeError):
            TreeShape.parse(text)


@pytest.mark.parametrize("text", ["s3k2d6", "s3_k2", "S3_K2_D6", "s3_k2_d6_x", "s-1_k2_d6", "", "s3_k2_d6.0"])
def test_shape_parse_rejects_malformed_strings(text):
    with pytest.raises(TreeError, match="form s"):
        TreeShape.parse(text)


def test_shape_errors_name_the_fix():
    with pytest.raises(TreeError, match="lower d to <= 11"):
        TreeShape.parse("s3_k2_d12")
    with pytest.raises(TreeError, match="draft_tokens >= 2"):
        TreeShape.parse("s3_k2_d1")
    assert TreeShape.parse("s4_k1_d5").max_candidates == 4  # k = 1: a chain of s nodes at most
    with pytest.raises(TreeError):
        TreeShape.parse("s4_k1_d6")
