"""Faults in a tree engine: forced preemption, aborts in every phase, and no leaked per-request state.

One load per drafter (ngram, suffix, draft_model, eagle3) on an in-process engine with a tiny KV
cache (12 blocks of 32 tokens for 6 seats of ~200-token requests, so running requests are preempted
and recomputed), chunked prefill (64-token chunks, every prompt is longer) and a mix of greedy,
penalised, seeded sampled, logprobs and draftless (`extra_args`) requests. Three requests are aborted,
each when the scheduler shows it in its phase:

    queued     waiting, nothing computed yet
    prefill    running, part of its prompt computed (a chunked prefill in progress)
    mid-tree   running with drafts proposed and not yet verified (its tree recorded in the runner)

After every step, every per-request place of `integration/live_state.py` holds only requests vLLM's
runner still holds; after the load (and vLLM's flush step) every place is empty, also as the workers'
`tree_live_state` reports it through `collective_rpc`. The load must have preempted requests, and every
request that was not aborted completes: the greedy ones token-identical to no speculation (the greedy
oracle, `engine_utils.compare_greedy`), the sampled ones with all their tokens.
"""

import sys
from pathlib import Path

import pytest
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, tree_runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from abort_phases import PHASES, abort_in_new_phases  # noqa: E402
from tiny_eagle3 import make_tiny_eagle3  # noqa: E402

VOCAB = 2048
NUM_REQUESTS = 12
MAX_TOKENS = 100
TINY_CACHE = dict(num_gpu_blocks_override=12, block_size=32, max_model_len=256, max_num_seqs=6,
                  max_num_batched_tokens=64, enable_chunked_prefill=True)  # CPU_ATTN blocks: multiples of 32


def _params(i: int):
    """The request mix: greedy, greedy with penalties, draftless greedy, logprobs, seeded sampled."""
    from vllm import SamplingParams

    common = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    kind = i % 6
    if kind == 1:
        return SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.3, **common)
    if kind == 2:  # served without drafts (extra_args may carry custom processors): runner.skip_logged
        return SamplingParams(temperature=0, extra_args={"soak": 1}, **common)
    if kind == 3:
        return SamplingParams(temperature=0, logprobs=2, **common)
    if kind in (4, 5):
        return SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=100 + i, **common)
    return SamplingParams(temperature=0, **common)


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0, initializer_range=0.08))
    raw = [p * 3 for p in repetitive_prompts(NUM_REQUESTS, VOCAB, seed=3)]  # 72-105 tokens: chunked
    params = [_params(i) for i in range(NUM_REQUESTS)]
    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=8, seed=0)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in raw], params, use_tqdm=False)
        base = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return model, raw, params, base


def _spec(drafter: str, tiny_models, model: str) -> tuple[dict, dict]:
    if drafter == "ngram":
        return {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 6}, {}
    if drafter == "suffix":
        return {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6"}, {}
    if drafter == "draft_model":
        draft = str(tiny_models.llama(vocab_size=VOCAB, num_layers=1, seed=1, initializer_range=0.08))
        return {"method": "tree", "drafter": "draft_model", "model": draft, "tree": "s3_k2_d6"}, {}
    head = str(make_tiny_eagle3(tiny_models.root / "eagle3-faults", model, aux_layer_ids=(0, 1, 2)))
    return {"method": "tree", "drafter": "eagle3", "model": head, "tree": "s3_k2_d6"}, {}  # prefix caching on


@pytest.mark.vllm
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "draft_model", "eagle3"])
def test_preemption_and_aborts_leave_no_state(setup, tiny_models, drafter):
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from vllm_tree_spec.integration.live_state import counts, leaks, live_state

    model, raw, params, base = setup
    spec, extra = _spec(drafter, tiny_models, model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False,
              speculative_config=spec, **TINY_CACHE, **extra)
    try:
        eng = llm.llm_engine
        scheduler = eng.engine_core.engine_core.scheduler
        runner = tree_runner(llm)
        for i, p in enumerate(raw):
            eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params[i])
        aborted: dict[str, str] = {}  # phase -> external request id
        finished = {}
        rounds_seen = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
            state = live_state(runner)
            assert not leaks(state), (drafter, leaks(state), counts(state))
            assert not state["runner.step"], state["runner.step"]  # the step's scratch is dropped after sampling
            rounds_seen += bool(state["runner.drafts"])
            abort_in_new_phases(eng, scheduler, runner, aborted)
        eng.step()  # vLLM's flush step: the last finished / aborted ids reach the runner
        state = live_state(runner)
        assert all(not ids for ids in state.values()), (drafter, counts(state))
        (rpc,) = llm.collective_rpc("tree_live_state")
        assert rpc == state
        preemptions = sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        stats = runner.tree_stats.as_dict()
        prefix = runner.tree_stats.prefix
        print(f"{drafter}: {preemptions} preemptions, prefix-cache restores {prefix}")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm

    assert set(aborted) == set(PHASES), f"phases never reached: {set(PHASES) - set(aborted)}"
    assert preemptions > 0, "the tiny KV cache did not force a preemption"
    assert rounds_seen and stats["rounds"] > 0, stats
    kept = [i for i in range(NUM_REQUESTS) if f"r{i}" not in aborted.values()]
    assert sorted(finished) == sorted(f"r{i}" for i in kept), "lost requests"
    for i in kept:
        assert len(finished[f"r{i}"].outputs[0].token_ids) == MAX_TOKENS, (i, finished[f"r{i}"])
    penalised = [i for i in kept if params[i].repetition_penalty != 1]  # the oracle's reference has no penalties
    assert [finished[f"r{i}"].outputs[0].token_ids for i in penalised] == [base[i] for i in penalised]
    greedy = [i for i in kept if params[i].temperature == 0 and i not in penalised]
    compare_greedy([base[i] for i in greedy], [list(finished[f"r{i}"].outputs[0].token_ids) for i in greedy],
                   [raw[i] for i in greedy], TieChecker(model))
