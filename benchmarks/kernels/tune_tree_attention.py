"""Tile sweep for the Triton tree-attention kernel: `pick_config`'s tiles vs a grid, per workload.

    python benchmarks/kernels/run_all.py --only tune_tree_attention --out DIR          # GPU, ~4 min on an H200
    python benchmarks/kernels/run_all.py --only tune_tree_attention --quick --out DIR  # CPU smoke (interpreter)

For each (batch, nodes, context) of Llama-3-8B attention (bench_tree_attention's shape and complete binary
trees), every config of the grid is checked against the heuristic config's output (same math, other tiles:
max abs difference within bf16 rounding) and timed with CUDA graphs. Writes tune_tree_attention.{json,md}:
per workload the heuristic's time, the best config and its speed-up. Configs that do not compile (shared
memory) are recorded as such.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

WORKLOADS = [(1, 15, 8192), (1, 63, 8192), (8, 15, 8192), (8, 63, 1024), (8, 63, 8192), (64, 15, 8192),
             (64, 63, 8192)]
GRID = {"block_m": [32, 64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}
QUICK_WORKLOADS = [(1, 4, 40)]
QUICK_GRID = {"block_m": [16, 32], "block_n": [16], "num_warps": [4], "num_stages": [2]}


def run(quick: bool = False, out_dir: str | Path | None = None, time_budget_s: float = 240.0) -> dict:
    """The sweep (run_all.py --only tune_tree_attention); writes tune_tree_attention.{json,md} into out_dir."""
    import torch
    import triton
    from bench_tree_attention import FULL_SHAPE, QUICK_SHAPE, Timer, make_inputs

    from vllm_tree_spec.kernels.tree_attention_launch import TreeAttentionConfig, pick_config, tree_attention_triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    workloads = QUICK_WORKLOADS if quick else WORKLOADS
    grid = QUICK_GRID if quick else GRID
    timer = Timer(device, quick)
    mode = "cudagraph" if device.type == "cuda" else "wallclock"
    t_start = time.perf_counter()
    rows = []
    for batch, nodes, ctx in workloads:
        inp = make_inputs(shape, batch, nodes, ctx, device)
        group = shape.num_heads // shape.num_kv_heads
        default = pick_config(shape.head_dim, shape.dtype, group, inp.q_len)
        kw = dict(max_query_len=inp.q_len, max_seq_len=inp.seq_len)
        ref = tree_attention_triton(*inp.args, config=default, **kw)
        entry = {"batch": batch, "nodes": nodes, "context": ctx, "default": default.__dict__, "configs": []}
        swept = [TreeAttentionConfig(max(bm, group), bn, nw, ns) for bm, bn, nw, ns in itertools.product(*grid.values())]
        for cfg in [default] + [c for c in dict.fromkeys(swept) if c != default]:
            if time.perf_counter() - t_start > time_budget_s:
                entry["configs"].append({"skipped": "time budget"})
                break
            rec = {**cfg.__dict__, "default": cfg == default}
            try:
                out = torch.empty_like(inp.q)
                tree_attention_triton(*inp.args, config=cfg, out=out, **kw)
                rec["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                rec["ok"] = rec["max_abs_diff"] <= 2e-2
                rec["ms"] = timer(lambda: tree_attention_triton(*inp.args, config=cfg, out=out, **kw), mode)
            except Exception as e:  # out of shared memory / registers: record, go on
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            entry["configs"].append(rec)
        timed = [c for c in entry["configs"] if c.get("ok")]
        d = [c for c in timed if c["default"]]
        if timed and d:
            best = min(timed, key=lambda c: c["ms"])
            entry["default_ms"], entry["best"] = d[0]["ms"], best
            entry["speedup"] = d[0]["ms"] / best["ms"]
        rows.append(entry)
        print(json.dumps({k: entry.get(k) for k in ("batch", "nodes", "context", "default_ms", "speedup", "best")}),
              flush=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "mode": mode,
              "shape": shape.describe(), "grid": grid, "elapsed_s": time.perf_counter() - t_start,
              "workloads": rows}
    out = Path(out_dir if out_dir is not None else ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_tree_attention.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Tree attention tile sweep ({report['device']}, triton {report['triton']}, {mode}, ms)", "",
             "| B | nodes | ctx | heuristic (m, n, warps, stages) | ms | best (m, n, warps, stages) | ms | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for e in rows:
        if "best" not in e:
            continue
        d, b = e["default"], e["best"]
        t = lambda c: f"{c['block_m']}, {c['block_n']}, {c['num_warps']}, {c['num_stages']}"  # noqa: E731
        lines.append(f"| {e['batch']} | {e['nodes']} | {e['context']} | {t(d)} | {e['default_ms']:.4f} | {t(b)} | "
                     f"{b['ms']:.4f} | {e['speedup']:.2f}x |")
    (out / "tune_tree_attention.md").write_text("\n".join(lines) + "\n")
    return report
