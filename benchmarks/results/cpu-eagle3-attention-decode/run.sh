#!/bin/bash
# tree (decode path, default) vs linear eagle3, then tree (kernel path) vs linear; fp32 SmolLM2, interleaved windows
cd /work/main
for mode in decode kernel; do
  VLLM_TREE_SPEC_CPU_TREE_ATTENTION=$mode .venv/bin/python benchmarks/serve/bench_serve.py --configs linear-eagle3,tree-eagle3-dynamic \
    --budgets 6 --concurrency 1,4 --repeats 4 --server-per session --max-tokens 64 --no-enable-prefix-caching \
    --out /tmp/bench2/$mode > /tmp/bench2/$mode.log 2>&1
done
echo done > /tmp/bench2/DONE
