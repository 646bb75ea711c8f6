"""The EAGLE-3 tree drafter inside vLLM: greedy identity, and vLLM's linear eagle3 on the same head directory."""

import sys
from pathlib import Path

import pytest
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, run_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_eagle3 import make_tiny_eagle3  # noqa: E402

VOCAB = 2048
MAX_TOKENS = 32
NO_PREFIX_CACHE = dict(enable_prefix_caching=False)  # the eagle3 tree drafter refuses prefix caching (for now)


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    head = str(make_tiny_eagle3(tiny_models.root / "eagle3-engine", model, aux_layer_ids=(0, 1, 2)))
    raw = repetitive_prompts(12, VOCAB, seed=7)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_engine(model, prompts, params, **NO_PREFIX_CACHE)
    return model, head, raw, prompts, params, base


@pytest.mark.vllm
@pytest.mark.parametrize("tree", ["[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]", "s3_k2_d6"], ids=["static", "dynamic"])
def test_eagle3_tree_greedy_identical(setup, tree):
    model, head, raw, prompts, params, base = setup
    run = run_engine(model, prompts, params, {"method": "tree", "drafter": "eagle3", "model": head, "tree": tree},
                     **NO_PREFIX_CACHE)
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    s = run.tree_stats
    assert s["rounds"] > 0 and s["branching_rounds"] == s["rounds"], s
    assert s["nodes"] >= 4 * s["rounds"], s  # every round verified a full tree


@pytest.mark.vllm
def test_vllm_linear_eagle3_loads_the_same_head(setup):
    """vLLM's own linear eagle3 serves the same directory (and stays greedy-identical)."""
    model, head, raw, prompts, params, base = setup
    run = run_engine(model, prompts, params, {"method": "eagle3", "model": head, "num_speculative_tokens": 3},
                     **NO_PREFIX_CACHE)
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    assert run.metrics.get("num_drafts"), run.metrics


@pytest.mark.vllm
def test_eagle3_refuses_prefix_caching(setup):
    model, head, raw, prompts, params, base = setup
    with pytest.raises(Exception, match="prefix caching"):
        run_engine(model, prompts[:1], params, {"method": "tree", "drafter": "eagle3", "model": head},
                   enable_prefix_caching=True)
