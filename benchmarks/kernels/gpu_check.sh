#!/usr/bin/env bash
# One GPU session for the Triton kernels: the kernel tests compiled for the GPU (not the interpreter),
# then every kernel benchmark. For a machine with torch + Triton + pytest but no vLLM and no pip
# install of this project (docs/kernels.md, "GPU numbers").
#
#   bash benchmarks/kernels/gpu_check.sh OUT_DIR     # <= 8 min on one H200
#
# Budget (8 minutes of device time, one H200), hard caps by `timeout`:
#   env                         ~5 s
#   kernel tests (compiled)     TEST_S  = 150 s
#   benchmarks (run_all)        BENCH_S = 300 s, DeepSeek-V4 first (each budget stops new configurations;
#                               the one running finishes):
#     bench_dsv4_tree           DSV4_S  = 110 s  stage 1 correctness at V4-Flash widths (and the kernels'
#                                                compiles), then the stage 2 grid batch x tree x context,
#                                                eager + CUDA graphs, headline configuration first
#     bench_tree_attention      BUDGET_S = 75 s
#     bench_verify_commit       BUDGET_S = 75 s
#   total                       <= 455 s, ~25 s of slack for start-up and the archive
#
# Writes OUT_DIR/{env.txt, kernel-tests.log, bench.log, bench.tgz}; bench.tgz holds run_all's JSON + Markdown.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# setuptools installs kernels/ as vllm_tree_spec.kernels (pyproject's package-dir); without an install, a link
[ -e vllm_tree_spec/kernels ] || ln -s ../kernels vllm_tree_spec/kernels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  lscpu | grep -E 'Model name|^CPU\(s\)'
} 2>&1 | tee "$out/env.txt"
# the CPU C++ kernel's tests need no GPU (CI runs them); everything else here runs compiled on the GPU
timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/kernels \
  --ignore=tests/kernels/test_cpu_tree_attention_kernel.py 2>&1 | tee "$out/kernel-tests.log"
timeout "${BENCH_S:-300}" python3 benchmarks/kernels/run_all.py --out "$out/bench" \
  --only bench_dsv4_tree bench_tree_attention bench_verify_commit \
  --time-budget "${BUDGET_S:-75}" --budget "bench_dsv4_tree=${DSV4_S:-110}" 2>&1 | tee "$out/bench.log"
tar czf "$out/bench.tgz" -C "$out" bench && rm -rf "$out/bench"
