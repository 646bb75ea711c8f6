"""The kernel benchmark driver's quick mode runs end to end (CPU: Triton interpreter)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

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
    # DeepSeek-V4: stage 1 (every list, per-layer copy and the refresh vs their twins) passed, stage 2 timed the
    # serving path's launches with no device-to-host sync
    dsv4 = json.loads((tmp_path / "bench_dsv4_tree.json").read_text())
    checks = dsv4["correctness"]
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    for kind in ("window list", "C128 entry list", "C4 path entries", "top-k slots", "compressor window sources",
                 "N3 window copy", "N4 virtual pages", "refresh"):
        assert any(kind in c["check"] for c in checks), kind
    rows = dsv4["results"]  # one per timer mode (CPU: wall clock; GPU: eager and CUDA graphs)
    assert rows and dsv4["headline"]
    for row in rows:
        assert row["total_ms"] > 0 and row["emitters"] == {"4": 2, "128": 2} and row["virtual_pages"] > 0
        launches = row["launches"]
        assert launches["refresh"]["triton"] == 1
        assert launches["layers"]["triton_by_launcher"]["tree_topk_slots_triton"] == 1  # one CSA layer
        assert all(launches[k]["syncs"] == 0 for k in ("plan", "layers", "refresh"))
    for name in ("run_all", "bench_tree_attention", "bench_verify_commit", "bench_dsv4_tree"):
        sys.modules.pop(name, None)


@runs_kernels
def test_dsv4_bench_gate_fails_on_planted_wrong_results(monkeypatch):
    """Negative control of the DeepSeek-V4 benchmark's stage 1: an off-by-one in the SWA window list, a wrong
    top-k slot and a dropped refresh are each caught, and nothing else is flagged."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import bench_dsv4_tree as bench

    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    from vllm_tree_spec.kernels import dsv4_refresh_launch, dsv4_tree_meta_launch

    window, topk = dsv4_tree_meta_launch.tree_window_slots_triton, dsv4_tree_meta_launch.tree_topk_slots_triton

    def bad_window(*a, **kw):
        slots, lens = window(*a, **kw)
        if kw.get("align", "left") == "left":
            slots[-1, 0] += 1
        return slots, lens

    def bad_topk(*a, **kw):
        slots, lens = topk(*a, **kw)
        slots[-1, 0] += 1
        return slots, lens

    monkeypatch.setattr(dsv4_tree_meta_launch, "tree_window_slots_triton", bad_window)
    monkeypatch.setattr(dsv4_tree_meta_launch, "tree_topk_slots_triton", bad_topk)
    monkeypatch.setattr(dsv4_refresh_launch, "refresh_triton", lambda *a, **kw: None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checks = bench.correctness(bench.QUICK_SHAPE, device, 2, "s3_k2_d6", 256)
    failed = {c["check"] for c in checks if not c["ok"]}
    assert failed == {"SWA group 0 window list", "SWA group 1 window list", "CSA layer 0 top-k slots",
                      "refresh (accepted paths, all spaces) vs refresh_reference"}, failed
    sys.modules.pop("bench_dsv4_tree", None)


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
    with pytest.raises(SystemExit):
        run_all.main(["--budget", "bench_nothing=3"])
    assert "expected NAME=SECONDS" in capsys.readouterr().err
    sys.modules.pop("run_all", None)


def test_run_all_per_benchmark_budget(tmp_path, monkeypatch):
    """gpu_check.sh's split: --budget NAME=S overrides --time-budget for that benchmark only."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import run_all

    seen = {}

    def fake(name):
        def run(quick, out_dir, time_budget_s):
            seen[name] = time_budget_s
            (Path(out_dir) / f"{name}.md").write_text(name)

        return SimpleNamespace(run=run)

    for name in ("bench_dsv4_tree", "bench_verify_commit"):
        monkeypatch.setitem(sys.modules, name, fake(name))
    argv = ["--only", "bench_dsv4_tree", "bench_verify_commit", "--time-budget", "75", "--budget",
            "bench_dsv4_tree=110", "--out", str(tmp_path)]
    assert run_all.main(argv) == 0
    assert seen == {"bench_dsv4_tree": 110.0, "bench_verify_commit": 75.0}
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
