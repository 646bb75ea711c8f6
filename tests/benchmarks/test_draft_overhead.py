"""The draft-stage benchmark (benchmarks/step/draft_overhead.py): both stacks replay every output token, no model.

Run as a subprocess: the n-gram stack builds vLLM's NgramProposer, whose numba JIT loads llvmlite, and vLLM
0.32's Triton kernel dispatcher (`_rebind_kernels`, at engine start) then fails on llvmlite's `_lib_fn_wrapper`
objects in `sys.modules` for every later in-process engine of the pytest process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("arctic_inference.suffix_decoding")

ROOT = Path(__file__).resolve().parents[2]
PERIOD = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
DATA = [dict(prompt=PERIOD * 2 + [7], output=(PERIOD * 5)[:37]),
        dict(prompt=[8, 8] + PERIOD, output=(PERIOD * 3)[2:25]),
        dict(prompt=[2, 7, 1, 8] * 3, output=[2, 8, 1, 8, 2, 8] * 4)]


@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
def test_both_stacks_replay_every_output_token_with_batching(drafter, tmp_path):
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps(DATA))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step" / "draft_overhead.py"), "--drafter", drafter,
                    "--outputs", str(outputs), "--batch", "2", "--repeats", "1", "--out", str(tmp_path / "out")],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    runs = json.loads((tmp_path / "out" / "draft_overhead.json").read_text())["runs"]
    res = {r["engine"]: r for r in runs}
    assert set(res) == {"linear", "tree"} and all(r["drafter"] == drafter for r in runs)
    for r in res.values():
        assert r["tokens"] == 36 + 22 + 23  # the first token of each output is the prefill's
        assert 1.0 < r["tok_per_step"] <= 7.0  # periodic text is drafted; at most 6 drafts + the bonus
        assert r["full_steps"] > 0 and r["median_ms"] > 0
    # on periodic text both find the period: the tree needs no more steps
    assert res["tree"]["steps"] <= res["linear"]["steps"]
