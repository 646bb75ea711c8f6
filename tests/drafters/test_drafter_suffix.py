"""Suffix-tree drafter (drafters/suffix.py) on Arctic Inference's SuffixDecodingCache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("arctic_inference.suffix_decoding")

from vllm_tree_spec.drafters.base import DraftRequest, DrafterError  # noqa: E402
from vllm_tree_spec.drafters.suffix import SuffixTreeDrafter  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402
from vllm_tree_spec.verify import Mode, verify_tree  # noqa: E402

# "4 5" is followed by 6 three times and by 11 once; "4 5 6" by 7 twice and by 9 once.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 4, 5, 6, 9, 10, 4, 5, 6, 7, 8, 4, 5, 11]


def _drafter(**kw) -> SuffixTreeDrafter:
    kw.setdefault("min_token_prob", 0.0)
    kw.setdefault("max_spec_factor", 4.0)
    return SuffixTreeDrafter(**kw)


def _paths(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)) for i in range(tree.num_nodes)}


def test_repetitive_text_gives_a_branching_tree_within_budget():
    d = _drafter()
    d.start_request("a", PROMPT)
    ctx = PROMPT + [9, 4, 5]
    sizes = []
    for budget in [0, 1, 2, 3, 5, 8, 16]:
        (p,) = d.propose([DraftRequest("a", ctx)], [budget])
        tree = p.tree
        assert tree.num_nodes <= budget
        assert p.mode == Mode.DETERMINISTIC and p.draft_probs is None
        assert tree.duplicate_siblings() == []
        assert bool((tree.parents < torch.arange(tree.num_nodes)).all())  # topological
        if budget:
            assert tree.num_nodes >= 1 and int(tree.tokens[0]) == 6  # the most frequent continuation first
        sizes.append(tree.num_nodes)
    # The full tree branches: after "4 5" both 6 and 11 were seen; after "... 4 5" again 6 and 11.
    assert tree.max_children > 1
    assert (6,) in _paths(tree) and (11,) in _paths(tree)
    assert (6, 7, 8, 4, 5) in _paths(tree)
    assert sizes[-1] > 1 and sizes == sorted(sizes)
    # Scores are path frequencies: a child never scores above its parent.
    s = p.scores
    for i, par in enumerate(tree.parents.tolist()):
        assert 0 < float(s[i]) <= 1 and (par < 0 or float(s[i]) <= float(s[par]) + 1e-9)


def test_only_new_tokens_are_added_and_they_are_used():
    d = _drafter()
    added: list[int] = []
    real_add = d.cache.add_active_response

    def spy(req_id, token_ids):
        added.extend(token_ids)
        real_add(req_id, token_ids)

    d.cache.add_active_response = spy
    d.start_request("a", [50, 51, 52])
    ctx = [50, 51, 52]
    (p,) = d.propose([DraftRequest("a", ctx)], [4])
    assert p.num_nodes == 0  # nothing repeats yet
    # The response now writes a pattern twice; each call adds only what it has not seen.
    for step in [[7, 8, 9], [60, 7, 8], [9, 61, 7]]:
        ctx = ctx + step
        d.propose([DraftRequest("a", ctx)], [4])
    d.propose([DraftRequest("a", ctx)], [4])  # nothing new: nothing added
    assert added == ctx[3:]  # the response, each token exactly once, in order
    ctx = ctx + [8]  # ... 7 8 -> the cache saw "7 8 9" twice
    (p,) = d.propose([DraftRequest("a", ctx)], [4])
    assert p.num_nodes >= 1 and int(p.tree.tokens[0]) == 9
    assert added == ctx[3:]


def test_budget_zero_still_records_the_response():
    d = _drafter()
    d.start_request("a", [1, 2, 3])
    ctx = [1, 2, 3, 20, 21, 22, 23, 20, 21]
    (p,) = d.propose([DraftRequest("a", ctx)], [0])
    assert p.num_nodes == 0
    (p,) = d.propose([DraftRequest("a", ctx)], [3])
    assert p.tree.tokens.tolist()[:2] == [22, 23]


def test_rewritten_context_is_refused():
    d = _drafter()
    d.start_request("a", [1, 2, 3])
    d.propose([DraftRequest("a", [1, 2, 3, 4, 5])], [2])
    with pytest.raises(DrafterError, match="no longer extends"):
        d.propose([DraftRequest("a", [1, 2, 3, 4, 6])], [2])
    with pytest.raises(DrafterError, match="no longer extends"):
        d.propose([DraftRequest("a", [1, 2, 3, 4])], [2])


def test_finished_responses_serve_other_requests():
    d = _drafter()
    d.start_request("a", [1, 2])
    d.propose([DraftRequest("a", [1, 2, 30, 31, 32, 33, 34])], [2])
    d.finish_request("a")
    d.start_request("b", [9, 30, 31])  # the prompt ends where a's response continued with 32 33 34
    (p,) = d.propose([DraftRequest("b", [9, 30, 31])], [3])
    assert p.tree.tokens.tolist() == [32, 33, 34]
    # With the global cache off a request only sees its own context.
    d0 = _drafter(max_cached_requests=0)
    d0.start_request("a", [1, 2])
    d0.propose([DraftRequest("a", [1, 2, 30, 31, 32, 33, 34])], [2])
    d0.finish_request("a")
    d0.start_request("b", [9, 30, 31])
    assert d0.propose([DraftRequest("b", [9, 30, 31])], [3])[0].num_nodes == 0


def test_greedy_request_gets_greedy_mode_and_the_tree_verifies():
    """A periodic target: greedy verification accepts the drafted continuation up to the tree's depth."""
    period = [3, 1, 4, 1, 5, 9, 2, 6]
    seq = period * 4
    d = _drafter()
    d.start_request("a", seq[:10])
    ctx = seq[:21]
    (p,) = d.propose([DraftRequest("a", ctx, temperature=0.0)], [6])
    assert p.mode == Mode.GREEDY and p.num_nodes >= 1
    vocab = 10
    tree = p.tree
    # Target: one-hot on the true next token of the periodic sequence after each row's path.
    target = torch.zeros(tree.num_nodes + 1, vocab)
    for row in range(tree.num_nodes + 1):
        path = [] if row == 0 else tree.path_tokens(row - 1)
        nxt = period[(len(ctx) + len(path)) % len(period)]
        target[row, nxt] = 1.0
    accepted, _ = verify_tree(tree.parents, tree.tokens, target, None, "greedy", None)
    truth = [period[(len(ctx) + k) % len(period)] for k in range(tree.max_depth)]
    longest = max(k for k in range(tree.max_depth + 1) if k == 0 or tuple(truth[:k]) in _paths(tree))
    assert len(accepted) == longest >= 1


def test_constructor_validation():
    with pytest.raises(DrafterError, match="max_tree_depth"):
        SuffixTreeDrafter(max_tree_depth=0)
    with pytest.raises(DrafterError, match="max_cached_requests"):
        SuffixTreeDrafter(max_cached_requests=-1)
    with pytest.raises(DrafterError, match="max_spec_factor"):
        SuffixTreeDrafter(max_spec_factor=-1)
    with pytest.raises(DrafterError, match="min_token_prob"):
        SuffixTreeDrafter(min_token_prob=1.5)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=2, max_size=60),
    st.lists(st.integers(0, 4), min_size=1, max_size=30),
    st.integers(1, 12),
)
def test_library_trees_are_topological_with_distinct_siblings_and_passed_through(prompt, response, budget):
    """The proposal = the library's best chain, then its tree's branches (merged, best-first, to budget)."""
    d = _drafter()
    d.start_request("a", prompt)
    ctx = prompt + response
    (p,) = d.propose([DraftRequest("a", ctx)], [budget])
    kw = dict(max_spec_tokens=budget, max_spec_factor=d.max_spec_factor, max_spec_offset=d.max_spec_offset,
              min_token_prob=d.min_token_prob)
    raw = d.cache.speculate("a", ctx[-d.max_tree_depth:], use_tree_spec=True, **kw)
    chain = d.cache.speculate("a", ctx[-d.max_tree_depth:], use_tree_spec=False, **kw)
    assert len(raw.token_ids) <= budget and len(chain.token_ids) <= budget
    assert all(par < i for i, par in enumerate(raw.parents))
    assert p.tree.duplicate_siblings() == []
    assert p.num_nodes <= budget
    # the linear draft (what vLLM's `suffix` method verifies) is the proposal's first chain
    nc = len(chain.token_ids)
    assert p.tree.parents.tolist()[:nc] == list(range(-1, nc - 1))
    assert p.tree.tokens.tolist()[:nc] == list(chain.token_ids)
    # every library tree path is in the proposal when the budget leaves room for all of them
    paths = {tuple(p.tree.path_tokens(i)) for i in range(p.num_nodes)}
    lib = Tree(raw.parents, raw.token_ids) if raw.token_ids else None
    if lib is not None and p.num_nodes < budget:
        assert all(tuple(lib.path_tokens(i)) in paths for i in range(lib.num_nodes))
