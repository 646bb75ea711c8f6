"""The online shape policy (`"budgets": "auto"`) in a serving engine: plans change, greedy output does not.

A tiny Llama with the n-gram drafter, re-planning every 16 steps. Step costs on a 2-core CI machine
say little, so one run replaces the measured step time by a synthetic cost (costly rows first, cheap
rows later): the plan must go to `none` and come back to speculation while serving, and the greedy
output must equal the engine without speculation throughout (pruned trees, no drafts and
exploration steps all verified). The plan is exported on `/metrics` (prometheus registry of the
in-process engine) and every change is logged.
"""

import logging

import pytest
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, run_engine, tree_runner

VOCAB = 2048
MAX_TOKENS = 64
AUTO = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 6, "replan_every": 16, "explore_every": 4}


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    raw = repetitive_prompts(16, VOCAB, seed=5)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_engine(model, prompts, params)
    return model, raw, prompts, params, base


@pytest.mark.vllm
def test_plan_changes_while_serving_and_greedy_output_stays(setup, monkeypatch, caplog):
    from vllm_tree_spec import online_policy

    model, raw, prompts, params, base = setup
    seen = {"steps": 0}
    original = online_policy.OnlinePolicy.observe_step

    def synthetic_cost(self, batch_size, rows, step_ms, draft_ms, drafted, explored, *args, **kwargs):
        # first 60 steps: every row costs 5 ms (no tree pays); then rows are nearly free
        seen["steps"] += 1
        per_row = 5.0 if seen["steps"] <= 60 else 0.01
        return original(self, batch_size, rows, 1.0 + per_row * rows, 0.05 if drafted else 0.0, drafted,
                        explored, *args, **kwargs)

    monkeypatch.setattr(online_policy.OnlinePolicy, "observe_step", synthetic_cost)
    history = []
    record = online_policy.OnlinePolicy.replan

    def replan(self, *args, **kwargs):
        decisions = record(self, *args, **kwargs)
        history.extend((seen["steps"], str(d.old), str(d.new)) for d in decisions if d.changed)
        return decisions

    monkeypatch.setattr(online_policy.OnlinePolicy, "replan", replan)
    with caplog.at_level(logging.INFO, logger="vllm_tree_spec.integration.shape_policy"):
        run = run_engine(model, prompts, params, AUTO, max_num_seqs=4)
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    news = [new for _, _, new in history]
    assert "none" in news, history
    assert any(n != "none" for n in news[news.index("none") + 1:]), history  # and back to speculating
    assert run.tree_stats["rounds"] > 0 and run.tree_stats["accepted"] > 0, run.tree_stats
    lines = [r.getMessage() for r in caplog.records if "Tree shape plan" in r.getMessage()]
    assert len(lines) == len(history), (lines, history)
    assert all("predicted" in m and "measured" in m and " -> " in m for m in lines), lines


@pytest.mark.vllm
def test_measured_policy_serves_identically_and_exports_its_plan(setup):
    """Real measurements (whatever they decide on this machine): re-plans happen, output is unchanged,
    `/metrics` carries the plan gauges and the change counter."""
    import prometheus_client

    model, raw, prompts, params, base = setup
    from vllm import LLM

    before = _plan_changes(prometheus_client.generate_latest().decode())
    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=4, seed=0,
              speculative_config=AUTO)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        pol = tree_runner(llm).drafter.shape_policy.policy
        assert pol.replans >= 3 and pol.rounds_seen > 100, (pol.replans, pol.rounds_seen)
        assert pol.max_replan_ms < 250, pol.max_replan_ms
        text = prometheus_client.generate_latest().decode()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    compare_greedy(base.outputs, [list(o.outputs[0].token_ids) for o in outs], raw, TieChecker(model))
    for b in ("1", "2", "4"):
        for name in ("plan_nodes", "plan_depth", "plan_width", "plan_full", "plan_score_gate"):
            assert f'vllm_tree_spec:{name}{{batch_size="{b}",drafter="ngram"}}' in text, (name, b)
    assert _plan_changes(text) - before == pol.changes


def _plan_changes(text: str) -> float:
    """vllm_tree_spec:plan_changes_total for the n-gram drafter (0 before the first engine)."""
    for ln in text.splitlines():
        if ln.startswith('vllm_tree_spec:plan_changes_total{drafter="ngram"}'):
            return float(ln.split()[-1])
    return 0.0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended  # ~27 s; TP = 2 tree engines stay in the default run (test_engine_tp.py, test_engine_eagle_tp.py)
def test_tensor_parallel_ranks_share_the_plan(tiny_models, monkeypatch):
    """TP = 2: every rank drafts its own trees and times its own steps; re-planning every 8 steps must give
    all ranks rank 0's plan (else the scheduled drafts would not match a rank's tree), and greedy output
    equals TP = 1 without speculation."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    raw = repetitive_prompts(8, VOCAB, seed=21)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = run_engine(model, prompts, params)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    run = run_engine(model, prompts, params, {**AUTO, "replan_every": 8, "explore_every": 2},
                     tensor_parallel_size=2, distributed_executor_backend="mp")
    compare_greedy(base.outputs, run.outputs, raw, None)


@pytest.mark.vllm
def test_the_linear_plan_serves_identically(setup, monkeypatch):
    """Every bucket on `linear` from the first step (the suffix drafter drafts its chain alone, the branch call
    skipped; exploration steps still draft the full tree): greedy output equals no speculation, and the linear
    drafts are verified and accepted."""
    from vllm_tree_spec import online_policy

    model, raw, prompts, params, base = setup
    monkeypatch.setattr(online_policy.OnlinePolicy, "_current", lambda self, bucket: online_policy.LINEAR)
    run = run_engine(model, prompts, params, {**AUTO, "drafter": "suffix"}, max_num_seqs=4)
    compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    assert run.tree_stats["rounds"] > 0 and run.tree_stats["accepted"] > 0, run.tree_stats
