"""Helpers for engine tests: run an in-process engine, read its metrics and the tree runner's counters."""

from __future__ import annotations

import gc
import random
import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class EngineRun:
    outputs: list[list[int]]
    texts: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    tree_stats: dict | None = None


def tree_runner(llm):
    """The tree model runner of an in-process engine (None for a non-tree engine)."""
    worker = getattr(llm.llm_engine.model_executor, "driver_worker", None)  # None: workers in subprocesses
    runner = worker.worker.model_runner if worker is not None else None
    return runner if hasattr(runner, "tree_stats") else None


def run_engine(model: str, prompts, params, spec: dict | None = None, patches=(), **engine_kwargs) -> EngineRun:
    """Start an engine, generate, collect outputs/metrics/stats, shut it down."""
    from vllm import LLM

    kwargs = dict(model=model, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=8, seed=0,
                  disable_log_stats=False, speculative_config=spec)
    kwargs.update(engine_kwargs)
    for obj, name, value in patches:  # negative controls: monkeypatch a mechanism away
        setattr(obj, name, value)
    llm = LLM(**kwargs)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        metrics = {}
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                metrics[m.name.split(":")[-1].removeprefix("spec_decode_")] = getattr(m, "values", None) or getattr(m, "value", None)
        runner = tree_runner(llm)
        stats = runner.tree_stats.as_dict() if runner is not None else None
        return EngineRun([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs], metrics,
                         stats)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def repetitive_prompts(num: int, vocab: int, seed: int = 0, low: int = 7) -> list[list[int]]:
    """Token prompts with repeated motifs (so n-gram / suffix drafters find continuations)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        motif = [rng.randrange(low, vocab) for _ in range(rng.randint(3, 8))]
        body = []
        while len(body) < 24 + i:
            body += motif if rng.random() < 0.8 else [rng.randrange(low, vocab)]
        prompts.append(body[: 24 + i])
    return prompts


class TieChecker:
    """Decides whether a greedy divergence is a floating-point tie of the target (reported, not hidden)."""

    def __init__(self, model_path: str, rel_tol: float = 1e-4):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
        self.rel_tol = rel_tol

    @torch.no_grad()
    def is_tie(self, prompt: list[int], prefix: list[int]) -> bool:
        logits = self.model(torch.tensor([prompt + prefix])).logits[0, -1]
        top2 = logits.topk(2).values
        return float(top2[0] - top2[1]) <= self.rel_tol * max(1.0, float(top2[0].abs()))


def compare_greedy(base: list[list[int]], spec: list[list[int]], prompts, ties: TieChecker | None) -> list[str]:
    """Identical outputs, or divergence explained by an exact-arithmetic tie; returns the tie reports."""
    reports = []
    for i, (a, b) in enumerate(zip(base, spec)):
        if a == b:
            continue
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        if ties is not None and ties.is_tie(prompts[i], a[:j]):
            reports.append(f"prompt {i}: divergence at token {j} is a floating-point tie of the target")
            warnings.warn(reports[-1])
            continue
        raise AssertionError(f"prompt {i}: greedy output differs at token {j}: {a[max(0, j - 3): j + 3]} "
                             f"vs {b[max(0, j - 3): j + 3]} (not a tie)")
    return reports
