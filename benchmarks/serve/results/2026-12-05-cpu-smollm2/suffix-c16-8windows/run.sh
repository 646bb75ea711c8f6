#!/bin/bash
# Issue 13: suffix at c = 16, linear vs the default tree policy, 8 interleaved windows (session mode).
# run.sh [OUT]   (~8 min on the 2-core development machine)
cd "$(dirname "$0")/../../../../.."  # the repository root
OUT=${1:-runs/serve/suffix-c16-8windows}
date -u
.venv/bin/python benchmarks/serve/bench_serve.py --configs linear-suffix,tree-suffix --budgets 6 --concurrency 16 --num-prompts 32 --prompts-per-slot 1 --max-tokens 64 --warmup 2 --repeats 8 --server-per session --max-num-seqs 64 --out "$OUT"
date -u
