"""The main job: serve a real small model and compare tree vs linear speculation at equal budget.

For each configuration a vLLM OpenAI server is started the way users start it
(`vllm-tree-spec serve MODEL --speculative-config ...`), warmed up on a prompt
outside the set (suffix caches learn from earlier outputs, so warming up on a
measured prompt would inflate acceptance), then sent chat prompts, greedy, with
a fixed concurrency. Linear and tree runs use the same drafter family and the
same verification budget D (draft tokens per request per step).

Machines are noisy, so a pair is measured side by side: its two servers are up
together, and `repeats` windows of fresh prompts (8 each; a window's prompts
never repeat, or the suffix caches would have seen their answers) go to both in
ABBA order (odd windows tree first). An idle server waits in a blocking poll,
so the one under load has the machine. The pair's ratio is the median of the
per-window ratios, printed with them. The run without speculation sends every
window once; it is the reference for the greedy text (every speculative run
must match it token for token) and the "vs no spec" column, which is therefore
not interleaved.

Reported per configuration: mean accepted length (tokens per verify round,
bonus included, from vLLM's `/metrics`), output tokens/s (client side, all
windows), and whether the text equals the run without speculation.

The EAGLE-3 pair comes first (the head shipped for the embedded model,
`vllm-tree-spec model-path smollm2-eagle3`): it is the drafter family where
trees are known to pay, because a trained head's second and third guesses
carry real probability. Every server keeps vLLM's default prefix caching.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

from vllm_tree_spec.serve_launch import launched, post_json, spec_counters

WARMUP = "List three colours of the rainbow."
WINDOW = 8  # prompts per window
PROMPTS = [  # windows of WINDOW prompts: code, explanation, rewriting, verse, facts, instructions, summaries
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in two sentences what a hash table is.",
    "Rewrite this list in alphabetical order: pear, apple, fig, banana, cherry, grape.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Give me a step-by-step recipe for a cup of tea.",
    "Write a Python class `Stack` with push, pop and peek methods.",
    "Summarise the water cycle for a ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "Explain in two sentences what a binary search does.",
    "Rewrite this list from smallest to largest: 42, 7, 19, 3, 88, 25.",
    "Write a short poem about a mountain in winter.",
    "What is the largest planet in the solar system? Answer in one sentence.",
    "Give me step-by-step instructions to plant a tomato seedling.",
    "Write a Python class `Queue` with enqueue, dequeue and size methods.",
    "Summarise how photosynthesis works for a ten-year-old.",
    "Write a Python function that counts the vowels in a string, with a docstring.",
    "Explain in two sentences what a linked list is.",
    "Rewrite these words in reverse alphabetical order: river, ocean, lake, pond, stream.",
    "Write a short poem about the moon over a city.",
    "What is the boiling point of water at sea level? Answer in one sentence.",
    "Give me a step-by-step guide to making a paper aeroplane.",
    "Write a Python class `Counter` with increment, reset and value methods.",
    "Summarise why the seasons change for a ten-year-old.",
]
MAX_REPEATS = len(PROMPTS) // WINDOW


def window(w: int) -> list[str]:
    """The prompts of window w (fresh in every window)."""
    if not 0 <= w < MAX_REPEATS:
        raise ValueError(f"window {w}: the demo ships {MAX_REPEATS} windows of {WINDOW} fresh prompts")
    return PROMPTS[w * WINDOW: (w + 1) * WINDOW]


@dataclass
class RunResult:
    """One configuration's windows (texts, tokens, seconds and spec counters per window)."""

    name: str
    spec: dict | None
    texts: list[list[str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    drafts: float = 0.0
    accepted: float = 0.0

    def add(self, texts: list[str], tokens: int, seconds: float, drafts: float, accepted: float) -> None:
        self.texts.append(texts)
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        self.drafts += drafts
        self.accepted += accepted

    def window_tokens_per_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.seconds)

    @property
    def accepted_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def chat(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy chat completion."""
    return post_json(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0})


def run_window(base: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
               result: RunResult) -> None:
    """Send one window's prompts (greedy, `concurrency` in flight) and add what came back to `result`."""
    d0, a0 = spec_counters(base)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda prompt: chat(base, model, prompt, max_tokens), prompts))
    seconds = time.perf_counter() - t0
    time.sleep(0.5)  # the counters of the last step
    d1, a1 = spec_counters(base)
    result.add([o["choices"][0]["message"]["content"] for o in outs],
               sum(o["usage"]["completion_tokens"] for o in outs), seconds, d1 - d0, a1 - a0)


def run_session(configs: list[tuple[str, dict | None]], model: str, max_tokens: int, concurrency: int,
                repeats: int, log_dir: str) -> list[RunResult]:
    """Every configuration's server up together, warmed up; then window w to each in turn (ABBA order)."""
    results = [RunResult(name, spec) for name, spec in configs]
    with ExitStack() as stack:
        bases = [stack.enter_context(launched(model, spec, name=name, log_dir=log_dir,
                                              max_num_seqs=concurrency)).base for name, spec in configs]
        for base in bases:
            chat(base, model, WARMUP, max_tokens)
        for w in range(repeats):
            order = range(len(configs)) if w % 2 == 0 else reversed(range(len(configs)))
            for i in order:
                run_window(bases[i], model, window(w), max_tokens, concurrency, results[i])
    return results


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


def pair_ratios(linear: RunResult, tree: RunResult) -> list[float]:
    """tree / linear output tok/s, window by window (the two ran side by side in each)."""
    return [t / lin for t, lin in zip(tree.window_tokens_per_s(), linear.window_tokens_per_s())]


def format_table(results: list[RunResult]) -> str:
    base = results[0]
    rows = [f"{'configuration':<26} | {'accepted length':>15} | {'output tok/s':>12} | {'vs no spec':>10} | "
            f"{'identical text':>14}", "-" * 90]
    for r in results:
        acc = "-" if r.accepted_length is None else f"{r.accepted_length:.2f}"
        same = "-" if r is base else _identical(r, base)
        rows.append(f"{r.name:<26} | {acc:>15} | {r.tokens_per_s:>12.1f} | {r.tokens_per_s / base.tokens_per_s:>9.2f}x | "
                    f"{same:>14}")
    pairs = [(results[i], results[i + 1]) for i in range(1, len(results) - 1, 2)]
    rows.append("")
    for lin, tree in pairs:
        if lin.accepted_length and tree.accepted_length:
            ratios = pair_ratios(lin, tree)
            each = "" if len(ratios) < 2 else f" (windows {', '.join(f'{x:.3f}' for x in ratios)})"
            rows.append(f"{tree.name} vs {lin.name}: accepted length x{tree.accepted_length / lin.accepted_length:.3f}, "
                        f"output tok/s x{statistics.median(ratios):.3f}{each}")
    return "\n".join(rows)


def _identical(r: RunResult, base: RunResult) -> str:
    a = [t for ts in r.texts for t in ts]
    b = [t for ts in base.texts for t in ts]
    return "yes" if a == b else f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


def main(model: str | None = None, budget: int = 6, max_tokens: int = 96, concurrency: int = 4,
         out: str | None = None, repeats: int = 3) -> int:
    from vllm_tree_spec.models import smollm2, smollm2_eagle3

    if not 1 <= repeats <= MAX_REPEATS:  # before any server starts
        raise ValueError(f"repeats = {repeats}: the demo ships {MAX_REPEATS} windows of {WINDOW} fresh prompts, "
                         f"use 1 to {MAX_REPEATS}")
    head = None
    if model is None:  # the shipped head belongs to the embedded model
        try:
            head = str(smollm2_eagle3())
        except RuntimeError as e:
            print(f"EAGLE-3 rows skipped: {e}", flush=True)
    model = str(model or smollm2())
    log_dir = os.path.join(os.path.dirname(os.path.abspath(model)), "logs")
    os.makedirs(log_dir, exist_ok=True)
    print(f"Model {model}; {repeats} window(s) of {WINDOW} fresh chat prompts x {max_tokens} tokens, greedy, "
          f"concurrency {concurrency}, verification budget D = {budget}; each pair's two servers up together, "
          f"windows in ABBA order. Server logs in {log_dir}.", flush=True)
    rows = configs(budget, head)
    sessions = [rows[:1]] + [rows[i:i + 2] for i in range(1, len(rows), 2)]
    results = []
    for session in sessions:
        print(f"  running: {' | '.join(name for name, _ in session)} ...", flush=True)
        results += run_session(session, model, max_tokens, concurrency, repeats, log_dir)
    table = format_table(results)
    print()
    print(table)
    if out:
        with open(out, "w") as f:
            json.dump([dict(name=r.name, spec=r.spec, tokens=r.tokens, seconds=r.seconds, drafts=r.drafts,
                            accepted=r.accepted, accepted_length=r.accepted_length, tokens_per_s=r.tokens_per_s,
                            window_tokens_per_s=r.window_tokens_per_s())
                       for r in results], f, indent=2)
    lossless = all(r.texts == results[0].texts for r in results if r.spec and r.spec.get("method") == "tree")
    if not lossless:
        print("\nWARNING: a tree run's greedy text differs from no speculation (see 'identical text').")
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
