"""N-gram / prompt-lookup tree drafter (drafters/ngram.py), checked against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_tree_spec.drafters.base import DraftRequest, DrafterError
from vllm_tree_spec.drafters.ngram import NgramTreeDrafter, match_lengths
from vllm_tree_spec.verify import Mode

PROPS = settings(max_examples=60, deadline=None)


def brute_match_lengths(t: list[int], max_n: int) -> list[int]:
    L = len(t)
    out = []
    for i in range(L - 1):
        k = 0
        while k < max_n and i - k >= 0 and t[i - k] == t[L - 1 - k]:
            k += 1
        out.append(k)
    return out


def brute_trie(t: list[int], min_n: int, max_n: int, max_depth: int, weight: int) -> tuple[dict, int]:
    """{path: weight} over all matches (no max_matches cap) and the total weight."""
    ls = brute_match_lengths(t, max_n)
    nodes: dict[tuple[int, ...], int] = {}
    total = 0
    for i, length in enumerate(ls):
        if length < min_n:
            continue
        w = weight ** (length - min_n)
        total += w
        cont = t[i + 1 : i + 1 + max_depth]
        for k in range(1, len(cont) + 1):
            nodes[tuple(cont[:k])] = nodes.get(tuple(cont[:k]), 0) + w
    return nodes, total


contexts = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@PROPS
@given(contexts, st.integers(1, 5))
def test_match_lengths_equal_brute_force(t, max_n):
    assert match_lengths(np.array(t), max_n).tolist() == brute_match_lengths(t, max_n)


@PROPS
@given(contexts, st.integers(1, 3), st.integers(0, 2), st.integers(1, 5), st.integers(1, 4))
def test_tree_is_the_weighted_trie_of_all_continuations(t, min_n, extra_n, max_depth, weight):
    max_n = min_n + extra_n
    d = NgramTreeDrafter(min_n=min_n, max_n=max_n, max_depth=max_depth, max_matches=10_000, length_weight=weight)
    expect, total = brute_trie(t, min_n, max_n, max_depth, weight)
    full = d.draft(t, 10_000)
    tree = full.tree
    got = {tuple(tree.path_tokens(i)): float(full.scores[i]) for i in range(tree.num_nodes)}
    assert set(got) == set(expect)
    for path, w in expect.items():
        assert got[path] == pytest.approx(w / total)
    # Best-first: scores never increase along the node order, and parents come first.
    s = full.scores.tolist()
    assert all(a >= b for a, b in zip(s, s[1:]))
    assert bool((tree.parents < torch.arange(tree.num_nodes)).all())
    assert tree.duplicate_siblings() == []
    # Any budget gives the first `budget` nodes of the full ranking.
    # (The trie stops at depth `budget`: that must not change the first nodes or their scores.)
    for budget in range(tree.num_nodes + 1):
        small = d.draft(t, budget)
        assert torch.equal(small.tree.parents, tree.parents[:budget])
        assert torch.equal(small.tree.tokens, tree.tokens[:budget])
        assert torch.equal(small.scores, full.scores[:budget])


def test_worked_example():
    #  t = 1 2 3 4 5 6 7 8 4 5 6 9 10 4 5 6 7 8 4 5      (root = the last 5)
    #  matches of "... 4 5": end 4 (l = 2: "3 4 5" != "8 4 5"), end 9 (l = 4: "7 8 4 5"), end 14 (l = 2)
    #  continuations: 6 7 8 4 (w 1), 6 9 10 4 (w 4^2 = 16), 6 7 8 4 (w 1); total 18
    t = [1, 2, 3, 4, 5, 6, 7, 8, 4, 5, 6, 9, 10, 4, 5, 6, 7, 8, 4, 5]
    d = NgramTreeDrafter(min_n=2, max_n=4, max_depth=4, length_weight=4)
    p = d.draft(t, 10)
    assert p.tree.tokens.tolist() == [6, 9, 10, 4, 7, 8, 4]
    assert p.tree.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5]
    assert p.scores.tolist() == pytest.approx([1.0, 16 / 18, 16 / 18, 16 / 18, 2 / 18, 2 / 18, 2 / 18])
    # Plain counts (length_weight 1): the twice-seen "7 8 4" branch wins.
    p = NgramTreeDrafter(min_n=2, max_n=4, max_depth=4, length_weight=1).draft(t, 3)
    assert p.tree.tokens.tolist() == [6, 7, 8] and p.tree.parents.tolist() == [-1, 0, 1]


def test_recency_breaks_ties():
    # "1" is followed by 2 and, later, by 3: equal counts, the later one ranks first.
    p = NgramTreeDrafter(max_depth=1).draft([1, 2, 0, 1, 3, 0, 1], 2)
    assert p.tree.tokens.tolist() == [3, 2]


def test_max_matches_keeps_the_longest_then_most_recent():
    t = [5, 1, 7, 9, 1, 8, 5, 1, 6, 0, 5, 1]  # "5 1" -> 7 (old), 6 (recent); "1" alone -> 8
    p = NgramTreeDrafter(min_n=1, max_n=2, max_depth=1, max_matches=1).draft(t, 3)
    assert p.tree.tokens.tolist() == [6]
    p = NgramTreeDrafter(min_n=1, max_n=2, max_depth=1, max_matches=2).draft(t, 3)
    assert p.tree.tokens.tolist() == [6, 7]


def test_runs_predict_themselves_and_no_match_gives_an_empty_tree():
    assert NgramTreeDrafter(max_depth=3).draft([7, 7, 7, 7], 5).tree.tokens.tolist() == [7, 7, 7]
    assert NgramTreeDrafter().draft([7], 5).num_nodes == 0
    assert NgramTreeDrafter().draft([3, 7], 5).num_nodes == 0
    assert NgramTreeDrafter().draft([1, 2, 1], 0).num_nodes == 0


def test_window_limits_the_search():
    t = [1, 9, 8, 0, 0, 0, 0, 1]
    assert NgramTreeDrafter(max_depth=1).draft(t, 2).tree.tokens.tolist() == [9]
    assert NgramTreeDrafter(max_depth=1, window=5).draft(t, 2).num_nodes == 0
    assert NgramTreeDrafter(max_depth=1).draft(torch.tensor(t), 2).tree.tokens.tolist() == [9]


def test_through_the_interface():
    d = NgramTreeDrafter(max_depth=3)
    d.start_request("a", [1, 2, 3])
    d.start_request("b", [4, 4])
    pa, pb = d.propose(
        [DraftRequest("a", [1, 2, 3, 1, 2], temperature=0.0), DraftRequest("b", [4, 4, 4], temperature=0.8)],
        [2, 5],
    )
    assert pa.mode == Mode.GREEDY and pa.tree.tokens.tolist() == [3, 1]
    assert pb.mode == Mode.DETERMINISTIC and pb.tree.tokens.tolist() == [4, 4] and pb.draft_probs is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_n=0), "min_n"),
        (dict(min_n=3, max_n=2), "min_n"),
        (dict(max_depth=0), "max_depth"),
        (dict(max_matches=0), "max_matches"),
        (dict(length_weight=0), "length_weight"),
        (dict(length_weight=1.5), "length_weight"),
        (dict(window=1), "window"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(DrafterError, match=match):
        NgramTreeDrafter(**kwargs)
