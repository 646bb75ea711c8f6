"""`"tree": "chain:K"` with the model-free drafters: the proposer verifies the drafter's best chain only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_tree_spec.config import TreeSpecConfig
from vllm_tree_spec.drafters.base import DraftRequest
from vllm_tree_spec.integration.proposer import TreeProposer, chain_plan

# two earlier matches of the suffix [1, 2], equally long, that disagree after it: the n-gram trie branches at
# the root (the more recent one, 9 1 2, ranks first)
CONTEXT = [5, 1, 2, 3, 4, 6, 7, 8, 1, 2, 9, 1, 2]


def _proposer(**keys) -> TreeProposer:
    cfg = TreeSpecConfig(method="tree", drafter="ngram", budgets={"8": 6}, **keys)
    vllm_config = SimpleNamespace(additional_config={"tree_spec": cfg.model_dump()},
                                  scheduler_config=SimpleNamespace(max_num_seqs=8))
    return TreeProposer(vllm_config)


def _propose(proposer: TreeProposer):
    proposer.drafter.start_request("r", CONTEXT)
    return proposer.propose_trees([DraftRequest("r", CONTEXT, 0.0)], [6])[0]


def test_ngram_chain_layout_prunes_to_the_rank0_path():
    full = _propose(_proposer(num_speculative_tokens=6))
    assert full.tree.max_children > 1  # the case under test: the drafter's own tree branches
    chain = _propose(_proposer(tree="chain:6"))
    assert chain.tree.max_children == 1 and chain.tree.parents.tolist() == list(range(-1, chain.tree.num_nodes - 1))
    # the best child at every level: the first branch of the full tree
    first = [i for i, r in enumerate(full.tree.sibling_rank.tolist()) if r == 0]
    on_path, path = {-1}, []
    for i in first:
        if int(full.tree.parents[i]) in on_path:
            on_path.add(i)
            path.append(int(full.tree.tokens[i]))
    assert chain.tree.tokens.tolist() == path == [9, 1, 2]


@pytest.mark.parametrize("keys, pruned", [
    (dict(drafter="ngram", tree="chain:6"), True),
    (dict(drafter="suffix", tree="chain:6"), True),
    (dict(drafter="ngram", num_speculative_tokens=6), False),
    (dict(drafter="suffix", tree="s3_k2_d6"), False),
])
def test_chain_plan_only_for_explicit_chains_of_model_free_drafters(keys, pruned):
    assert (chain_plan(TreeSpecConfig(method="tree", **keys)) is not None) == pruned


def test_suffix_chain_layout_is_vllms_linear_draft():
    """"chain:K" with the suffix drafter: its branches are not drafted; the proposal is the library's chain."""
    pytest.importorskip("arctic_inference.suffix_decoding")
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 4, 5, 6, 9, 10, 4, 5, 6, 7, 8, 4, 5, 11, 9, 4, 5]

    def proposer(**keys):
        cfg = TreeSpecConfig(method="tree", drafter="suffix", budgets={"8": 6}, **keys)
        p = TreeProposer(SimpleNamespace(additional_config={"tree_spec": cfg.model_dump()},
                                         scheduler_config=SimpleNamespace(max_num_seqs=8)))
        p.drafter.start_request("r", prompt)
        return p

    chain_p = proposer(tree="chain:6")
    assert chain_p.drafter.branches is False
    chain = chain_p.propose_trees([DraftRequest("r", prompt, 0.0)], [6])[0].tree
    lib = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
    lib.start_request("r", prompt)
    linear = lib.speculate("r", prompt, max_spec_tokens=6)  # vLLM's linear `suffix` call, its defaults
    assert chain.tokens.tolist() == list(linear.token_ids) and len(linear.token_ids) >= 1
    full = proposer(num_speculative_tokens=6).propose_trees([DraftRequest("r", prompt, 0.0)], [6])[0].tree
    assert full.num_nodes > chain.num_nodes  # the default tree spends the budget the chain's caps leave
