"""Run every kernel benchmark and collect JSON + Markdown in one folder.

    python benchmarks/kernels/run_all.py --quick          # seconds; CPU OK (Triton interpreter), smoke only
    python benchmarks/kernels/run_all.py                  # full GPU run, ~8 min on an H200 -> runs/kernels/

Each benchmark module exposes `run(quick, out_dir, time_budget_s) -> dict` and
writes `<name>.json` / `<name>.md` into the output folder; this driver adds
`summary.md` with every Markdown report concatenated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BENCHMARKS = ["bench_tree_attention", "bench_verify_commit", "bench_dsv4_tree"]


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
    ap = argparse.ArgumentParser(description="kernel benchmarks")
    ap.add_argument("--quick", action="store_true", help="tiny sizes; runs on CPU under the Triton interpreter")
    ap.add_argument("--out", default=str(ROOT / "runs" / "kernels"), help="output folder (default runs/kernels, git-ignored)")
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {BENCHMARKS}")
    ap.add_argument("--time-budget", type=float, default=270.0, help="seconds per benchmark before skipping configs")
    args = ap.parse_args(argv)

    prepare(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for name in args.only or BENCHMARKS:
        t0 = time.perf_counter()
        mod = __import__(name)
        mod.run(quick=args.quick, out_dir=out, time_budget_s=args.time_budget)
        md = (out / f"{name}.md").read_text()
        reports.append(md)
        print(md)
        print(f"[{name}] {time.perf_counter() - t0:.1f} s -> {out / (name + '.json')}", flush=True)
    (out / "summary.md").write_text("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
