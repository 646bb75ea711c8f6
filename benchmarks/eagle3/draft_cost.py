"""Per-step cost of the EAGLE-3 tree drafter inside vLLM (in-process engine), against vLLM's linear eagle3.

    python benchmarks/eagle3/draft_cost.py --head HEAD_DIR [--model TARGET] [--batch 1,4] [--tree s3_k2_d6]
    python benchmarks/eagle3/draft_cost.py --drafter-only [--batch 1,4,16] [--tree s3_k2_d6] [--rounds 20]
        [--gemm torch,vllm --repeats 5]

For each batch size: the same chat prompts (the training script's held-out slice if --prompts-json is
given, else a few fixed ones), greedy, served by no speculation, vLLM's linear eagle3 (k = the tree's
node count) and the tree eagle3 drafter. Prints output tok/s, mean accepted length and, for the tree,
draft / verify / commit seconds per round (the tree runner's stage timers). A random or barely trained
head measures cost only: acceptance needs a trained head.

--drafter-only times the tree drafter alone (no engine, no target): a random head at SmolLM2-135M's widths
(576 hidden, 9 / 3 heads, 8,192-token draft vocabulary over the 49,152-token target vocabulary), random
target features, contexts of --context tokens, and after each round a random accepted path of 0-2 nodes
plus the bonus token is committed, as the engine would. It prints milliseconds per request-round
(propose + observe, per request; wall clock and process CPU time, the latter steadier on shared
cores), which isolates the drafter's cost from the target's. `--gemm torch,vllm` alternates the head's linear layers
between F.linear and vLLM's CPU GEMM (the served default, integration/cpu_gemm.py) on the same weights, repeat
by repeat, and prints the median per-pair ratio.
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


def _random_head(draft_vocab: int, seed: int = 0):
    """A random EAGLE-3 head at SmolLM2-135M-Instruct's widths (cost only: nothing is accepted on purpose)."""
    import torch

    from vllm_tree_spec.drafters.eagle3_head import Eagle3Config, Eagle3Head

    cfg = Eagle3Config(hidden=576, target_hidden=576, num_aux=3, layers=1, heads=9, kv_heads=3, head_dim=64,
                       intermediate=1536, vocab=49152, draft_vocab=draft_vocab, eps=1e-5, max_position=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
        ids = torch.sort(torch.randperm(cfg.vocab)[:draft_vocab]).values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head.eval()


def drafter_only(batches: list[int], tree: str, rounds: int, context: int, draft_vocab: int,
                 sampling: str | None, gemms: list[str], repeats: int) -> list[dict]:
    """ms per request-round of Eagle3TreeDrafter.propose + observe_target at each batch size.

    gemms: "torch" (F.linear) and/or "vllm" (the head's linears on vLLM's CPU GEMM, as served:
    integration/cpu_gemm.py); with both, the two alternate repeat by repeat on the same head weights.
    """
    from vllm_tree_spec.integration.cpu_gemm import use_vllm_cpu_gemm

    heads = {}
    for gemm in gemms:
        heads[gemm] = _random_head(draft_vocab)  # same seed: the same weights
        if gemm == "vllm":
            use_vllm_cpu_gemm(heads[gemm])
    results = []
    for b in batches:
        for rep in range(repeats):
            for gemm, head in heads.items():
                row = _drafter_rounds(head, b, tree, rounds, context, sampling)
                row.update(gemm=gemm, repeat=rep)
                results.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
        if {"torch", "vllm"} <= heads.keys():
            import statistics

            ms = {(r["gemm"], r["repeat"]): r["ms_per_request_round"] for r in results if r["batch"] == b}
            ratio = statistics.median(ms["torch", rep] / ms["vllm", rep] for rep in range(repeats))
            print(f"batch {b}: torch / vllm GEMM drafter time, median of {repeats} pairs: {ratio:.3f}x", flush=True)
    return results


def _drafter_rounds(head, b: int, tree: str, rounds: int, context: int, sampling: str | None) -> dict:
    import torch

    from vllm_tree_spec.drafters.base import DraftRequest
    from vllm_tree_spec.drafters.eagle3 import Eagle3TreeDrafter
    from vllm_tree_spec.drafters.policy import SampledPolicy
    from vllm_tree_spec.tree import Tree

    policy = tree
    temperature = 0.0
    if sampling is not None:
        policy = SampledPolicy.of(Tree.from_paths(tree), replacement=sampling == "sample")
        temperature = 1.0
    feat = head.fc.in_features
    g = torch.Generator().manual_seed(1)
    drafter = Eagle3TreeDrafter(head, policy, seed=0)
    ctx = {}
    for i in range(b):
        toks = torch.randint(0, 49152, (context,), generator=g).tolist()
        drafter.start_request(i, toks[:-1])
        drafter.observe_target([i], [list(range(context))], torch.arange(context),
                               torch.randn(context, feat, generator=g))
        ctx[i] = toks
    t_prop = t_obs = cpu = 0.0
    nodes = 0
    for r in range(rounds + 2):  # two warm-up rounds
        c0, t0 = time.process_time(), time.perf_counter()
        props = drafter.propose([DraftRequest(i, ctx[i], temperature) for i in range(b)], 64)
        t1 = time.perf_counter()
        rows, flat_pos = [], []
        for i, prop in enumerate(props):  # accept the first 0-2 nodes of a chain from the root, plus a bonus
            tr = prop.tree
            path, node = [], -1
            want = int(torch.randint(0, 3, (), generator=g))
            while len(path) < want:
                kids = [j for j in range(tr.num_nodes) if int(tr.parents[j]) == node]
                if not kids:
                    break
                node = kids[0]
                path.append(int(tr.tokens[node]))
            n = len(ctx[i])
            rows.append(list(range(len(flat_pos), len(flat_pos) + 1 + len(path))))
            flat_pos += list(range(n - 1, n + len(path)))
            ctx[i] = ctx[i] + path + [int(torch.randint(0, 49152, (), generator=g))]
            nodes += tr.num_nodes
        drafter.observe_target(list(range(b)), rows, torch.tensor(flat_pos),
                               torch.randn(len(flat_pos), feat, generator=g))
        t2, c2 = time.perf_counter(), time.process_time()
        if r >= 2:
            cpu += c2 - c0
            t_prop += t1 - t0
            t_obs += t2 - t1
    row = dict(batch=b, tree=tree, sampling=sampling or "topk", rounds=rounds, context=context,
               threads=torch.get_num_threads(),
               ms_per_request_round=1e3 * (t_prop + t_obs) / (rounds * b),
               cpu_ms_per_request_round=1e3 * cpu / (rounds * b),
               propose_ms_per_step=1e3 * t_prop / rounds, nodes_per_tree=nodes / ((rounds + 2) * b))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default=None, help="the head directory (required unless --drafter-only)")
    ap.add_argument("--drafter-only", action="store_true", help="time the drafter alone on a random head")
    ap.add_argument("--rounds", type=int, default=20, help="--drafter-only: timed rounds per batch size")
    ap.add_argument("--context", type=int, default=256, help="--drafter-only: committed tokens per request")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="--drafter-only: the head's draft vocabulary")
    ap.add_argument("--draft-sampling", choices=["sample", "sample_without_replacement"], default=None,
                    help="--drafter-only: sampled children (give --tree as rank paths)")
    ap.add_argument("--threads", type=int, default=1, help="--drafter-only: torch threads")
    ap.add_argument("--gemm", default="vllm", help="--drafter-only: the head's linears, 'vllm' (as served), "
                                                   "'torch' (F.linear) or 'torch,vllm' (interleaved)")
    ap.add_argument("--repeats", type=int, default=1, help="--drafter-only: interleaved repeats per batch size")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--tree", default="s3_k2_d6")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-json", default=None, help="held_out.json written by training/eagle3")
    ap.add_argument("--only", choices=["off", "linear", "tree"], default=None,
                    help="one configuration per process (vLLM-cpu leaves bound threads behind after shutdown)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.drafter_only:
        import torch

        torch.set_num_threads(args.threads)
        res = drafter_only([int(x) for x in args.batch.split(",")], args.tree, args.rounds, args.context,
                           args.draft_vocab, args.draft_sampling, args.gemm.split(","), args.repeats)
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)
        return 0
    if args.head is None:
        ap.error("--head is required (or --drafter-only)")
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
