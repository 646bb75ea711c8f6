"""The GPU cost script in its --quick mode on CPU (Triton interpreter, tiny random models).

Checks that every stage runs through the real kernels (tree attention inside the forward, the
verification kernel, the KV-commit kernel), that the fitted cost models load in the planner, and
that the per-batch-size budgets it writes are valid `"budgets"` for a tree speculative config.
Timings under the interpreter mean nothing; only the plumbing is tested.
"""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_COST = ROOT / "benchmarks" / "gpu_cost"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (CPU)")
def test_gpu_cost_quick(tmp_path):
    pytest.importorskip("triton")
    sys.path.insert(0, str(GPU_COST))
    try:
        import gpu_cost
    finally:
        sys.path.remove(str(GPU_COST))
    from vllm_tree_spec.config import parse_tree_config
    from vllm_tree_spec.planner import CostModel

    assert gpu_cost.main(["--quick", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "gpu_cost.json").read_text())
    assert rep["verify"] and all(r["ms"] is not None for r in rep["verify"]), rep["verify"]
    assert {r["drafter"] for r in rep["draft"]} == {"eagle_head", "draft_1b"}
    assert rep["commit"] and all(r["ms"] is not None for r in rep["commit"])
    assert not rep["skipped"]
    costs = sorted(tmp_path.glob("costs_*_ctx16.json"))
    assert {p.name for p in costs} == {"costs_draft_1b_ctx16.json", "costs_eagle_head_ctx16.json",
                                       "costs_model_free_ctx16.json"}
    for p in costs:
        cm = CostModel.model_validate_json(p.read_text())
        assert cm.baseline_ms(1) > 0
    budgets = json.loads((tmp_path / "budgets_assumed-eagle-like_eagle_head_ctx16.json").read_text())
    assert set(budgets) == {"1", "2"}
    parse_tree_config({"method": "tree", "drafter": "suffix", "num_speculative_tokens": 2,
                       "budgets": {k: min(v, 2) for k, v in budgets.items()}})
    assert rep["dsv4"] and not rep["dsv4"].get("error"), rep["dsv4"]
    assert any(r.get("commit_ms") for r in rep["dsv4"]["rows"])
    assert "verify(B, t) ms" in (tmp_path / "gpu_cost.md").read_text()
