"""The draft-stage benchmark (benchmarks/step/draft_overhead.py): both stacks replay every output token, no model."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("arctic_inference.suffix_decoding")

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("draft_overhead", ROOT / "benchmarks" / "step" / "draft_overhead.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
def test_both_stacks_replay_every_output_token_with_batching(drafter):
    period = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    data = [dict(prompt=period * 2 + [7], output=(period * 5)[:37]),
            dict(prompt=[8, 8] + period, output=(period * 3)[2:25]),
            dict(prompt=[2, 7, 1, 8] * 3, output=[2, 8, 1, 8, 2, 8] * 4)]
    res = {name: bench.run(name, data, 2, (40.0, 0.6), drafter=drafter) for name in ("linear", "tree")}
    for r in res.values():
        assert r["tokens"] == 36 + 22 + 23  # the first token of each output is the prefill's
        assert 1.0 < r["tok_per_step"] <= 7.0  # periodic text is drafted; at most 6 drafts + the bonus
        assert r["full_steps"] > 0 and r["median_ms"] > 0
    # on periodic text both find the period: the tree needs no more steps
    assert res["tree"]["steps"] <= res["linear"]["steps"]
