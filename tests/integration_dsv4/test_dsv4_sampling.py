"""DeepSeek-V4 sampling: with tree speculation the output distribution is exactly the target's.

As tests/integration/test_engine_sampling.py, on vLLM's DeepSeek-V4: a peaked
variant of the tiny checkpoint (output head x2), a small effective vocabulary
(`allowed_token_ids`, 12 tokens), temperature 0.8 / top-p 0.95, one prompt of
26 tokens (tree nodes cross CSA boundaries; HCA boundaries are covered by the
greedy tests) and N requests with their own seeds. The first token comes from the prefill
step (vLLM's sampler), the second and third from tree verification. Their joint
law is computed exactly from vLLM *without* speculation (full log-probabilities
after prompt, prompt+t1, prompt+t1+t2), and the tree engine's counts must fit it
(chi-square, cells with expected count < 5 pooled). The suffix drafter learns
the target's continuations across requests, so trees get accepted. Negative
control: verifying sampled requests as if greedy must fail the same fit.
"""

import pytest
import torch
from dsv4_harness import random_prompts, run_dsv4
from scipy import stats

from vllm_tree_spec.sampling import target_probs

N = 500
TEMPERATURE, TOP_P = 0.8, 0.95
P_MIN = 1e-3
ALLOWED = list(range(100, 112))
SPEC = {"method": "tree", "drafter": "suffix", "tree": "s3_k3_d8", "min_token_prob": 0.0}

pytestmark = [pytest.mark.vllm, pytest.mark.stats, pytest.mark.slow]


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    from tiny_dsv4 import make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("tiny_dsv4_peaked") / "dsv4-peaked", seed=1, head_gain=2.0))


def _probs(path, contexts):
    """p(next | context) over ALLOWED for every context, as vLLM would sample it (T, top-p)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=-1, ignore_eos=True, detokenize=False)
    run = run_dsv4(path, [TokensPrompt(prompt_token_ids=c) for c in contexts], params, raw_outputs=True,
                   max_logprobs=-1, max_num_seqs=16)
    out = []
    for o in run.raw:
        lp = o.outputs[0].logprobs[0]
        logits = torch.full((512,), float("-inf"), dtype=torch.float64)
        for t in ALLOWED:
            logits[t] = lp[t].logprob
        out.append(target_probs(logits[None], TEMPERATURE, None, TOP_P)[0])
    return out


@pytest.fixture(scope="module")
def law(peaked_model):
    prompt = random_prompts([26], seed=9)[0]
    (p1,) = _probs(peaked_model, [prompt])
    t1s = [t for t in ALLOWED if p1[t] > 0]
    p2 = _probs(peaked_model, [prompt + [t] for t in t1s])
    pairs = [(t1, t2) for i, t1 in enumerate(t1s) for t2 in ALLOWED if p2[i][t2] > 0]
    p3 = _probs(peaked_model, [prompt + [a, b] for a, b in pairs])
    joint12 = {(t1, t2): float(p1[t1] * p2[i][t2]) for i, t1 in enumerate(t1s) for t2 in ALLOWED if p2[i][t2] > 0}
    joint23: dict = {}
    for (t1, t2), row in zip(pairs, p3):
        for t3 in ALLOWED:
            if row[t3] > 0:
                joint23[(t2, t3)] = joint23.get((t2, t3), 0.0) + joint12[(t1, t2)] * float(row[t3])
    return prompt, {"12": joint12, "23": joint23}


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


def sample(path, prompt, spec):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=3, seed=i, ignore_eos=True,
                             allowed_token_ids=ALLOWED, detokenize=False) for i in range(N)]
    run = run_dsv4(path, [TokensPrompt(prompt_token_ids=prompt)] * N, params, spec, max_num_seqs=32)
    c12, c23 = {}, {}
    for out in run.outputs:
        c12[tuple(out[:2])] = c12.get(tuple(out[:2]), 0) + 1
        c23[tuple(out[1:3])] = c23.get(tuple(out[1:3]), 0) + 1
    return run, c12, c23


def test_sampled_distribution_matches_target(peaked_model, law):
    prompt, joint = law
    run, c12, c23 = sample(peaked_model, prompt, SPEC)
    assert run.tree_stats["accepted"] > N // 8, f"too few accepted drafts to test anything: {run.tree_stats}"
    assert set(c12) <= set(joint["12"]) and set(c23) <= set(joint["23"])  # nothing outside the support
    for name, counts in (("12", c12), ("23", c23)):
        p = chi_square_fit(counts, joint[name], N)
        assert p > P_MIN, f"tree speculation (t{name[0]}, t{name[1]}): chi-square p = {p:.2e}"


def test_sampling_check_detects_a_lossy_verifier(peaked_model, law, monkeypatch):
    from vllm_tree_spec.integration import tree_sampler

    real = tree_sampler.verify_batch

    def lossy(batch, p, q, modes, coins, **kw):
        return real(batch, p, q, torch.zeros_like(modes), coins, **kw)  # Mode.GREEDY for everyone

    monkeypatch.setattr(tree_sampler, "verify_batch", lossy)
    monkeypatch.setenv(tree_sampler.VERIFY_ENV, "torch")  # the plant sits in verify_batch (CUDA's default is the kernel)
    prompt, joint = law
    run, c12, c23 = sample(peaked_model, prompt, SPEC)
    assert chi_square_fit(c23, joint["23"], N) < P_MIN
