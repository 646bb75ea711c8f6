"""Per-step cost of the EAGLE-3 tree drafter inside vLLM (in-process engine), against vLLM's linear eagle3.

    python benchmarks/eagle3/draft_cost.py --head HEAD_DIR [--model TARGET] [--batch 1,4] [--tree s3_k2_d6]

For each batch size: the same chat prompts (the training script's held-out slice if --prompts-json is
given, else a few fixed ones), greedy, served by no speculation, vLLM's linear eagle3 (k = the tree's
node count) and the tree eagle3 drafter. Prints output tok/s, mean accepted length and, for the tree,
draft / verify / commit seconds per round (the tree runner's stage timers). A random or barely trained
head measures cost only: acceptance needs a trained head.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the tree runner's counters are read in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

FIXED = ["Explain what a hash table is in two sentences.", "Write a haiku about autumn rain.",
         "What are three tips for learning a new language?", "Describe how a bicycle gear works.",
         "Give me a short recipe for pancakes.", "Why is the sky blue?", "List four prime numbers and explain why.",
         "Summarise the plot of a detective story in three sentences."]


def run(model, prompts, max_tokens, spec):
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0, enable_prefix_caching=False,
              disable_log_stats=False,
              max_num_seqs=max(4, len(prompts)), speculative_config=spec)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        msgs = [[{"role": "user", "content": p}] for p in prompts]
        llm.chat(msgs[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        runner = getattr(llm.llm_engine.model_executor, "driver_worker", None)
        runner = runner.worker.model_runner if runner is not None else None
        stats0 = runner.tree_stats.as_dict() if hasattr(runner, "tree_stats") else None
        t0 = time.perf_counter()
        outs = llm.chat(msgs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = dict(tok_s=tokens / dt, tokens=tokens, seconds=dt, outputs=[list(o.outputs[0].token_ids) for o in outs])
        if stats0 is not None:
            s = runner.tree_stats.as_dict()
            rounds = s["rounds"] - stats0["rounds"]
            row.update(rounds=rounds, mean_accepted_length=1 + (s["accepted"] - stats0["accepted"]) / max(1, rounds),
                       **{f"{k}_ms_per_step": 1e3 * (s[f"{k}_s"] - stats0[f"{k}_s"]) / max(1, rounds)
                          for k in ("draft", "verify", "commit")})
        else:
            m = {x.name.split(":")[-1]: getattr(x, "value", None) for x in llm.get_metrics() if "spec_decode" in x.name}
            if m.get("spec_decode_num_drafts"):
                row["mean_accepted_length"] = 1 + m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"]
        return row
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--tree", default="s3_k2_d6")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-json", default=None, help="held_out.json written by training/eagle3")
    ap.add_argument("--only", choices=["off", "linear", "tree"], default=None,
                    help="one configuration per process (vLLM-cpu leaves bound threads behind after shutdown)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from vllm_tree_spec.models import smollm2

        args.model = str(smollm2())
    texts = [p["text"] for p in json.load(open(args.prompts_json))] if args.prompts_json else FIXED
    from vllm_tree_spec.tree import TreeShape

    k = TreeShape.parse(args.tree).num_nodes if args.tree.startswith("s") else 6
    results = []
    for b in [int(x) for x in args.batch.split(",")]:
        prompts = texts[:b]
        base = run(args.model, prompts, args.max_tokens, None) if args.only in (None, "off") else None
        for name, spec in [("off", None),
                           (f"linear eagle3 k={k}", {"method": "eagle3", "model": args.head,
                                                     "num_speculative_tokens": k}),
                           (f"tree eagle3 {args.tree}", {"method": "tree", "drafter": "eagle3", "model": args.head,
                                                         "tree": args.tree})]:
            if args.only is not None and not name.startswith(args.only):
                continue
            row = base if spec is None else run(args.model, prompts, args.max_tokens, spec)
            row = dict(row, config=name, batch=b, identical=None if base is None else row["outputs"] == base["outputs"])
            results.append(row)
            print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()
                              if k2 != "outputs"}), flush=True)
    if args.out:
        json.dump([{k2: v for k2, v in r.items() if k2 != "outputs"} for r in results], open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
