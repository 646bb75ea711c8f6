#!/bin/bash
# Issue 13's "never below linear" protocol, c = 1, 4, 16, 64 in one run per pair (session mode).
# protocol.sh [OUT]: results in OUT-suffix and OUT-ngram (default runs/serve/protocol).
cd "$(dirname "$0")/../../../.."  # the repository root
OUT=${1:-runs/serve/protocol}
date
.venv/bin/python benchmarks/serve/bench_serve.py --configs linear-suffix,tree-suffix --budgets 6 --concurrency 1,4,16,64 --num-prompts 8,16,32,64 --prompts-per-slot 1 --max-tokens 64 --warmup 2 --repeats 4 --server-per session --max-num-seqs 64 --out "$OUT-suffix"
date
.venv/bin/python benchmarks/serve/bench_serve.py --configs linear-ngram,tree-ngram --budgets 6 --concurrency 1,4,16,64 --num-prompts 8,16,32,64 --prompts-per-slot 1 --max-tokens 64 --warmup 2 --repeats 3 --server-per session --max-num-seqs 64 --out "$OUT-ngram"
date
