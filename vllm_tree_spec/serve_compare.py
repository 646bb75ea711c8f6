"""The main job: serve a real small model and compare tree vs linear speculation at equal budget.

For each configuration a vLLM OpenAI server is started the way users start it
(`vllm-tree-spec serve MODEL --speculative-config ...`), warmed up on a prompt
outside the set (suffix caches learn from earlier outputs, so warming up on a
measured prompt would inflate acceptance), then sent the same chat prompts,
greedy, with a fixed concurrency. Reported per configuration: mean accepted
length (tokens per verify round, bonus included, from vLLM's `/metrics`),
output tokens/s (client side), and whether the text equals the run without
speculation. Linear and tree runs use the same drafter family and the same
verification budget D (draft tokens per request per step).

The EAGLE-3 pair comes first (the head shipped for the embedded model,
`vllm-tree-spec model-path smollm2-eagle3`): it is the drafter family where
trees are known to pay, because a trained head's second and third guesses
carry real probability. Both EAGLE-3 servers run without prefix caching (the
tree drafter needs the target's features at every committed position).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vllm_tree_spec.serve_launch import launched, post_json, spec_counters

WARMUP = "List three colours of the rainbow."
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in two sentences what a hash table is.",
    "Rewrite this list in alphabetical order: pear, apple, fig, banana, cherry, grape.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Give me a step-by-step recipe for a cup of tea.",
    "Write a Python class `Stack` with push, pop and peek methods.",
    "Summarise the water cycle for a ten-year-old.",
]


@dataclass
class RunResult:
    name: str
    spec: dict | None
    texts: list[str]
    tokens: int
    seconds: float
    drafts: float = 0.0
    accepted: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def accepted_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def server_args(spec: dict | None) -> list[str]:
    """EAGLE heads (linear eagle/eagle3, tree drafters eagle/eagle3) run without prefix caching: the tree
    drafters refuse it (the head needs the target's features at every position), so both rows of a pair do."""
    uses_head = spec is not None and any(str(spec.get(k, "")).startswith("eagle") for k in ("method", "drafter"))
    return ["--no-enable-prefix-caching"] if uses_head else []


def run_config(name: str, model: str, spec: dict | None, max_tokens: int, concurrency: int,
               log_dir: str) -> RunResult:
    with launched(model, spec, name=name, log_dir=log_dir, max_num_seqs=concurrency,
                  extra_args=server_args(spec)) as server:
        base = server.base

        def chat(prompt: str) -> dict:
            return post_json(base + "/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0})

        chat(WARMUP)
        d0, a0 = spec_counters(base)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(chat, PROMPTS))
        seconds = time.perf_counter() - t0
        time.sleep(0.5)
        d1, a1 = spec_counters(base)
    texts = [o["choices"][0]["message"]["content"] for o in outs]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return RunResult(name, spec, texts, tokens, seconds, d1 - d0, a1 - a0)


def eagle3_tree(budget: int) -> str:
    """The dynamic EAGLE-2 shape with `budget` draft nodes: top-2 expansion, up to 4 levels."""
    return f"s{min(budget, 4)}_k2_d{budget + 1}"


def configs(budget: int, head: str | None) -> list[tuple[str, dict | None]]:
    d = budget
    eagle = [] if head is None else [
        (f"vLLM eagle3, linear k={d}", {"method": "eagle3", "model": head, "num_speculative_tokens": d}),
        (f"tree eagle3, {d} nodes", {"method": "tree", "drafter": "eagle3", "model": head,
                                     "tree": eagle3_tree(d), "num_speculative_tokens": d}),
    ]
    return [
        ("no speculation", None),
        *eagle,
        (f"vLLM ngram, linear k={d}", {"method": "ngram", "num_speculative_tokens": d,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
        (f"tree ngram, {d} nodes", {"method": "tree", "drafter": "ngram", "num_speculative_tokens": d,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
        (f"vLLM suffix, linear k={d}", {"method": "suffix", "num_speculative_tokens": d}),
        (f"tree suffix, {d} nodes", {"method": "tree", "drafter": "suffix", "num_speculative_tokens": d}),
    ]


def format_table(results: list[RunResult]) -> str:
    base = results[0]
    rows = [f"{'configuration':<26} | {'accepted length':>15} | {'output tok/s':>12} | {'vs no spec':>10} | "
            f"{'identical text':>14}", "-" * 90]
    for r in results:
        acc = "-" if r.accepted_length is None else f"{r.accepted_length:.2f}"
        same = "-" if r is base else ("yes" if r.texts == base.texts else
                                      f"{sum(a == b for a, b in zip(r.texts, base.texts))}/{len(base.texts)}")
        rows.append(f"{r.name:<26} | {acc:>15} | {r.tokens_per_s:>12.1f} | {r.tokens_per_s / base.tokens_per_s:>9.2f}x | "
                    f"{same:>14}")
    pairs = [(results[i], results[i + 1]) for i in range(1, len(results) - 1, 2)]
    rows.append("")
    for lin, tree in pairs:
        if lin.accepted_length and tree.accepted_length:
            rows.append(f"{tree.name} vs {lin.name}: accepted length x{tree.accepted_length / lin.accepted_length:.3f}, "
                        f"output tok/s x{tree.tokens_per_s / lin.tokens_per_s:.3f}")
    return "\n".join(rows)


def main(model: str | None = None, budget: int = 6, max_tokens: int = 96, concurrency: int = 4,
         out: str | None = None) -> int:
    from vllm_tree_spec.models import smollm2, smollm2_eagle3

    head = None
    if model is None:  # the shipped head belongs to the embedded model
        try:
            head = str(smollm2_eagle3())
        except RuntimeError as e:
            print(f"EAGLE-3 rows skipped: {e}", flush=True)
    model = str(model or smollm2())
    log_dir = os.path.join(os.path.dirname(os.path.abspath(model)), "logs")
    os.makedirs(log_dir, exist_ok=True)
    print(f"Model {model}; {len(PROMPTS)} chat prompts x {max_tokens} tokens, greedy, concurrency {concurrency}, "
          f"verification budget D = {budget}. Server logs in {log_dir}.", flush=True)
    results = []
    for name, spec in configs(budget, head):
        print(f"  running: {name} ...", flush=True)
        results.append(run_config(name, model, spec, max_tokens, concurrency, log_dir))
    table = format_table(results)
    print()
    print(table)
    if out:
        with open(out, "w") as f:
            json.dump([dict(name=r.name, spec=r.spec, tokens=r.tokens, seconds=r.seconds, drafts=r.drafts,
                            accepted=r.accepted, accepted_length=r.accepted_length, tokens_per_s=r.tokens_per_s)
                       for r in results], f, indent=2)
    lossless = all(r.texts == results[0].texts for r in results if r.spec and r.spec.get("method") == "tree")
    if not lossless:
        print("\nWARNING: a tree run's greedy text differs from no speculation (see 'identical text').")
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
