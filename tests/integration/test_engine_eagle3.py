"""The EAGLE tree drafters inside vLLM (eagle3 and EAGLE-1 `eagle`).

Greedy identity for static, dynamic and sampled trees; vLLM's linear eagle3 / eagle on the same head
directory; vLLM's prefix caching (the head's KV for cached tokens restored from its pages: the same trees
as without the hit, and a control with the pages unreachable); the exact output law of the sampled modes
(chi-square over 3 generated positions, the machinery of test_engine_sampling.py, with an EAGLE-3 head
whose draft vocabulary is 32 of the 48 target tokens, so q is 0 outside it; prefix caching on, so all but
the first request draft from restored KV); and a head that copies the target (q = p), whose every draft
node is accepted.
"""

import sys
from pathlib import Path

import pytest
import test_engine_sampling as es
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, run_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from tiny_eagle3 import make_copy_pair, make_tiny_eagle, make_tiny_eagle3  # noqa: E402

VOCAB = 2048
MAX_TOKENS = 32
NO_PREFIX_CACHE = dict(enable_prefix_caching=False)  # each round serves fresh (prefix caching: its own test)


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


@pytest.fixture(scope="module")
def long_setup(setup):
    """Eight prompts of 50..66 tokens (two of setup's each: one or two whole 32-token blocks to hit) and their
    greedy output without speculation."""
    from vllm.inputs import TokensPrompt

    model, heads, raw, prompts, params, base = setup
    long_raw = [raw[i] + raw[i + 1] for i in range(8)]
    long_prompts = [TokensPrompt(prompt_token_ids=p) for p in long_raw]
    return model, heads, long_raw, long_prompts, params, run_engine(model, long_prompts, params, **NO_PREFIX_CACHE)


def prefix_metric(drafter: str, kind: str) -> float:
    """vllm_tree_spec:draft_prefix_tokens_total{drafter, kind} on this process's /metrics registry (0 before the
    first engine)."""
    import prometheus_client

    head = f'vllm_tree_spec:draft_prefix_tokens_total{{drafter="{drafter}",kind="{kind}"}}'
    lines = [ln for ln in prometheus_client.generate_latest().decode().splitlines() if ln.startswith(head)]
    return float(lines[0].split()[-1]) if lines else 0.0


def serve_with_prefix_cache(model, spec, prompts, params, same_step: bool = False, patches=(), **engine):
    """One engine with vLLM's prefix caching (32-token blocks) serving every prompt twice: in two rounds (the
    second hits the blocks the first wrote), or `same_step`: both copies in one call (the copies hit blocks
    the originals write in the same step). Returns (outputs of the originals, of the copies, vLLM's cached
    tokens of the copies, the trees drafted for each {context: tree tokens}, the drafter's prefix stats and
    the runner's log line)."""
    from engine_utils import tree_runner
    from vllm import LLM

    for obj, name, value in patches:
        setattr(obj, name, value)
    before = prefix_metric(spec["drafter"], "restored")
    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=2 * len(prompts),
              seed=0, speculative_config=spec, enable_prefix_caching=True, block_size=32, **engine)
    try:
        runner = tree_runner(llm)
        drafter = runner.drafter.drafter
        propose, trees = drafter.propose, [{}, {}]

        def recording(requests, budgets):  # the tree drafted at every context, by copy
            props = propose(requests, budgets)
            for r, prop in zip(requests, props):
                trees[int(str(r.req_id).split("-")[0]) >= len(prompts)][tuple(map(int, r.token_ids))] = \
                    prop.tree.tokens.tolist()
            return props

        drafter.propose = recording
        if same_step:
            outs = llm.generate(list(prompts) * 2, params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
        hits = sum(o.num_cached_tokens or 0 for o in outs[len(prompts):])
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        pages = dict(drafter.prefix_stats.as_dict(), log=runner.tree_stats.summary(),
                     metric=prefix_metric(spec["drafter"], "restored") - before)
        return tokens[: len(prompts)], tokens[len(prompts):], hits, trees, pages
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


CHUNKED = dict(max_num_batched_tokens=64, enable_chunked_prefill=True)  # round 2: 4 of 8 prefilled in 2 chunks


@pytest.mark.vllm
@pytest.mark.parametrize("drafter,same_step,engine", [
    ("eagle3", False, {}), ("eagle3", True, {}),
    pytest.param("eagle", False, {}, marks=pytest.mark.extended),
    pytest.param("eagle3", False, CHUNKED, id="eagle3-chunked", marks=pytest.mark.extended)])
def test_eagle_tree_serves_with_prefix_caching(long_setup, drafter, same_step, engine):
    """vLLM's default prefix caching: a prompt served again starts with its blocks cached, so the target
    computes no features there; the head restores its KV for every cached token from its pages (written in
    an earlier step, or in the same step by the request it shares them with). Greedy output identical to no
    speculation, and the copies draft exactly the originals' trees."""
    model, heads, raw, prompts, params, base = long_setup
    spec = {"method": "tree", "drafter": drafter, "model": heads[drafter], "tree": STATIC, **FULL}
    first, second, hits, trees, pages = serve_with_prefix_cache(model, spec, prompts, params, same_step, **engine)
    for out in (first, second):
        compare_greedy(base.outputs, out, raw, TieChecker(model))
    print(f"{drafter} same_step={same_step}: vLLM cached {hits} tokens; pages {pages}; {len(trees[1])} trees")
    assert hits >= 32 * len(raw), hits  # every copy hits at least one block
    assert pages["hits"] == len(raw) and pages["restored"] == hits, pages
    assert pages["dropped"] == pages["missing"] == 0, pages
    assert f"prefix-cache hits {len(raw)}: draft KV restored for {hits} tokens, missing 0" in pages["log"]
    assert pages["metric"] == hits, pages["metric"]  # /metrics: vllm_tree_spec:draft_prefix_tokens_total
    assert trees[1].keys() == trees[0].keys() and len(trees[1]) > 10 * len(raw)
    assert trees[1] == trees[0]  # at every context, the copy drafts the original's tree


@pytest.mark.vllm
@pytest.mark.extended
def test_prefix_hit_without_pages_drafts_from_holes(long_setup):
    """Control: with the pages made unreachable every cached token is a hole. Output stays greedy-identical
    (drafts are only proposals), the drafter says how many entries it lacked, and its trees change."""
    from vllm_tree_spec.drafters.prefix_pages import PrefixPages

    model, heads, raw, prompts, params, base = long_setup
    spec = {"method": "tree", "drafter": "eagle3", "model": heads["eagle3"], "tree": STATIC, **FULL}
    get = PrefixPages.get
    try:
        first, second, hits, trees, pages = serve_with_prefix_cache(
            model, spec, prompts, params, patches=[(PrefixPages, "get", lambda self, key: None)])
    finally:
        PrefixPages.get = get
    compare_greedy(base.outputs, second, raw, TieChecker(model))
    changed = sum(trees[1][c] != trees[0][c] for c in trees[1])
    print(f"holes: vLLM cached {hits} tokens in round 2; pages {pages}; {changed} of {len(trees[1])} trees changed")
    assert pages["missing"] == hits > 0 and pages["restored"] == 0, pages
    assert changed > len(trees[1]) // 4, changed


# -- the exact law of the sampled modes -------------------------------------------------------------

EXACT = {
    "sampled": {"tree": es.DRAFT_TREE, "draft_sampling": "sample"},
    "sampled_without_replacement": {"tree": "[(0,), (1,), (2,), (0, 0), (0, 1)]",
                                    "draft_sampling": "sample_without_replacement"},
}


@pytest.fixture(scope="module")
def law_setup(tiny_models):
    import torch

    path, model, prompt = es.setup.__wrapped__(tiny_models)  # the 48-token peaked target and its prompt
    with torch.no_grad():  # 32 more greedy tokens: 64, so every request after the first hits the first block
        for _ in range(32):
            prompt = prompt + [int(model(torch.tensor([prompt])).logits[0, -1].argmax())]
    # small weights: a flat q over its 32 tokens, so the peaked target accepts many drafts
    head = make_tiny_eagle3(tiny_models.root / "eagle3-v48", path, draft_vocab=32, aux_layer_ids=(0, 1, 2),
                            std=0.01)
    return path, model, prompt, str(head)


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.parametrize("mode", list(EXACT))
def test_eagle3_sampling_law_is_exact(law_setup, mode):
    """Sampled EAGLE-3 trees (i.i.d. and without replacement, q over a 32-token draft vocabulary mapped
    to target ids) leave (t1, t2, t3) with exactly the target's law, for every sampling parameter. With
    vLLM's default prefix caching: every request after the first hits the prompt's block, so the head
    drafts from restored KV."""
    path, model, prompt, head = law_setup
    spec = {"method": "tree", "drafter": "eagle3", "model": head, **EXACT[mode]}
    run, counts = es.sample(path, prompt, spec, es.COMBINED)
    s = run.tree_stats
    print(f"eagle3 {mode}: {s['rounds']} rounds, {s['accepted']} accepted, per depth {s['accepted_per_depth']}; "
          f"prefix {run.prefix_stats}")
    assert run.prefix_stats["restored"] > 0 and run.prefix_stats["missing"] == 0, run.prefix_stats
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


@pytest.mark.vllm
@pytest.mark.extended  # ~25 s; the two-round and same-step cases run by default
def test_eagle3_continued_conversation_restores_every_cached_token(long_setup):
    """A conversation's next turn: each prompt + its greedy output + 8 new tokens, served after the first turn
    in the same engine. The hit covers the first turn's output too, whose last entries the head computed in
    the request's final step: every cached token is restored, none missing; output identical to no
    speculation."""
    from engine_utils import tree_runner
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    model, heads, raw, prompts, params, base = long_setup
    spec = {"method": "tree", "drafter": "eagle3", "model": heads["eagle3"], "tree": STATIC, **FULL}
    turn2 = [p + out + list(range(100, 108)) for p, out in zip(raw, base.outputs)]
    ref = run_engine(model, [TokensPrompt(prompt_token_ids=p) for p in turn2], params, **NO_PREFIX_CACHE)
    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=8, seed=0,
              speculative_config=spec, enable_prefix_caching=True, block_size=32)
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate([TokensPrompt(prompt_token_ids=p) for p in turn2], params, use_tqdm=False)
        hits = sum(o.num_cached_tokens or 0 for o in second)
        pages = tree_runner(llm).drafter.drafter.prefix_stats.as_dict()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    compare_greedy(base.outputs, [list(o.outputs[0].token_ids) for o in first], raw, TieChecker(model))
    compare_greedy(ref.outputs, [list(o.outputs[0].token_ids) for o in second], turn2, TieChecker(model))
    print(f"turn 2: vLLM cached {hits} tokens; pages {pages}")
    assert hits >= 64 * len(raw), hits  # prompt and output: at least two whole blocks each
    assert pages["restored"] + pages["dropped"] == hits and pages["missing"] == 0, pages
