"""The kernel benchmark driver's quick mode runs end to end (CPU: Triton interpreter)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
runs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA device and TRITON_INTERPRET is not 1",
)


@runs_kernels
def test_run_all_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import run_all

    assert run_all.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_tree_attention.json").read_text())
    assert all(c["ok"] for c in report["correctness"])
    tree_rows = [r for r in report["results"] if r["provider"] == "tree_triton"]
    assert tree_rows and all(r["ms"] and r["ms"] > 0 for r in tree_rows)
    assert "Tree attention benchmark" in (tmp_path / "summary.md").read_text()
    sys.modules.pop("run_all", None)
    sys.modules.pop("bench_tree_attention", None)


@runs_kernels
def test_tile_sweep_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import run_all

    assert run_all.main(["--quick", "--only", "tune_tree_attention", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tune_tree_attention.json").read_text())
    (w,) = report["workloads"]
    assert sum(c["default"] for c in w["configs"]) == 1  # the heuristic's tiles are always timed
    assert all(c["ok"] for c in w["configs"]), w["configs"]  # every config computes the same attention
    assert w["best"]["ms"] > 0 and w["speedup"] >= 1.0
    assert "Tree attention tile sweep" in (tmp_path / "summary.md").read_text()
    sys.modules.pop("tune_tree_attention", None)
    sys.modules.pop("run_all", None)
    sys.modules.pop("bench_tree_attention", None)


def test_run_all_writes_outside_the_checkout_and_refuses_unknown_names(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import run_all

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert run_all.default_out() == str(tmp_path / "vllm-tree-spec" / "bench" / "kernels")
    with pytest.raises(SystemExit):
        run_all.main(["--only", "bench_nothing"])
    assert "invalid choice" in capsys.readouterr().err
    sys.modules.pop("run_all", None)


@pytest.mark.vllm
def test_cpu_tree_attention_through_run_all(tmp_path, monkeypatch):
    """The CPU benchmark's own options reach it through the one entry point (chain trees, bf16 caches)."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import run_all

    argv = ["--quick", "--only", "bench_cpu_tree_attention", "--tree", "chain", "--dtype", "bfloat16",
            "--repeats", "1", "--out", str(tmp_path)]
    assert run_all.main(argv) == 0
    report = json.loads((tmp_path / "bench_cpu_tree_attention.json").read_text())
    assert report["ok"] and report["tree"] == "chain" and "bfloat16" in report["shape"] and report["results"]
    assert all(r["tree"] == "chain" and r["stock_causal_ms"] > 0 for r in report["results"])
    assert "CPU tree attention vs the stock kernel (chain trees)" in (tmp_path / "summary.md").read_text()
    sys.modules.pop("run_all", None)
    sys.modules.pop("bench_cpu_tree_attention", None)
