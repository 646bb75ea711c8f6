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


def test_a_longer_match_scores_higher_at_the_same_frequency():
    """Each context has one earlier occurrence of its matched suffix: a 1-token match ("50") and a 6-token match
    ("3 4 5 6 7 8"). The score f x m / (m + depth) ranks the long match's continuation first; the library's
    frequency alone does not (it is no higher for the long match)."""
    d = _drafter()
    short_ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 20, 30, 40, 50]
    long_ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 60, 61, 62, 63, 64, 65, 66, 3, 4, 5, 6, 7, 8]
    out = {}
    for rid, ctx in (("short", short_ctx), ("long", long_ctx)):
        d.start_request(rid, ctx)
        (p,) = d.propose([DraftRequest(rid, ctx)], [1])
        lib = d.cache.speculate(rid, ctx, max_spec_tokens=1, max_spec_factor=4.0, min_token_prob=0.0)
        assert p.tree.tokens.tolist() == list(lib.token_ids)
        assert float(p.scores[0]) == pytest.approx(lib.probs[0] * lib.match_len / (lib.match_len + 1))
        out[rid] = (lib.match_len, lib.probs[0], float(p.scores[0]))
        d.finish_request(rid)
    assert out["short"][0] == 1 and out["long"][0] == 6
    assert out["long"][1] <= out["short"][1] and out["long"][2] > out["short"][2]


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
    with pytest.raises(DrafterError, match="branch_spec_factor"):
        SuffixTreeDrafter(branch_spec_factor=0.0)
    with pytest.raises(DrafterError, match="branch_min_token_prob"):
        SuffixTreeDrafter(branch_min_token_prob=-0.1)


def _library(d: SuffixTreeDrafter, ctx, budget: int, tree_spec: bool, factor: float, min_prob: float):
    return d.cache.speculate("a", ctx[-d.max_tree_depth:], use_tree_spec=tree_spec, max_spec_tokens=budget,
                             max_spec_factor=factor, max_spec_offset=d.max_spec_offset, min_token_prob=min_prob)


def test_linear_caps_cap_the_chain_and_the_branches_spend_the_budget():
    """vLLM's defaults (factor 1, min frequency 0.1): the chain is the linear draft; the tree adds the branches."""
    d = SuffixTreeDrafter()  # vLLM's linear defaults for the chain, branches capped by the budget alone
    d.start_request("a", PROMPT)
    ctx = PROMPT + [9, 4, 5]  # the longest match is "4 5": the linear caps allow 2 tokens
    budget = 8
    (p,) = d.propose([DraftRequest("a", ctx)], [budget])
    chain = _library(d, ctx, budget, False, 1.0, 0.1)
    nc = len(chain.token_ids)
    assert 1 <= nc < budget  # the linear caps leave budget unused ...
    assert p.tree.tokens.tolist()[:nc] == list(chain.token_ids)
    assert p.tree.parents.tolist()[:nc] == list(range(-1, nc - 1))
    assert nc < p.num_nodes <= budget  # ... which the branches spend
    assert (11,) in _paths(p.tree) and (6, 7, 8, 4, 5) in _paths(p.tree)  # a sibling and a deeper continuation
    assert p.linear_len == nc  # the linear draft is marked for the shape policy's `linear` plan
    # a request that will verify the linear draft alone (`linear` plan): the chain, without the branch call
    (lin,) = d.propose([DraftRequest("a", ctx, linear_only=True)], [budget])
    assert lin.tree.tokens.tolist() == list(chain.token_ids) and lin.linear_len == lin.num_nodes == nc
    # branches off ("tree": "chain:K"): exactly the linear draft
    c = SuffixTreeDrafter(branches=False)
    c.start_request("a", PROMPT)
    (q,) = c.propose([DraftRequest("a", ctx)], [budget])
    assert q.tree.tokens.tolist() == list(chain.token_ids) and q.tree.parents.tolist() == list(range(-1, nc - 1))
    # scores: path frequency x m / (m + depth), m the match length (2 here)
    m = chain.match_len
    assert m == 2
    assert q.scores.tolist() == pytest.approx([f * m / (m + d + 1) for d, f in enumerate(chain.probs)])
    # branch caps equal to the chain's: the library's tree under the linear caps (the tree before the branch caps)
    e = SuffixTreeDrafter(branch_spec_factor=1.0, branch_min_token_prob=0.1)
    e.start_request("a", PROMPT)
    (r,) = e.propose([DraftRequest("a", ctx)], [budget])
    lib = _library(e, ctx, budget, True, 1.0, 0.1)
    assert _paths(r.tree) == _paths(Tree(lib.parents, lib.token_ids)) | _paths(q.tree)
    assert r.num_nodes < p.num_nodes


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=2, max_size=60),
    st.lists(st.integers(0, 4), min_size=1, max_size=30),
    st.integers(1, 12),
)
def test_library_trees_are_topological_with_distinct_siblings_and_passed_through(prompt, response, budget):
    """The proposal = the library's best chain, then its tree's branches (merged, best-first, to budget)."""
    d = _drafter(min_token_prob=0.1, max_spec_factor=1.0)
    d.start_request("a", prompt)
    ctx = prompt + response
    (p,) = d.propose([DraftRequest("a", ctx)], [budget])
    chain = _library(d, ctx, budget, False, 1.0, 0.1)  # the chain's caps
    raw = _library(d, ctx, budget, True, float(budget), 0.0)  # the branches': the budget alone
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
