"""The greedy-identity oracle's rule (tests/fixtures/greedy_oracle.py) on synthetic runs, without an engine."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "fixtures"))
from greedy_oracle import NEAR_TIE_BF16, GreedyOracle, OracleRejection  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5]]
BASE = [[10, 11, 12, 13, 14], [20, 21, 22, 23]]


def _oracle(ref_rows, continuation, control=None):
    """ref_rows: context -> {token: logprob}; continuation: context -> greedy tokens (enough of them)."""
    calls = {"reference": [], "continue": []}

    def reference(contexts, pairs):
        calls["reference"].append(contexts)
        out = []
        for c in contexts:
            row = dict(ref_rows[tuple(c)])
            out.append({**row, None: max(row.values())})
        return out

    def continue_greedy(contexts, n_tokens):
        calls["continue"].append(contexts)
        return [list(continuation[tuple(c)][:n]) for c, n in zip(contexts, n_tokens)]

    return GreedyOracle(reference, continue_greedy, NEAR_TIE_BF16, control), calls


def test_identical_runs_pass_without_engine_calls():
    oracle, calls = _oracle({}, {})
    assert oracle.check(PROMPTS, BASE, [list(b) for b in BASE]).lines() == []
    assert calls == {"reference": [], "continue": []}


def test_one_near_tie_then_the_exact_continuation_is_excused():
    spec = [[10, 11, 99, 50, 51], BASE[1]]
    ctx = tuple(PROMPTS[0] + [10, 11])
    oracle, calls = _oracle({ctx: {12: -0.50, 99: -0.51, 7: -3.0}}, {ctx + (99,): [50, 51]},
                            control=lambda idx: [[10, 11, 99, 50, 51] for _ in idx])
    with pytest.warns(UserWarning, match="excused as a near-tie"):
        report = oracle.check(PROMPTS, BASE, spec)
    (e,) = report.excuses
    assert (e.prompt, e.position, e.base_token, e.spec_token) == (0, 2, 12, 99)
    assert e.margin == pytest.approx(0.01) and e.gap_to_top == pytest.approx(0.01)
    assert calls["reference"] == [[list(ctx)]]  # teacher-forced over the shared prefix
    assert report.control == ["prompt 0: vLLM's linear speculation differs from no speculation at token 2 "
                              "(the same position as here, 2)"]


def test_a_second_divergence_is_never_excused():
    spec = [[10, 11, 99, 50, 52], BASE[1]]
    ctx = tuple(PROMPTS[0] + [10, 11])
    oracle, _ = _oracle({ctx: {12: -0.50, 99: -0.50}}, {ctx + (99,): [50, 51]})
    with pytest.raises(OracleRejection, match="second divergence is never excused") as rejected:
        oracle.check(PROMPTS, BASE, spec)
    assert len(rejected.value.report.excuses) == 1


@pytest.mark.parametrize("row", [{21: -0.5, 98: -0.5 - 2 * NEAR_TIE_BF16},  # beyond the bound
                                 {21: -0.5, 7: -0.5}])  # the spec token is not in the reference's top
def test_no_near_tie_is_rejected(row):
    spec = [BASE[0], [20, 98, 22, 23]]
    oracle, calls = _oracle({tuple(PROMPTS[1] + [20]): row}, {})
    with pytest.raises(OracleRejection, match="prompt 1: greedy output differs at token 1.*not a near-tie"):
        oracle.check(PROMPTS, BASE, spec)
    assert calls["continue"] == []


def test_near_tie_of_two_tokens_below_the_top_is_rejected():
    """Both tokens close to each other but not to the reference's top: the base itself was no argmax there."""
    spec = [[10, 11, 99, 50, 51], BASE[1]]
    ctx = tuple(PROMPTS[0] + [10, 11])
    oracle, _ = _oracle({ctx: {5: 0.0, 12: -1.0, 99: -1.0}}, {ctx + (99,): [50, 51]})
    with pytest.raises(OracleRejection, match="not a near-tie"):
        oracle.check(PROMPTS, BASE, spec)


def test_without_reference_nothing_is_excused():
    with pytest.raises(OracleRejection, match="excuses nothing"):
        GreedyOracle(None, None, 0.0).check(PROMPTS, BASE, [BASE[0], [20, 21, 22, 24]])
