"""Budget planner (vllm_tree_spec/planner.py) and the `vllm-tree-spec plan` command.

The chain figures are exact (Leviathan et al.'s formula); the tree planner is
checked against brute force over every small tree and for the behaviour the
cost model implies: large trees at batch 1, smaller ones as B * nodes passes
the GEMM knee, no speculation once even one draft node costs more than it
returns.
"""

from __future__ import annotations

import json
import math

import pytest

from vllm_tree_spec.build import expected_accepted_length, optimal_static_tree
from vllm_tree_spec.cli import SUBCOMMANDS, build_parser, main
from vllm_tree_spec.planner import (
    CostModel,
    RooflineVerify,
    TableVerify,
    chain_expected_tokens,
    depth_decay_table,
    describe_tree,
    plan_budgets,
    plan_chain,
    plan_trees,
    shape_hint,
)
from vllm_tree_spec.tree import Tree


CHAIN = ["plan", "--gamma", "4", "--verify-ms", "12", "--state-ms", "2", "--baseline-ms", "10"]
ACC = depth_decay_table([0.6, 0.15, 0.05], 0.9, 8)


def all_trees(n: int, max_depth: int, ranks: int):
    """Every tree of exactly n >= 1 nodes, depth <= max_depth, <= ranks children per node."""

    def forests(m: int, depth: int, rank: int):
        if m == 0:
            yield []
        elif depth <= max_depth and rank < ranks:
            for size in range(1, m + 1):
                for sub in forests(size - 1, depth + 1, 0):
                    for rest in forests(m - size, depth, rank + 1):
                        yield [(rank,)] + [(rank,) + p for p in sub] + rest

    for paths in forests(n, 1, 0):
        yield Tree.from_paths(paths)


def run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------
# Chains


@pytest.mark.parametrize(
    "alpha, draft_ms, expect",
    [
        ("0.8", "1", ["expected tokens/step: 3.3616", "ms/token: 5.355", "speedup: 1.868x"]),
        ("0.9", "3", ["expected tokens/step: 4.0951", "ms/token: 6.349", "speedup: 1.575x"]),
    ],
)
def test_chain_cli_figures(alpha, draft_ms, expect, capsys):
    rc, out, err = run(CHAIN + ["--alpha", alpha, "--draft-ms", draft_ms], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    for line in expect:
        assert line in lines


def test_chain_formula():
    for a in (0.0, 0.3, 0.8, 0.999):
        for g in (0, 1, 5):
            assert chain_expected_tokens(a, g) == pytest.approx((1 - a ** (g + 1)) / (1 - a))
    assert chain_expected_tokens(1.0, 4) == 5.0
    p = plan_chain(0.8, 4, 1, 12, 2, 10)
    assert p.cycle_ms == 18.0 and p.ms_per_token == pytest.approx(18 / 3.3616)
    assert p.speedup == pytest.approx(10 * 3.3616 / 18)
    # the chain formula is expected_accepted_length of a chain with a = [alpha]
    assert expected_accepted_length(Tree.chain(4), [0.8]) == pytest.approx(p.expected_tokens)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--alpha", "1.5", "--draft-ms", "1"], "alpha = 1.5"),
        (["--alpha", "0.8"], "needs --draft-ms"),
        (["--alpha", "0.8", "--draft-ms", "-1"], "draft_ms = -1"),
        (["--alpha", "0.8", "--draft-ms", "1", "--rank-acceptance", "0.5"], "--alpha selects chain mode"),
    ],
)
def test_chain_cli_errors(extra, match, capsys):
    rc, out, err = run(CHAIN + extra, capsys)
    assert rc == 2 and out == "" and match in err


def test_plan_without_a_mode_is_an_error(capsys):
    rc, _, err = run(["plan"], capsys)
    assert rc == 2 and "--alpha (chain mode)" in err


def test_subcommands_are_registered_in_one_place():
    names = [c.name for c in SUBCOMMANDS]
    assert names == ["plan", "demo", "serve", "model-path"]
    assert len(set(names)) == len(names)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["nope"])


# ---------------------------------------------------------------------------
# Cost model


def test_roofline_verify():
    v = RooflineVerify(weights_ms=10, knee_tokens=100, token_ms=0.01)
    assert v.forward_ms(1, 1) == pytest.approx(10.01)
    assert v.forward_ms(10, 10) == pytest.approx(10 + 1.0)  # at the knee
    assert v.forward_ms(20, 10) == pytest.approx(20 + 2.0)  # past it: linear in B * t


def test_table_verify_interpolates_and_never_extrapolates():
    v = TableVerify(ms={1: {1: 10.0, 9: 12.0}, 4: {1: 11.0, 9: 20.0}})
    assert v.forward_ms(1, 1) == 10.0
    assert v.forward_ms(1, 5) == pytest.approx(11.0)
    assert v.forward_ms(4, 9) == 20.0
    assert v.forward_ms(2, 9) == pytest.approx(12.0 + (20.0 - 12.0) / 3)  # linear in B between rows
    assert v.max_tokens(2) == 9
    with pytest.raises(ValueError, match="batch sizes 1..4"):
        v.forward_ms(8, 1)
    with pytest.raises(ValueError, match="1..9 tokens"):
        v.forward_ms(1, 10)
    with pytest.raises(ValueError, match="batch 1"):
        TableVerify(ms={1: {}})


def test_cost_model_json_and_unknown_keys():
    text = '{"verify": {"kind": "table", "ms": {"1": {"1": 10, "4": 10.5}}}, "draft_level_ms": 1}'
    cost = CostModel.model_validate_json(text)
    assert cost.baseline_ms(1) == 10.0
    assert cost.step_ms(1, 3, 2) == pytest.approx(2 * 1 + 10.5)
    with pytest.raises(ValueError, match="draft_ms"):
        CostModel.model_validate({"verify": {"kind": "roofline", "weights_ms": 1, "knee_tokens": 1}, "draft_ms": 1})


# ---------------------------------------------------------------------------
# Tree planning


def knee_cost(**kw) -> CostModel:
    """Verification memory-bound up to 128 batch tokens, then linear in B * nodes."""
    base = dict(verify=RooflineVerify(weights_ms=10, knee_tokens=128), draft_level_ms=0.6, state_ms=0.3,
                state_node_ms=0.002)
    return CostModel(**(base | kw))


def test_tree_plans_shrink_as_the_batch_grows():
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    plans = plan_trees(ACC, knee_cost(), batches, max_nodes=32)
    nodes = [0 if p.tree is None else p.tree.num_nodes for p in plans]
    gains = [p.gain for p in plans]
    assert nodes == sorted(nodes, reverse=True)  # budgets never grow with the batch
    assert gains == sorted(gains, reverse=True)
    assert nodes[0] >= 16 and plans[0].tree.max_children > 1  # wide tree where verification is free
    assert plans[0].gain > 2.0 and plans[0].vs_chain > 1.0
    # chains up to max_depth are candidates too, so the plan never loses to the best chain here
    assert all(p.best_chain_nodes <= 8 and p.vs_best_chain >= 1 - 1e-12 for p in plans if p.tree is not None)
    assert plans[0].vs_best_chain > 1.2  # width pays at batch 1
    assert plans[-1].tree is None and plans[-1].gain == 1.0  # speculation stops paying
    es = [p.expected_tokens for p in plans]
    assert es == sorted(es, reverse=True)
    budgets = plan_budgets(ACC, knee_cost(), batches, max_nodes=32)
    assert list(budgets) == batches
    for p in plans:
        t = budgets[p.batch_size]
        assert (t is None) == (p.tree is None)
        assert t is None or t.parents.tolist() == p.tree.parents.tolist()


def test_free_verification_takes_the_whole_budget():
    cost = CostModel(verify=RooflineVerify(weights_ms=10, knee_tokens=1e9))
    (p,) = plan_trees([0.6, 0.2, 0.1], cost, [1], max_nodes=12, max_depth=4)
    assert p.tree.num_nodes == 12
    best = expected_accepted_length(optimal_static_tree([0.6, 0.2, 0.1], 12, 4), [0.6, 0.2, 0.1])
    assert p.expected_tokens == pytest.approx(best)
    assert p.gain == pytest.approx(best)  # step time == baseline


def test_expensive_drafts_mean_no_speculation():
    plans = plan_trees([0.3, 0.1], knee_cost(draft_level_ms=20.0), [1, 8], max_nodes=8)
    assert all(p.tree is None for p in plans)
    assert plan_budgets([0.3, 0.1], knee_cost(draft_level_ms=20.0), [1], max_nodes=8) == {1: None}


@pytest.mark.parametrize("batch", [1, 16, 48])
def test_planner_matches_brute_force_over_small_trees(batch):
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.05], [0.4, 0.1, 0.05]]
    cost = CostModel(verify=RooflineVerify(weights_ms=8, knee_tokens=64, token_ms=0.01), draft_level_ms=0.8,
                     draft_node_ms=0.01, state_ms=0.2, state_node_ms=0.01)
    (p,) = plan_trees(acc, cost, [batch], max_nodes=5, max_depth=3)
    rates = [1 / cost.baseline_ms(batch)]
    for n in range(1, 6):
        for t in all_trees(n, 3, 3):
            rates.append(expected_accepted_length(t, acc) / cost.step_ms(batch, n, t.max_depth))
    assert p.expected_tokens / p.step_ms == pytest.approx(max(rates), rel=1e-12)


def test_table_costs_cap_the_budget():
    cost = CostModel(verify=TableVerify(ms={1: {1: 10.0, 5: 10.0}, 8: {1: 10.0, 3: 10.5}}))
    budgets = plan_budgets([0.7, 0.2], cost, [1, 8], max_nodes=16)
    assert budgets[1].num_nodes == 4 and budgets[8].num_nodes == 2  # tokens = nodes + 1 <= measured


def test_descriptions():
    assert describe_tree(None) == "none"
    assert describe_tree(Tree.chain(3)) == "chain n=3"
    t = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert describe_tree(t) == "n=6 d=3 w=2/3/1"
    assert shape_hint(t) == "s3_k2_d7" and shape_hint(Tree.chain(4)) == "s4_k1_d5"
    wide = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                            (1, 0, 0)])
    assert shape_hint(wide) == "s3_k3_d12"  # k = 2 holds only 2 + 2 * 4 = 10 candidates


def test_tree_cli_table_and_json(tmp_path, capsys):
    args = ["plan", "--rank-acceptance", "0.6,0.15,0.05", "--depth-decay", "0.9", "--batch-sizes", "1,16,256",
            "--max-nodes", "24"]
    rc, out, err = run(args + ["--verify-ms", "10", "--knee-tokens", "128", "--draft-ms", "0.6", "--state-ms", "0.3"],
                       capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split(" | ")[0].strip() == "batch" and len(lines) == 2 + 3
    assert lines[-1].split("|")[1].strip() == "none"

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"verify": {"kind": "roofline", "weights_ms": 10, "knee_tokens": 128},
                                 "draft_level_ms": 0.6, "state_ms": 0.3}))
    rc, out, err = run(args + ["--costs", str(costs), "--json"], capsys)
    assert rc == 0, err
    plan = json.loads(out)
    assert [p["batch_size"] for p in plan] == [1, 16, 256]
    first = plan[0]["tree"]
    assert Tree.from_paths([tuple(p) for p in first["paths"]]).parents.tolist() == first["parents"]
    assert plan[2]["tree"] is None and math.isclose(plan[2]["gain_vs_no_spec"], 1.0)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--rank-acceptance", "0.6,0.5", "--verify-ms", "1", "--knee-tokens", "8"], "sums to 1.1"),
        (["--rank-acceptance", "0.6"], "--verify-ms and --knee-tokens"),
        (["--rank-acceptance", "0.6", "--costs", "/nonexistent.json"], "cannot read costs"),
        (["--rank-acceptance", "0.6", "--verify-ms", "1", "--knee-tokens", "8", "--baseline-ms", "3"], "chain-mode"),
        (["--rank-acceptance", "0.6", "--verify-ms", "1", "--knee-tokens", "8", "--depth-decay", "2"], "decay = 2"),
    ],
)
def test_tree_cli_errors(extra, match, capsys):
    rc, out, err = run(["plan"] + extra, capsys)
    assert rc == 2 and out == "" and match in err


def test_tree_cli_acceptance_file(tmp_path, capsys):
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps([[0.7, 0.1], [0.6, 0.1]]))
    rc, out, err = run(["plan", "--acceptance", str(acc), "--batch-sizes", "1", "--verify-ms", "10",
                        "--knee-tokens", "1000", "--max-nodes", "6", "--json"], capsys)
    assert rc == 0, err
    (row,) = json.loads(out)
    tree = Tree(row["tree"]["parents"])
    assert tree.max_depth <= 2  # default max depth = rows of a per-depth table
    assert row["expected_tokens"] == pytest.approx(expected_accepted_length(tree, [[0.7, 0.1], [0.6, 0.1]]))
