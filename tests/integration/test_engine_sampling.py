"""End-to-end sampling: with tree speculation the output distribution is exactly the target's.

A tiny-vocabulary model (48 tokens, peaked random weights) and one prompt;
each of N requests has its own seed. The first generated token comes from the
prefill step (vLLM's sampler); the second and third are emitted by tree
verification. Their joint law is computed exactly with transformers (float64,
same temperature/top-p transform as vLLM), and the engine's counts must fit it
(chi-square, cells with expected count < 5 pooled). The same counts from the
engine without speculation are tested the same way, and the two engines are
compared with a two-sample test. A hard zero-support check makes sure no
token outside the top-p nucleus is ever emitted.
"""

import pytest
import torch
from engine_utils import run_engine
from scipy import stats

from vllm_tree_spec.sampling import target_probs

VOCAB = 48
N = 1500
TEMPERATURE, TOP_P = 0.9, 0.95
P_MIN = 1e-3


@pytest.fixture(scope="module")
def setup(tiny_models):
    from transformers import AutoModelForCausalLM

    import shutil

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
    prompt = [7, 11, 13, 17]
    with torch.no_grad():  # extend with the model's own greedy text so n-gram drafts get accepted
        for _ in range(28):
            prompt.append(int(model(torch.tensor([prompt])).logits[0, -1].argmax()))
    return path, model, prompt


@pytest.fixture(scope="module")
def no_spec_counts(setup):
    path, model, prompt = setup
    _, b12, b23 = sample(path, prompt, None)
    return b12, b23


def _probs(model, contexts):
    with torch.no_grad():
        logits = model(torch.tensor(contexts)).logits[:, -1]
    return target_probs(logits, TEMPERATURE, None, TOP_P)


def exact_law(model, prompt) -> dict:
    """P(t1, t2, t3) marginalised to (t2, t3) and (t1, t2)."""
    p1 = _probs(model, [prompt])[0]
    t1s = [t for t in range(VOCAB) if p1[t] > 0]
    p2 = _probs(model, [prompt + [t] for t in t1s])
    joint12, joint23 = {}, {}
    ctx3, w3 = [], []
    for i, t1 in enumerate(t1s):
        for t2 in range(VOCAB):
            w = float(p1[t1] * p2[i, t2])
            if w > 0:
                joint12[(t1, t2)] = w
                ctx3.append(prompt + [t1, t2])
                w3.append((t2, w))
    p3 = _probs(model, ctx3)
    for (t2, w), row in zip(w3, p3):
        for t3 in torch.nonzero(row).flatten().tolist():
            joint23[(t2, t3)] = joint23.get((t2, t3), 0.0) + w * float(row[t3])
    return {"12": joint12, "23": joint23}


def chi_square_fit(counts: dict, law: dict, n: int) -> float:
    obs, exp, po, pe = [], [], 0, 0.0
    for k, pr in law.items():
        if pr * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(pr * n)
        else:
            po += counts.get(k, 0)
            pe += pr * n
    obs.append(po + sum(v for k, v in counts.items() if k not in law))
    exp.append(max(pe, 1e-12))
    return float(stats.chisquare(obs, exp).pvalue)


def sample(path, prompt, spec, n=N):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=3, seed=i, ignore_eos=True,
                             detokenize=False) for i in range(n)]
    run = run_engine(path, [TokensPrompt(prompt_token_ids=prompt)] * n, params, spec, max_num_seqs=16)
    c12, c23 = {}, {}
    for out in run.outputs:
        c12[tuple(out[:2])] = c12.get(tuple(out[:2]), 0) + 1
        c23[tuple(out[1:3])] = c23.get(tuple(out[1:3]), 0) + 1
    return run, c12, c23


@pytest.mark.vllm
@pytest.mark.stats
@pytest.mark.parametrize("spec", [
    # the suffix cache learns the target's continuations across requests, so its trees get accepted
    {"method": "tree", "drafter": "suffix", "tree": "s3_k3_d8", "min_token_prob": 0.0},
    # the target as its own draft model: deterministic top-k, i.i.d. and without-replacement children
    {"method": "tree", "drafter": "draft_model", "tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0)]"},
    {"method": "tree", "drafter": "draft_model", "tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0)]",
     "draft_sampling": "sample"},
    {"method": "tree", "drafter": "draft_model", "tree": "[(0,), (1,), (2,), (0, 0), (0, 1)]",
     "draft_sampling": "sample_without_replacement"},
], ids=["suffix-s3_k3_d8", "draft-topk", "draft-iid", "draft-wor"])
def test_sampled_distribution_matches_target(setup, no_spec_counts, spec):
    path, model, prompt = setup
    n = N
    if spec["drafter"] == "draft_model":
        spec = {**spec, "model": path}
        n = N // 2  # the HF draft model prefills every request's prompt: keep CI time in check
    law = exact_law(model, prompt)
    b12, b23 = no_spec_counts
    run, c12, c23 = sample(path, prompt, spec, n)
    assert run.tree_stats["accepted"] > n // 8, f"too few accepted drafts to test anything: {run.tree_stats}"
    # zero support: nothing outside the target's support is ever emitted
    assert set(c12) <= set(law["12"]) and set(c23) <= set(law["23"])
    for name, counts in (("(t1, t2)", c12), ("(t2, t3)", c23)):
        p = chi_square_fit(counts, law[name.replace("(t", "").replace(", t", "").replace(")", "")], n)
        assert p > P_MIN, f"tree speculation {name}: chi-square p = {p:.2e}"
    # the engine without speculation fits the same law (sanity of the exact law itself)
    assert chi_square_fit(b23, law["23"], N) > P_MIN
    # and the two engines agree with each other (two-sample chi-square on (t2, t3))
    keys = sorted(set(b23) | set(c23), key=lambda k: -(b23.get(k, 0) + c23.get(k, 0)))
    big = [k for k in keys if b23.get(k, 0) + c23.get(k, 0) >= 10]
    rest = [k for k in keys if k not in big]
    table = [[b23.get(k, 0) for k in big] + [sum(b23.get(k, 0) for k in rest)],
             [c23.get(k, 0) for k in big] + [sum(c23.get(k, 0) for k in rest)]]
    table = [list(col) for col in zip(*table) if sum(col) > 0]
    assert stats.chi2_contingency(list(zip(*table)))[1] > P_MIN


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
    law = exact_law(model, prompt)
    run, c12, c23 = sample(path, prompt, {"method": "tree", "drafter": "suffix", "tree": "s3_k3_d8",
                                          "min_token_prob": 0.0})
    assert chi_square_fit(c23, law["23"], N) < P_MIN
