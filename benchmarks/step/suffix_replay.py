"""Suffix drafts replayed against the target's greedy outputs: tokens per verify step, chain vs tree.

Under greedy decoding the output does not depend on the drafts, so how many tokens a draft would have
accepted can be counted without the model: generate each prompt's greedy output once (vLLM, no
speculation), then walk it step by step. At each step the drafter sees the committed context, proposes,
and the step accepts the longest drafted path that matches the output, plus the bonus token (exactly the
engine's greedy rule). The suffix caches see what they see in serving: the prompt, then the committed
tokens; finished outputs join the global tree in prompt order.

    linear        vLLM's linear `suffix` draft: the library's best chain under vLLM's defaults
                  (max_spec_factor 1, min_token_prob 0.1)
    linear-wide   the same chain with the caps opened (max_spec_factor 4, min_token_prob 0)
    tree-capped   SuffixTreeDrafter with its branches under the chain's caps (branch_spec_factor 1,
                  branch_min_token_prob 0.1)
    tree          SuffixTreeDrafter's defaults: the best chain, then branches capped by the node budget

Rows per step = 1 + drafted nodes (the verify rows before any gate). This measures the drafts only: the
served engine adds the online policy's score gate, which drops low-frequency nodes where rows cost
(docs/benchmarks.md section 3.9 has both).

`--gate-sweep` adds what the score gate can make of these drafts: the tree and its linear draft (the shape
policy's `linear` plan), each gated at confidence thresholds with the engine's own functions
(`online_policy.gate_by_confidence`, `prune_to_linear`), all counted at the same steps (the tree's walk), and,
for a step cost line `--cost-line C0,S,B` (ms per step = C0 + S x B x rows per request), each one's tokens per
ms against the ungated linear draft's. A model, not a measurement:
it bounds what any pruning of these drafts gains where a verify row costs S ms.

    .venv/bin/python benchmarks/step/suffix_replay.py --prompts 96 --max-tokens 128 --budgets 4,6,8 \\
        --out runs/step/suffix_replay          # ~2 min on 2 cores (generation), the replay seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vllm_tree_spec.drafters.suffix import (
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_TOKEN_PROB,
)

ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.32's linear suffix
DEFAULTS = dict(max_spec_factor=DEFAULT_MAX_SPEC_FACTOR, max_spec_offset=0.0, min_token_prob=DEFAULT_MIN_TOKEN_PROB)


def greedy_outputs(n: int, max_tokens: int, datasets: tuple[str, ...]) -> list[dict]:
    """[n] {prompt, output}: the first n prompts of the serving pool and the target's greedy continuation."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sys.path.insert(0, str(ROOT / "benchmarks" / "step"))
    from stage_profile import prompts_for
    from vllm import LLM, SamplingParams

    from vllm_tree_spec.models import smollm2

    llm = LLM(model=str(smollm2()), dtype="float32", max_model_len=2048, max_num_seqs=16, seed=0,
              enforce_eager=True)
    prompts = prompts_for(llm.get_tokenizer(), n, 0, datasets)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [dict(prompt=p["prompt_token_ids"], output=list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]


class LinearSuffix:
    """vLLM's linear `suffix` proposal: one `speculate` call, a chain."""

    def __init__(self, **caps) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.caps = caps
        self.cache = SuffixDecodingCache(max_tree_depth=DEFAULT_MAX_TREE_DEPTH,
                                         max_cached_requests=DEFAULT_MAX_CACHED_REQUESTS)

    def start(self, rid, prompt) -> None:
        self.cache.start_request(rid, prompt)

    def add(self, rid, tokens) -> None:
        self.cache.add_active_response(rid, tokens)

    def finish(self, rid) -> None:
        self.cache.stop_request(rid)

    def draft(self, rid, ctx, budget) -> tuple[list[int], list[int]]:
        d = self.cache.speculate(rid, ctx[-DEFAULT_MAX_TREE_DEPTH:], max_spec_tokens=budget, use_tree_spec=False,
                                 **self.caps)
        return list(range(-1, len(d.token_ids) - 1)), list(d.token_ids)


class TreeSuffix:
    """SuffixTreeDrafter, through its public API (the committed context is passed; it adds what is new)."""

    def __init__(self, **kw) -> None:
        from vllm_tree_spec.drafters.suffix import SuffixTreeDrafter

        self.d = SuffixTreeDrafter(**kw)

    def start(self, rid, prompt) -> None:
        self.d.start_request(rid, prompt)

    def add(self, rid, tokens) -> None:
        pass  # the next draft call passes the whole context

    def finish(self, rid) -> None:
        self.d.finish_request(rid)

    def draft(self, rid, ctx, budget) -> tuple[list[int], list[int]]:
        from vllm_tree_spec.drafters.base import DraftRequest

        (p,) = self.d.propose([DraftRequest(rid, ctx, temperature=0.0)], [budget])
        return p.tree.parents.tolist(), p.tree.tokens.tolist()


def drafters():
    yield "linear", lambda: LinearSuffix(**DEFAULTS)
    yield "linear-wide", lambda: LinearSuffix(**dict(DEFAULTS, max_spec_factor=4.0, min_token_prob=0.0))
    yield "tree-capped", lambda: TreeSuffix(branch_spec_factor=1.0, branch_min_token_prob=0.1)
    yield "tree", lambda: TreeSuffix()


def accepted(parents: list[int], tokens: list[int], target: list[int]) -> int:
    """Greedy acceptance: the longest drafted path that spells a prefix of `target`."""
    node, n = -1, 0
    while n < len(target):
        nxt = [j for j, p in enumerate(parents) if p == node and tokens[j] == target[n]]
        if not nxt:
            break
        node, n = nxt[0], n + 1
    return n


def gate_sweep(data: list[dict], budget: int, thresholds: list[float]) -> dict:
    """{(variant, threshold): [steps, tokens, rows]} for the tree and its linear draft gated at each threshold.

    The walk commits what the ungated tree accepts (the output is the same under greedy decoding whatever
    the draft); each variant counts what it would have accepted at that step.
    """
    import math

    from vllm_tree_spec.drafters.base import DraftRequest
    from vllm_tree_spec.drafters.suffix import SuffixTreeDrafter
    from vllm_tree_spec.online_policy import confidence, gate_by_confidence, prune_to_linear

    d, out = SuffixTreeDrafter(), {}
    for i, rec in enumerate(data):
        prompt, target = rec["prompt"], rec["output"]
        d.start_request(i, prompt)
        ctx, pos = list(prompt) + target[:1], 1
        while pos < len(target):
            (p,) = d.propose([DraftRequest(i, ctx, temperature=0.0)], [budget])
            rest = target[pos:]
            for name, base in (("tree", p), ("linear", prune_to_linear(p))):
                conf = confidence(base.scores, True)
                for t in thresholds:
                    g = gate_by_confidence(base, conf, math.log(t)) if t > 0 else base
                    par, tok = g.tree.parents.tolist(), g.tree.tokens.tolist()
                    c = out.setdefault((name, t), [0, 0, 0])  # steps, tokens, rows
                    c[0] += 1
                    c[1] += min(accepted(par, tok, rest) + 1, len(rest))
                    c[2] += 1 + len(tok)
            gained = min(accepted(p.tree.parents.tolist(), p.tree.tokens.tolist(), rest) + 1, len(rest))
            ctx += target[pos:pos + gained]
            pos += gained
        d.finish_request(i)
    return out


def replay(data: list[dict], make, budget: int) -> dict:
    drafter = make()
    steps = tokens = rows = drafted = 0
    for i, rec in enumerate(data):
        prompt, out = rec["prompt"], rec["output"]
        drafter.start(i, prompt)
        ctx, pos = list(prompt) + out[:1], 1  # the first output token comes from the prefill
        drafter.add(i, out[:1])
        while pos < len(out):
            parents, toks = drafter.draft(i, ctx, budget)
            gained = min(accepted(parents, toks, out[pos:]) + 1, len(out) - pos)
            new = out[pos:pos + gained]
            drafter.add(i, new)
            ctx += new
            pos += gained
            steps, tokens, rows, drafted = steps + 1, tokens + gained, rows + 1 + len(toks), drafted + bool(toks)
        drafter.finish(i)
    return dict(steps=steps, tokens=tokens, tok_per_step=tokens / steps, rows_per_step=rows / steps,
                drafted_share=drafted / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="4,6,8")
    ap.add_argument("--datasets", default="sharegpt,humaneval,math")
    ap.add_argument("--outputs", help="greedy outputs JSON to reuse (written there when missing)")
    ap.add_argument("--gate-sweep", default=None, help="confidence thresholds, e.g. 0,0.1,0.223,0.3,0.368")
    ap.add_argument("--cost-line", default="40,4.6,4", help="C0,S,B: ms per step = C0 + S x B x rows per request")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.outputs) if args.outputs else out / "greedy_outputs.json"
    if cache.exists():
        data = json.loads(cache.read_text())
    else:
        data = greedy_outputs(args.prompts, args.max_tokens, tuple(args.datasets.split(",")))
        cache.write_text(json.dumps(data))
    results, lines = [], ["| budget | drafts | tok/step | vs linear | rows/step | steps with a draft |",
                          "|---|---|---|---|---|---|"]
    for budget in map(int, args.budgets.split(",")):
        base = None
        for name, make in drafters():
            r = dict(budget=budget, drafts=name, **replay(data, make, budget))
            base = base or r["tok_per_step"]
            results.append(r)
            lines.append(f"| {budget} | {name} | {r['tok_per_step']:.3f} | {r['tok_per_step'] / base:.3f}x | "
                         f"{r['rows_per_step']:.2f} | {r['drafted_share']:.2f} |")
    sweep = []
    if args.gate_sweep:
        c0, s, b = map(float, args.cost_line.split(","))
        lines += ["", f"Gate sweep (cost line {c0:g} + {s:g} x {b:g} x rows ms per step):", "",
                  "| budget | drafts | gate | tok/step | rows/step | tok/ms vs linear |", "|---|---|---|---|---|---|"]
        for budget in map(int, args.budgets.split(",")):
            # the baseline is the ungated linear draft on the same walk (the steps of the tree's walk)
            counts = gate_sweep(data, budget, sorted({0.0, *map(float, args.gate_sweep.split(","))}))
            n, tok, rows = counts[("linear", 0.0)]
            rate0 = (tok / n) / (c0 + s * b * rows / n)
            for (name, t), (n, tok, rows) in counts.items():
                rate = (tok / n) / (c0 + s * b * rows / n)
                sweep.append(dict(budget=budget, drafts=name, gate=t, tok_per_step=tok / n, rows_per_step=rows / n,
                                  rate_vs_linear=rate / rate0))
                lines.append(f"| {budget} | {name} | {t:g} | {tok / n:.3f} | {rows / n:.2f} | {rate / rate0:.3f}x |")
    report = "\n".join(lines)
    print(report)
    meta = dict(prompts=len(data), output_tokens=sum(len(d["output"]) for d in data), max_tokens=args.max_tokens,
                cost_line=args.cost_line if args.gate_sweep else None)
    (out / "summary.json").write_text(json.dumps(dict(meta=meta, results=results, gate_sweep=sweep), indent=1))
    (out / "report.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
