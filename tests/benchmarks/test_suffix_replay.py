"""The suffix replay (benchmarks/step/suffix_replay.py): its greedy acceptance walk and its drafters, no model."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("arctic_inference.suffix_decoding")

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("suffix_replay", ROOT / "benchmarks" / "step" / "suffix_replay.py")
replay_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_mod)


def test_accepted_follows_the_longest_matching_path():
    #        0      1      2      3      4
    parents = [-1, 0, -1, 2, 3]
    tokens = [5, 6, 7, 8, 9]
    assert replay_mod.accepted(parents, tokens, [7, 8, 9, 1]) == 3
    assert replay_mod.accepted(parents, tokens, [5, 6, 7]) == 2
    assert replay_mod.accepted(parents, tokens, [5, 1]) == 1
    assert replay_mod.accepted(parents, tokens, [4]) == 0
    assert replay_mod.accepted([], [], [4]) == 0
    assert replay_mod.accepted(parents, tokens, [7, 8]) == 2  # the output ends inside the tree


def test_replay_counts_every_output_token_once_and_the_tree_contains_the_chain():
    period = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    data = [dict(prompt=period * 2 + [7], output=(period * 5)[:37]),
            dict(prompt=[8, 8] + period, output=(period * 3)[2:25])]
    res = {name: replay_mod.replay(data, make, 6) for name, make in replay_mod.drafters()}
    for r in res.values():
        assert r["tokens"] == 36 + 22  # the first token of each output is the prefill's
        assert 1.0 <= r["tok_per_step"] <= 7.0 and r["steps"] * r["tok_per_step"] == pytest.approx(r["tokens"])
    # the tree holds the linear chain: on this periodic text it needs no more steps
    assert res["tree"]["steps"] <= res["linear"]["steps"]
    assert res["tree"]["rows_per_step"] >= res["tree-capped"]["rows_per_step"]
    assert res["linear"]["tok_per_step"] > 1.5  # a periodic text is drafted


def test_gate_sweep_counts_the_tree_and_its_linear_draft_under_each_gate():
    period = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    data = [dict(prompt=period * 2 + [7], output=(period * 5)[:37])]
    sweep = replay_mod.gate_sweep(data, 6, [0.0, 0.5, 1.01])
    steps = {v[0] for v in sweep.values()}
    assert len(steps) == 1  # every variant is counted at every step of the same walk
    (n,) = steps
    for name in ("tree", "linear"):
        free, half, shut = sweep[(name, 0.0)], sweep[(name, 0.5)], sweep[(name, 1.01)]
        assert free[1] >= half[1] >= shut[1] == n  # a stricter gate accepts no more; above every score: no drafts
        assert free[2] >= half[2] >= shut[2] == n  # and verifies no more rows (1 a step at least)
    assert sweep[("tree", 0.0)][1] >= sweep[("linear", 0.0)][1]  # the tree holds its linear draft
    assert sweep[("linear", 0.0)][1] > n  # the periodic text is drafted and accepted
