"""The draft-model tree drafter inside vLLM: greedy identity and the self-draft oracle."""

import pytest
import torch
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, run_engine

VOCAB = 2048
MAX_TOKENS = 40


def noisy_copy(src: str, dst, noise: float, seed: int) -> str:
    """A draft that mostly agrees with the target: its weights plus seeded noise."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    dst = Path(dst)
    if not dst.exists():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
        model.save_pretrained(str(dst))
        for f in Path(src).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy2(f, dst / f.name)
    return str(dst)


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    draft = noisy_copy(model, tiny_models.root / "draft-noisy", noise=0.3, seed=1)
    raw = repetitive_prompts(20, VOCAB, seed=5)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_engine(model, prompts, params)
    return model, draft, raw, prompts, params, base


@pytest.mark.vllm
@pytest.mark.parametrize("tree", ["[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]", "s3_k2_d8"], ids=["static", "dynamic"])
def test_draft_model_greedy_identical(setup, tree):
    model, draft, raw, prompts, params, base = setup
    nodes = 5 if tree.startswith("[") else 7
    # a static budget table: every round drafts the full shape (the default online policy would explore chains)
    run = run_engine(model, prompts, params, {"method": "tree", "drafter": "draft_model", "model": draft,
                                              "tree": tree, "budgets": {"64": nodes}})
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    s = run.tree_stats
    assert s["accepted"] > 0 and s["branching_rounds"] == s["rounds"]
    assert s["off_first_branch"] > 0, s  # the second-ranked branch was accepted at least once


@pytest.mark.vllm
def test_self_draft_accepts_the_whole_path(setup):
    """Draft == target, greedy: every round accepts a full root-to-leaf path along the argmax chain."""
    model, draft, raw, prompts, params, base = setup
    depth = 4
    run = run_engine(model, prompts, params, {"method": "tree", "drafter": "draft_model", "model": model,
                                              "tree": "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]"})
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    s = run.tree_stats
    # every round reaches the full depth, except possibly each request's last (cut by max_tokens)
    assert s["accepted_per_depth"][depth - 1] >= s["rounds"] - len(prompts), s
    assert s["off_first_branch"] == 0
