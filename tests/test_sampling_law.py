"""The exact-law builder and check of the sampling tests (tests/fixtures/sampling_law.py), on crafted logits.

No engine: the logits come from small functions of the context, so every branch of `check` is reached
here, in particular the zero-support test on triples outside the law's enumerated prefixes.
"""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "fixtures"))
from sampling_law import Float64Logits, check, exact_law, favoured, prob_of, reference_probs  # noqa: E402

V = 6
PROMPT = [1, 2, 3]


def crafted(contexts):
    """Raw logits [n, V], a fixed function of each context (its length and last token)."""
    rows = []
    for c in contexts:
        g = torch.Generator().manual_seed(1000 * len(c) + c[-1])
        rows.append(torch.randn(V, generator=g, dtype=torch.float64) * 2)
    return torch.stack(rows)


class Recorder:
    """A logits source that records the contexts of every call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, contexts):
        self.calls.append([list(c) for c in contexts])
        return self.fn(contexts)


def test_prob_of_is_the_product_over_contexts_of_different_lengths():
    src = Recorder(crafted)
    params = {"temperature": 0.9}
    triple = (4, 0, 5)
    expected = 1.0
    for k, t in enumerate(triple):
        out = list(triple[:k])
        expected *= float(reference_probs(crafted([PROMPT + out]), params, PROMPT, [out])[0, t])
    assert prob_of(src, PROMPT, params, triple) == pytest.approx(expected, rel=1e-12)
    assert all(len(call) == 1 for call in src.calls), src.calls  # one context at a time
    assert [len(call[0]) for call in src.calls] == [3, 4, 5]


def test_float64_logits_take_contexts_of_different_lengths():
    class Model(torch.nn.Module):  # logits of every position: a function of the token and the position
        def forward(self, ids):
            pos = torch.arange(ids.shape[1], dtype=torch.float64)
            logits = torch.stack([torch.cos(ids * (v + 1) + pos) for v in range(V)], -1)  # [B, L, V]
            return type("Out", (), {"logits": logits})()

    src = Float64Logits(Model(), chunk=2)
    contexts = [PROMPT, PROMPT + [4], PROMPT + [4, 0], PROMPT + [5], PROMPT + [5, 1], PROMPT + [0]]
    rows = src(contexts)
    assert rows.shape == (len(contexts), V) and rows.dtype == torch.float64
    for c, row in zip(contexts, rows):
        assert torch.equal(row, Model()(torch.tensor([c])).logits[0, -1])


def test_exact_law_sums_to_one_without_truncation():
    params = {"temperature": 1.3, "repetition_penalty": 1.4, "presence_penalty": 0.2}
    law = exact_law(crafted, PROMPT, params, min_weight=0.0)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert law[(4, 0, 5)] == pytest.approx(prob_of(crafted, PROMPT, params, (4, 0, 5)), rel=1e-12)


def expected_counts(law: dict, n: int) -> dict:
    """n draws that follow the law as closely as integers can (largest remainders)."""
    exact = {k: v * n / sum(law.values()) for k, v in law.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: n - sum(counts.values())]:
        counts[k] += 1
    return {k: c for k, c in counts.items() if c}


def _min_p_case():
    """A min-p set and a triple whose t3 is masked; the margin by which it is masked, in raw logit units."""
    params = {"temperature": 1.0, "min_p": 0.3}
    law = exact_law(crafted, PROMPT, params)
    t1, t2 = max({k[:2] for k in law}, key=lambda k: sum(v for kk, v in law.items() if kk[:2] == k))
    row = crafted([PROMPT + [t1, t2]])[0]
    p = reference_probs(row[None], {"temperature": 1.0}, PROMPT, [[t1, t2]])[0]
    masked = [t for t in range(V) if p[t] < 0.3 * p.max()]
    t3 = max(masked, key=lambda t: float(p[t]))  # the masked token nearest the threshold
    margin = float(torch.log(0.3 * p.max() / p[t3]))  # its logit must rise by this against the top one
    assert (t1, t2, t3) not in law
    return params, law, (t1, t2, t3), margin


def test_check_flags_an_emitted_triple_outside_the_support():
    params, law, outside, margin = _min_p_case()
    n = 300
    counts = expected_counts(law, n - 1)
    counts[outside] = 1  # one draw the law forbids

    def zero(delta):
        return [f for f in check(crafted, PROMPT, params, counts, n, name="min_p", delta=delta) if "probability 0" in f]

    assert zero(0.0) == [f"min_p: emitted {outside} (1x), which has probability 0"]
    # moved by more than half its margin in its favour (+d for it, -d for the top one), it is inside
    assert zero(0.51 * margin) == []
    assert zero(0.49 * margin) == [f"min_p: emitted {outside} (1x), which has probability 0 even with every logit "
                                   f"moved by {0.49 * margin:.3g} in its favour"]
    assert sum(counts.values()) == n  # the same counts fit the law otherwise:
    del counts[outside]
    counts[max(counts, key=counts.get)] += 1
    assert check(crafted, PROMPT, params, counts, n, name="min_p") == []


def test_check_passes_draws_from_the_law_and_fails_draws_from_another():
    params = {"temperature": 0.8, "top_k": 3, "logit_bias": {2: 1.5}}
    law = exact_law(crafted, PROMPT, params)
    keys = list(law)
    probs = torch.tensor([law[k] for k in keys])
    n = 300
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=g)
    counts = {}
    for i in draws.tolist():
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    assert check(crafted, PROMPT, params, counts, n, name="ok") == []
    # the same draws judged by the law without the bias (a transform skipped): the fit fails
    wrong = {k: v for k, v in params.items() if k != "logit_bias"}
    failures = check(crafted, PROMPT, wrong, counts, n, name="no-bias")
    assert any("chi-square" in f for f in failures), failures


def test_favoured_moves_the_token_up_and_the_rest_down():
    row = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert torch.equal(favoured(row, 1, 0.25), torch.tensor([0.75, 2.25, 2.75], dtype=torch.float64))
    assert torch.equal(row, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))  # not in place
