"""Per-step host CPU time of the tree engine's own work: metadata + verification + commit.

Runs the plugin's hooks on a faked model runner (`tests/integration/step_harness.py`: vLLM's state
filled in directly, no forward), on the embedded model's sizes (SmolLM2-135M: V = 49152, 30 layers,
3 KV heads of 64, bf16 KV cache in one layer-strided allocation), for batch sizes 1 / 4 / 16 and
chain-shaped trees (`chain:6`, the n-gram serving case) and a branching tree of 10 nodes:

    metadata   `_tree_build_step` (trees -> positions, slots, flattened step tensors)
    verify     `_sample` up to the verifier's outputs (probabilities, coins, walk, the host copy)
    commit     the accepted paths' KV into place

Compare two checkouts by putting the other one first on the path, e.g. the code before issue 13:

    git archive <commit> vllm_tree_spec kernels | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python benchmarks/step/step_overhead.py --label before
    python benchmarks/step/step_overhead.py --label after

Times are `time.process_time()` medians over `--steps` steps (after 2 warm-up steps), in ms, with
OMP_NUM_THREADS=1. Run with `nice -n 10` on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))

import torch  # noqa: E402

torch.set_num_threads(1)
# The runner's stage timers (verify, commit) read time.perf_counter; make them CPU time too, so that
# other load on a shared machine does not count.
time.perf_counter = time.process_time


def measure(batch_size, nodes, chain, mode, steps, layers, vocab):
    from step_harness import make_step

    case = make_step(batch_size, nodes, modes=(mode,), chain=chain, vocab=vocab, layers=layers, hkv=3,
                     head_size=64, block_size=16, context=256, seed=batch_size, kv_dtype=torch.bfloat16)
    r = case.runner
    times = {"metadata": [], "verify": [], "commit": []}
    for i in range(steps + 2):
        t0 = time.process_time()
        r._tree_step = r._tree_build_step(case.sched)
        t1 = time.process_time()
        v0, c0 = r.tree_stats.verify_s, r.tree_stats.commit_s
        r._sample(case.logits, case.spec_meta)
        if i >= 2:
            times["metadata"].append(t1 - t0)
            # the runner's own stage timers (CPU time, see above)
            times["verify"].append(r.tree_stats.verify_s - v0)
            times["commit"].append(r.tree_stats.commit_s - c0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    med["total"] = sum(med.values())
    return med


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--json", type=Path, help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    import vllm_tree_spec

    print(f"# {args.label} ({Path(vllm_tree_spec.__file__).parent})")
    print(f"{'mode':<14}{'shape':<10}{'B':>4}{'metadata':>10}{'verify':>10}{'commit':>10}{'total':>10}  ms/step")
    for mode in ("greedy", "deterministic"):
        for nodes, chain, shape in ((6, True, "chain:6"), (10, False, "tree:10")):
            for b in (1, 4, 16):
                m = measure(b, nodes, chain, mode, args.steps, args.layers, args.vocab)
                print(f"{mode:<14}{shape:<10}{b:>4}{m['metadata']:>10.2f}{m['verify']:>10.2f}{m['commit']:>10.2f}"
                      f"{m['total']:>10.2f}", flush=True)
                if args.json:
                    with args.json.open("a") as f:
                        f.write(json.dumps(dict(label=args.label, mode=mode, shape=shape, batch=b, **m)) + "\n")


if __name__ == "__main__":
    main()
