"""Tree policies (drafters/policy.py): parsing, budgets, per-budget Sequoia shapes."""

from __future__ import annotations

import pytest
import torch

from vllm_tree_spec import build
from vllm_tree_spec.drafters.base import DraftRequest, DrafterError
from vllm_tree_spec.drafters.policy import DynamicPolicy, SampledPolicy, StaticPolicy, parse_policy
from vllm_tree_spec.tree import Tree, TreeError, TreeShape


def test_parse_policy_dispatches_on_the_shape_kind():
    assert parse_policy("s3_k2_d6") == DynamicPolicy(TreeShape(3, 2, 6))
    assert parse_policy(TreeShape(2, 2, 4)) == DynamicPolicy(TreeShape(2, 2, 4))
    assert parse_policy("[(0,), (1,), (0, 0)]") == StaticPolicy(((0,), (1,), (0, 0)))
    assert parse_policy([(0, 0), 0]) == StaticPolicy(((0,), (0, 0)))  # bare ints are depth-1 paths
    pol = SampledPolicy.of([(0,)], replacement=True)
    assert parse_policy(pol) is pol
    with pytest.raises(TreeError, match="prefix-closed"):
        parse_policy([(0, 0)])
    with pytest.raises(TreeError):
        parse_policy("s3_k2")


def test_static_budget_keeps_a_prefix_of_the_priority_order():
    pol = StaticPolicy.of([(0,), (1,), (0, 0), (2,), (0, 0, 0)])
    assert pol.paths == ((0,), (1,), (2,), (0, 0), (0, 0, 0))  # Tree.from_paths order: depth, then rank
    assert pol.for_budget(2).paths == ((0,), (1,))
    assert pol.for_budget(99) == pol and pol.for_budget(0).max_nodes == 0
    # A Tree keeps its own (best-first) node order: here the chain before the second root child.
    chain_first = Tree(torch.tensor([-1, 0, 1, -1]))
    assert StaticPolicy.of(chain_first).for_budget(3).paths == ((0,), (0, 0), (0, 0, 0))
    # Skipped ranks survive (the best and the third-best child).
    assert StaticPolicy.of([(0,), (2,)]).paths == ((0,), (2,))
    with pytest.raises(DrafterError, match="budget"):
        pol.for_budget(-1)


def test_dynamic_and_sampled_budgets():
    dyn = DynamicPolicy.of("s5_k2_d9")
    assert dyn.max_nodes == 8
    assert dyn.for_budget(3).shape == TreeShape(3, 2, 4)  # no more steps than nodes
    assert dyn.for_budget(20).shape == TreeShape(5, 2, 9)
    assert dyn.for_budget(0) is None
    assert DynamicPolicy.from_budget(depth=3, topk=2, budget=6) == DynamicPolicy(TreeShape(3, 2, 7))
    samp = SampledPolicy.of([(0,), (1,), (0, 0)], replacement=True)
    assert samp.for_budget(2) == SampledPolicy(((0,), (1,)), True)
    assert samp.as_static() == StaticPolicy(((0,), (1,), (0, 0)))


def test_per_budget_shapes_from_sequoia():
    acceptance = [0.6, 0.2, 0.1]
    trees = build.optimal_static_trees(acceptance, 6, 3)
    pol = StaticPolicy.from_trees(trees)
    assert pol.max_nodes == 6
    for n in range(7):
        assert pol.for_budget(n).paths == StaticPolicy.of(trees[n]).paths
    assert pol.for_budget(50).paths == StaticPolicy.of(trees[6]).paths
    # A budget with no listed shape falls back to the largest smaller one.
    gappy = StaticPolicy.from_trees([None, Tree.from_paths([(0,)]), None, Tree.from_paths([(0,), (1,), (0, 0)])])
    assert gappy.for_budget(2).paths == ((0,),) and gappy.for_budget(0).paths == ()
    with pytest.raises(DrafterError, match=r"trees\[2\] has 1 nodes"):
        StaticPolicy.from_trees([None, None, Tree.from_paths([(0,)])])
    with pytest.raises(DrafterError, match="no shape"):
        StaticPolicy.from_trees([None, None])


def test_per_budget_shapes_through_a_drafter():
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_llama

    from vllm_tree_spec.drafters.draft_model import DraftModelTreeDrafter

    trees = build.optimal_static_trees([[0.5, 0.3], [0.7, 0.1]], 5, 3)
    model = build_tiny_llama(seed=2, vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16)
    d = DraftModelTreeDrafter(model, StaticPolicy.from_trees(trees))
    d.start_request("a", [1, 2, 3])
    d.start_request("b", [4, 5])
    for budget in range(6):
        pa, pb = d.propose([DraftRequest("a", [1, 2, 3]), DraftRequest("b", [4, 5])], [budget, 5])
        assert torch.equal(pa.tree.parents, trees[budget].parents)
        assert torch.equal(pb.tree.parents, trees[5].parents)
