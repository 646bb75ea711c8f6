#!/bin/bash
# interleaved A/B of the b4 step cost at equal rows: linear, tree, linear, tree
cd "$(dirname "$0")/../../../../.."
mkdir -p runs/step/ab
for i in 1 2; do
  for e in linear-suffix tree-suffix-policy; do
    .venv/bin/python benchmarks/step/stage_profile.py --engines $e --batches 4 --prompts 32 --max-tokens 96 --label ab-$e-$i --out runs/step/ab/$e-$i > runs/step/ab/$e-$i.log 2>&1
  done
done
date
