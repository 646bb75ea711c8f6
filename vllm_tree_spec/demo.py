"""A self-contained demonstration: tree drafting + lossless verification on a synthetic target.

No model, no vLLM: the target p is a seeded random "language model" over a
small vocabulary whose next-token law depends on the last two tokens, and the
draft q is the target's logits plus noise (an imperfect drafter). For the same
verification budget (5 draft nodes per round) we run

    chain      linear speculation: the draft's greedy continuation of 5 tokens
    static     a fixed 5-node tree filled with the draft's top-ranked tokens
    dynamic    SGLang/EAGLE-2 `s3_k2_d6`, reranked by draft path scores

and report tokens per round (bonus included). Greedy runs must reproduce the
target's own greedy text token for token; sampled runs use the deterministic
(sample-and-match) rule. The measured acceptance by (depth, rank) then feeds
the planner, which prints the tree it would pick per batch size.
"""

from __future__ import annotations

import torch

from vllm_tree_spec.build import (
    acceptance_table,
    build_dynamic,
    context_draft,
    expand_static,
)
from vllm_tree_spec.planner import CostModel, RooflineVerify, format_plan_table, plan_trees
from vllm_tree_spec.sampling import target_probs
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import verify_tree

VOCAB = 48
BUDGET = 5
STATIC = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"


class SyntheticLM:
    """p(. | context) from the last two tokens: seeded logits, optionally noised (the draft)."""

    def __init__(self, seed: int, scale: float = 3.0, noise_of: "SyntheticLM | None" = None, noise: float = 0.0):
        self.seed, self.scale, self.noise_of, self.noise = seed, scale, noise_of, noise
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def logits(self, ctx) -> torch.Tensor:
        key = tuple(ctx[-2:])
        if key not in self._cache:
            g = torch.Generator().manual_seed(hash((self.seed,) + key) & 0x7FFFFFFF)
            x = torch.randn(VOCAB, generator=g, dtype=torch.float64) * self.scale
            if self.noise_of is not None:
                x = self.noise_of.logits(ctx) + self.noise * x
            self._cache[key] = x
        return self._cache[key]

    def probs(self, ctx, temperature: float) -> torch.Tensor:
        return target_probs(self.logits(ctx)[None], temperature)[0]


def _draft_tree(method: str, q: SyntheticLM, ctx: list[int]) -> Tree:
    draft = context_draft(lambda c: q.probs(c, 1.0))
    if method == "chain":
        return expand_static(draft, Tree.chain(BUDGET), prefix=ctx).tree
    if method == "static":
        return expand_static(draft, STATIC, prefix=ctx).tree
    return build_dynamic(draft, "s3_k2_d6", prefix=ctx).tree


def run(method: str, p: SyntheticLM, q: SyntheticLM, prompt: list[int], tokens: int, temperature: float,
        seed: int, stats: dict | None = None) -> tuple[list[int], int]:
    """Generate `tokens` tokens; returns (tokens, verify rounds)."""
    g = torch.Generator().manual_seed(seed)
    ctx, rounds = list(prompt), 0
    mode = "greedy" if temperature == 0 else "deterministic"
    while len(ctx) - len(prompt) < tokens:
        if method == "none":
            probs = p.probs(ctx, temperature)
            nxt = int(probs.argmax()) if temperature == 0 else int(torch.multinomial(probs, 1, generator=g))
            ctx.append(nxt)
            rounds += 1
            continue
        tree = _draft_tree(method, q, ctx)
        rows = [p.probs(ctx, temperature)] + [p.probs(ctx + tree.path_tokens(i), temperature)
                                              for i in range(tree.num_nodes)]
        accepted, nxt = verify_tree(tree.parents, tree.tokens, torch.stack(rows), None, mode, g)
        if stats is not None:
            rank = tree.sibling_rank.tolist()
            for d, node in enumerate(accepted):
                stats.setdefault((d, rank[node]), 0)
                stats[(d, rank[node])] += 1
            stats["rounds"] = stats.get("rounds", 0) + 1
        ctx += [int(tree.tokens[i]) for i in accepted] + [nxt]
        rounds += 1
    return ctx[len(prompt): len(prompt) + tokens], rounds


def main(tokens: int = 200, num_prompts: int = 4) -> int:
    p = SyntheticLM(seed=1)
    q = SyntheticLM(seed=2, noise_of=p, noise=0.4)
    prompts = [[i, 2 * i + 1] for i in range(num_prompts)]
    print(f"Synthetic target (vocab {VOCAB}) and a noisy draft; {BUDGET} draft nodes per round, "
          f"{num_prompts} prompts x {tokens} tokens.\n")
    print(f"{'temperature':>11} | {'method':>8} | {'tokens/round':>12} | {'identical to target greedy':>26}")
    print("-" * 68)
    ok = True
    stats: dict = {}
    for temperature in (0.0, 0.8):
        reference = [run("none", p, q, pr, tokens, 0.0, 0)[0] for pr in prompts] if temperature == 0 else None
        for method in ("none", "chain", "static", "dynamic"):
            outs, rounds = [], 0
            for k, pr in enumerate(prompts):
                out, r = run(method, p, q, pr, tokens, temperature, seed=k,
                             stats=stats if (method == "static" and temperature == 0.8) else None)
                outs.append(out)
                rounds += r
            same = "-" if reference is None else ("yes" if outs == reference else "NO")
            ok &= same != "NO"
            print(f"{temperature:>11} | {method:>8} | {num_prompts * tokens / rounds:>12.3f} | {same:>26}")
    # acceptance by (depth, rank) measured on the static tree at T = 0.8 -> the planner
    depth, ranks = 3, 2
    # per-depth conditional acceptance: P(rank r accepted at depth d | reached depth d)
    reached = [stats.get("rounds", 1)] + [sum(stats.get((d, r), 0) for r in range(ranks)) for d in range(depth)]
    cond = [[stats.get((d, r), 0) / max(1, reached[d]) for r in range(ranks)] for d in range(depth)]
    print("\nMeasured acceptance (static tree, T=0.8), per depth [rank 0, rank 1]:",
          [[round(x, 3) for x in row] for row in cond])
    cost = CostModel(verify=RooflineVerify(weights_ms=10.0, knee_tokens=128, token_ms=0.002),
                     draft_level_ms=0.6, state_ms=0.3, state_node_ms=0.002)
    plans = plan_trees(acceptance_table(cond, depth), cost, [1, 4, 16, 64, 256], max_nodes=16, max_depth=depth)
    print("\nPlanner (example roofline costs: 10 ms forward, knee 128 tokens):")
    print(format_plan_table(plans))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
