"""The EAGLE tree drafters inside vLLM (eagle3 and EAGLE-1 `eagle`).

Greedy identity for static, dynamic and sampled trees; vLLM's linear eagle3 / eagle on the same head
directory; the exact output law of the sampled modes (chi-square over 3 generated positions, the
machinery of test_engine_sampling.py, with an EAGLE-3 head whose draft vocabulary is 32 of the 48
target tokens, so q is 0 outside it); and a head that copies the target (q = p), whose every draft
node is accepted.
"""

import sys
from functools import partial
from pathlib import Path

import pytest
import test_engine_sampling as es
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, run_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_eagle3 import make_copy_pair, make_tiny_eagle, make_tiny_eagle3  # noqa: E402

VOCAB = 2048
MAX_TOKENS = 32
NO_PREFIX_CACHE = dict(enable_prefix_caching=False)  # the eagle3 tree drafter refuses prefix caching (for now)


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    head = str(make_tiny_eagle3(tiny_models.root / "eagle3-engine", model, aux_layer_ids=(0, 1, 2)))
    head1 = str(make_tiny_eagle(tiny_models.root / "eagle1-engine", model))
    raw = repetitive_prompts(12, VOCAB, seed=7)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_engine(model, prompts, params, **NO_PREFIX_CACHE)
    return model, {"eagle3": head, "eagle": head1}, raw, prompts, params, base


STATIC = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"
# A static budget table: every round drafts the full shape (the default online policy would explore chains).
FULL = {"budgets": {"64": 5}}
TREES = {"static": {"tree": STATIC, **FULL}, "dynamic": {"tree": "s3_k2_d6", **FULL},
         "sampled": {"tree": STATIC, "draft_sampling": "sample", **FULL}}  # greedy requests fill the shape by rank


# EAGLE-1 shares EAGLE-3's tree path with its own head: its static trees run by default, the rest are extended
CASES = [pytest.param(d, t, marks=() if d == "eagle3" or t == "static" else pytest.mark.extended)
         for d in ("eagle3", "eagle") for t in TREES]


@pytest.mark.vllm
@pytest.mark.parametrize("drafter,tree", CASES)
def test_eagle_tree_greedy_identical(setup, drafter, tree):
    model, heads, raw, prompts, params, base = setup
    run = run_engine(model, prompts, params, {"method": "tree", "drafter": drafter, "model": heads[drafter],
                                              **TREES[tree]}, **NO_PREFIX_CACHE)
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    s = run.tree_stats
    assert s["rounds"] > 0 and s["branching_rounds"] == s["rounds"], s
    assert s["nodes"] >= 4 * s["rounds"], s  # every round verified a full tree
    routed, linears = run.drafter_linears
    assert linears > 0 and routed == linears, run.drafter_linears  # the head on vLLM's CPU GEMM (P10)


@pytest.mark.vllm
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_vllm_linear_eagle_loads_the_same_head(setup, method):
    """vLLM's own linear eagle3 / eagle serves the same directory (and stays greedy-identical)."""
    model, heads, raw, prompts, params, base = setup
    run = run_engine(model, prompts, params, {"method": method, "model": heads[method], "num_speculative_tokens": 3},
                     **NO_PREFIX_CACHE)
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    assert run.metrics.get("num_drafts"), run.metrics


@pytest.mark.vllm
def test_eagle3_refuses_prefix_caching(setup):
    model, heads, raw, prompts, params, base = setup
    with pytest.raises(Exception, match="prefix caching"):
        run_engine(model, prompts[:1], params, {"method": "tree", "drafter": "eagle3", "model": heads["eagle3"]},
                   enable_prefix_caching=True)


# -- the exact law of the sampled modes -------------------------------------------------------------

EXACT = {
    "sampled": {"tree": es.DRAFT_TREE, "draft_sampling": "sample"},
    "sampled_without_replacement": {"tree": "[(0,), (1,), (2,), (0, 0), (0, 1)]",
                                    "draft_sampling": "sample_without_replacement"},
}


@pytest.fixture(scope="module")
def law_setup(tiny_models):
    path, model, prompt = es.setup.__wrapped__(tiny_models)  # the 48-token peaked target and its prompt
    # small weights: a flat q over its 32 tokens, so the peaked target accepts many drafts
    head = make_tiny_eagle3(tiny_models.root / "eagle3-v48", path, draft_vocab=32, aux_layer_ids=(0, 1, 2),
                            std=0.01)
    return path, model, prompt, str(head)


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.parametrize("mode", list(EXACT))
def test_eagle3_sampling_law_is_exact(law_setup, mode, monkeypatch):
    """Sampled EAGLE-3 trees (i.i.d. and without replacement, q over a 32-token draft vocabulary mapped
    to target ids) leave (t1, t2, t3) with exactly the target's law, for every sampling parameter."""
    path, model, prompt, head = law_setup
    monkeypatch.setattr(es, "run_engine", partial(run_engine, **NO_PREFIX_CACHE))
    spec = {"method": "tree", "drafter": "eagle3", "model": head, **EXACT[mode]}
    run, counts = es.sample(path, prompt, spec, es.COMBINED)
    s = run.tree_stats
    print(f"eagle3 {mode}: {s['rounds']} rounds, {s['accepted']} accepted, per depth {s['accepted_per_depth']}")
    assert s["rounds"] > es.N_SET and s["accepted"] > es.N_SET // 10, f"too few drafts accepted: {s}"
    failures = es.check_sets((path, model, prompt), "float32", {}, es.COMBINED, counts)
    assert not failures, "\n".join(failures)


# -- a head that copies the target ------------------------------------------------------------------


@pytest.mark.vllm
def test_copy_head_accepts_every_node(tiny_models):
    """EAGLE-1 head with q = p (tests/fixtures/tiny_eagle3.py, `make_copy_pair`): greedy output identical
    to no speculation, and every draft node on the chain is accepted in every round."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    target, head = (str(p) for p in make_copy_pair(tiny_models.root, tiny_models.tokenizer(VOCAB)))
    raw = repetitive_prompts(4, VOCAB, seed=3)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    # 1 + 6 rounds x (4 accepted + 1 bonus) tokens: no round is cut short by max_tokens
    params = SamplingParams(temperature=0, max_tokens=31, ignore_eos=True)
    base = run_engine(target, prompts, params, **NO_PREFIX_CACHE)
    run = run_engine(target, prompts, params, {"method": "tree", "drafter": "eagle", "model": head,
                                               "tree": "chain:4", "budgets": {"64": 4}}, **NO_PREFIX_CACHE)
    assert run.outputs == base.outputs
    s = run.tree_stats
    assert s["rounds"] == 6 * len(raw) and s["accepted"] == 4 * s["rounds"], s
