"""The drafter interface (drafters/base.py): request/proposal validation, lifecycle, canonical trees."""

from __future__ import annotations

import pytest
import torch

from vllm_tree_spec.drafters.base import (
    DraftRequest,
    DrafterError,
    TreeDrafter,
    TreeProposal,
    canonical_tree,
    deterministic_mode,
)
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode


class ScriptedDrafter(TreeDrafter):
    """Returns whatever the test put in `next` (to exercise the checks around _propose)."""

    vocab_size = 10

    def __init__(self):
        super().__init__()
        self.next: list[TreeProposal] = []
        self.started, self.finished = [], []

    def _start(self, req_id, prompt_token_ids):
        self.started.append(req_id)

    def _finish(self, req_id):
        self.finished.append(req_id)

    def _propose(self, requests, budgets):
        return self.next


def _tree(parents, tokens):
    return Tree(torch.tensor(parents), torch.tensor(tokens))


def _q(rows, vocab=10):
    return torch.full((rows, vocab), 1.0 / vocab)


# -- DraftRequest / deterministic_mode ----------------------------------------------------------


def test_draft_request_validation():
    assert DraftRequest("r", [1, 2, 3]).root_token == 3
    assert DraftRequest("r", torch.tensor([4, 5])).root_token == 5
    with pytest.raises(DrafterError, match="token_ids is empty"):
        DraftRequest("r", [])
    with pytest.raises(DrafterError, match="temperature"):
        DraftRequest("r", [1], temperature=-0.5)
    with pytest.raises(DrafterError, match="temperature"):
        DraftRequest("r", [1], temperature=float("nan"))


def test_deterministic_mode_is_greedy_only_at_temperature_zero():
    assert deterministic_mode(0.0) == Mode.GREEDY
    assert deterministic_mode(1e-6) == Mode.DETERMINISTIC
    assert deterministic_mode(1.0) == Mode.DETERMINISTIC


# -- TreeProposal.validate ----------------------------------------------------------------------


def test_valid_proposals_pass():
    TreeProposal.empty().validate(0, 10)
    TreeProposal(_tree([-1, -1, 0], [1, 2, 1]), Mode.DETERMINISTIC).validate(3, 10)
    q = _q(4)
    TreeProposal(_tree([-1, -1, 0], [1, 1, 1]), Mode.SAMPLED, q).validate(3, 10)  # i.i.d. may repeat
    TreeProposal(_tree([-1, -1, 0], [1, 2, 1]), Mode.SAMPLED_WITHOUT_REPLACEMENT, q).validate(3, 10)
    # A deterministic tree may carry a diagnostic q with empty rows (rows never expanded).
    TreeProposal(_tree([-1], [1]), Mode.DETERMINISTIC, torch.zeros(2, 10)).validate(1, 10)


@pytest.mark.parametrize(
    "proposal, budget, match",
    [
        (TreeProposal(_tree([-1, 0], [1, 2]), Mode.DETERMINISTIC), 1, "budget is 1"),
        (TreeProposal(Tree(torch.tensor([-1])), Mode.DETERMINISTIC), 1, "no tokens"),
        (TreeProposal(_tree([-1, -1], [3, 3]), Mode.DETERMINISTIC), 2, "same token 3"),
        (TreeProposal(_tree([-1, -1], [3, 3]), Mode.GREEDY), 2, "same token 3"),
        (TreeProposal(_tree([-1, -1], [3, 3]), Mode.SAMPLED_WITHOUT_REPLACEMENT, _q(3)), 2, "same token"),
        (TreeProposal(_tree([-1], [3]), Mode.SAMPLED), 1, "needs draft_probs"),
        (TreeProposal(_tree([-1], [3]), Mode.SAMPLED, _q(3)), 1, r"\[N \+ 1, V\]"),
        (TreeProposal(_tree([-1], [3]), Mode.SAMPLED, _q(2, vocab=11)), 1, "vocab 11"),
        (TreeProposal(_tree([-1], [3]), Mode.SAMPLED, _q(2) * 2), 1, r"draft_probs\[0\] sums to 2"),
        (TreeProposal(_tree([-1], [3]), Mode.SAMPLED, -_q(2)), 1, "negative"),
        (TreeProposal(_tree([-1], [12]), Mode.DETERMINISTIC), 1, ">= vocab_size 10"),
        (TreeProposal(_tree([-1], [-2]), Mode.DETERMINISTIC), 1, "negative id"),
        (TreeProposal(_tree([-1], [1]), Mode.DETERMINISTIC, scores=torch.zeros(2)), 1, "scores"),
        (TreeProposal(_tree([-1], [1]), "deterministic"), 1, "verify.Mode"),
    ],
)
def test_invalid_proposals_are_rejected(proposal, budget, match):
    with pytest.raises(DrafterError, match=match):
        proposal.validate(budget, 10)


def test_sampled_proposal_token_with_zero_draft_probability_is_rejected():
    q = _q(2)
    q[0] = 0
    q[0, 5] = 1.0
    with pytest.raises(DrafterError, match="q = 0"):
        TreeProposal(_tree([-1], [3]), Mode.SAMPLED, q).validate(1, 10)
    TreeProposal(_tree([-1], [5]), Mode.SAMPLED, q).validate(1, 10)


# -- lifecycle and propose checks ---------------------------------------------------------------


def test_lifecycle_errors():
    d = ScriptedDrafter()
    with pytest.raises(DrafterError, match="not active"):
        d.propose([DraftRequest("a", [1])], [1])
    with pytest.raises(DrafterError, match="prompt_token_ids is empty"):
        d.start_request("a", [])
    d.start_request("a", [1, 2])
    with pytest.raises(DrafterError, match="already active"):
        d.start_request("a", [1, 2])
    assert d.active_requests == ["a"] and d.started == ["a"]
    d.finish_request("a")
    assert d.finished == ["a"] and d.active_requests == []
    with pytest.raises(DrafterError, match="not active"):
        d.finish_request("a")
    d.start_request("a", [7])  # ids are reusable after finish


def test_propose_checks_inputs_and_outputs():
    d = ScriptedDrafter()
    d.start_request("a", [1, 2, 3])
    d.start_request("b", [4])
    ra, rb = DraftRequest("a", [1, 2, 3, 4]), DraftRequest("b", [4])
    with pytest.raises(DrafterError, match="one budget per request"):
        d.propose([ra, rb], [1])
    with pytest.raises(DrafterError, match="must be >= 0"):
        d.propose([ra], [-1])
    with pytest.raises(DrafterError, match="appears twice"):
        d.propose([ra, ra], [1, 1])
    with pytest.raises(DrafterError, match="fewer than its 3-token prompt"):
        d.propose([DraftRequest("a", [1, 2])], [1])
    d.next = [TreeProposal.empty()]
    with pytest.raises(DrafterError, match="returned 1 proposals for 2"):
        d.propose([ra, rb], 1)
    d.next = [TreeProposal(_tree([-1, 0], [1, 2]), Mode.DETERMINISTIC)]
    with pytest.raises(DrafterError, match="ScriptedDrafter proposal for request 'a'.*budget is 1"):
        d.propose([ra], 1)
    assert d.propose([ra], [2])[0].num_nodes == 2  # an int budget or a list
    d.validate_proposals = False
    assert d.propose([ra], 1)[0].num_nodes == 2  # checks off: passed through


# -- canonical_tree -----------------------------------------------------------------------------


def test_canonical_tree_keeps_a_topological_order_and_truncates_to_a_prefix():
    tree, scores = canonical_tree([-1, 0, 1, -1], [5, 6, 7, 8], [0.9, 0.8, 0.7, 0.1])
    assert tree.parents.tolist() == [-1, 0, 1, -1] and tree.tokens.tolist() == [5, 6, 7, 8]
    assert scores.tolist() == [0.9, 0.8, 0.7, 0.1]
    tree, scores = canonical_tree([-1, 0, 1, -1], [5, 6, 7, 8], [0.9, 0.8, 0.7, 0.1], budget=2)
    assert tree.parents.tolist() == [-1, 0] and tree.tokens.tolist() == [5, 6] and scores.tolist() == [0.9, 0.8]
    assert canonical_tree([-1], [5], budget=0)[0].num_nodes == 0


def test_canonical_tree_reorders_children_listed_before_parents():
    # node 0 is a child of node 2, node 1 of node 0: a valid tree listed out of order.
    tree, _ = canonical_tree([2, 0, -1], [10, 11, 12])
    assert tree.tokens.tolist() == [12, 10, 11] and tree.parents.tolist() == [-1, 0, 1]


def test_canonical_tree_merges_duplicate_siblings_recursively():
    #        root                      root
    #       /    \          ->          |
    #     a(0)   a(1)                  a
    #     |       |  \                / \
    #    b(2)   b(3) c(4)            b   c
    #     |      |                   |
    #    d(5)   e(6)                d  e
    parents = [-1, -1, 0, 1, 1, 2, 3]
    tokens = [1, 1, 2, 2, 3, 4, 5]
    tree, scores = canonical_tree(parents, tokens, [0.5, 0.6, 0.2, 0.3, 0.1, 0.05, 0.04])
    assert tree.duplicate_siblings() == []
    assert tree.num_nodes == 5
    paths = sorted(tuple(tree.path_tokens(i)) for i in range(tree.num_nodes))
    assert paths == [(1,), (1, 2), (1, 2, 4), (1, 2, 5), (1, 3)]
    by_path = {tuple(tree.path_tokens(i)): float(scores[i]) for i in range(tree.num_nodes)}
    assert by_path[(1,)] == 0.6 and by_path[(1, 2)] == 0.3  # merged nodes keep the larger score


@pytest.mark.parametrize(
    "parents, tokens, match",
    [
        ([-1, 0], [1], "one entry per node"),
        ([-1, 5], [1, 2], r"parents\[1\] = 5"),
        ([-1, 1], [1, 2], r"parents\[1\] = 1"),
        ([1, 0], [1, 2], "cycle"),
    ],
)
def test_canonical_tree_rejects_malformed_input(parents, tokens, match):
    with pytest.raises(DrafterError, match=match):
        canonical_tree(parents, tokens)


def test_an_empty_sampled_proposal_needs_no_q():
    """Budget 0 in a sampled mode (the shape policy may ask for no speculation): nothing was drawn, so the
    proposal carries no draft_probs and is valid (it crashed the engine's drafter validation before)."""
    from vllm_tree_spec.drafters.base import TreeProposal
    from vllm_tree_spec.verify import Mode

    for mode in (Mode.SAMPLED, Mode.SAMPLED_WITHOUT_REPLACEMENT):
        TreeProposal.empty(mode).validate(0, 100)
