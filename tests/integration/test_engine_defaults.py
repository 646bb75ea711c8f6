"""vLLM's defaults with tree speculation: prefix caching, mixed batches, refused combinations, budgets."""

import pytest
from engine_utils import TieChecker, compare_greedy, repetitive_prompts, run_engine

VOCAB = 2048
TREE = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}  # trees of <= 8 nodes


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))


@pytest.mark.vllm
def test_prefix_cache_reuses_committed_tree_kv(model):
    """Blocks written by tree steps (compacted KV) are later served from the prefix cache.

    Round 1 generates 160 tokens with tree speculation, so whole 128-token blocks
    hold KV that the commit moved into place. Round 2 resubmits prompt + output in
    the same engine (prefix-cache hits on those blocks) and continues greedily; the
    continuation must equal an engine without speculation and without caching.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = repetitive_prompts(4, VOCAB, seed=11)
    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=8, seed=0,
              speculative_config=TREE, enable_prefix_caching=True)
    try:
        first = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                             SamplingParams(temperature=0, max_tokens=160, ignore_eos=True), use_tqdm=False)
        long_prompts = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, first)]
        second = llm.generate([TokensPrompt(prompt_token_ids=p) for p in long_prompts],
                              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        hits = sum(o.num_cached_tokens or 0 for o in second)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert hits >= 128 * len(prompts), f"expected prefix-cache hits on tree-written blocks, got {hits}"
    ref = run_engine(model, [TokensPrompt(prompt_token_ids=p) for p in long_prompts],
                     SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), enable_prefix_caching=False)
    compare_greedy(ref.outputs, [list(o.outputs[0].token_ids) for o in second], long_prompts, TieChecker(model))


@pytest.mark.vllm
def test_mixed_sampling_settings_in_one_batch(model):
    """Greedy and sampled requests (with and without penalties) share batches."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    raw = repetitive_prompts(12, VOCAB, seed=3)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = []
    for i in range(len(raw)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=32, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7, repetition_penalty=1.2, seed=i, max_tokens=32,
                                         ignore_eos=True))
    base = run_engine(model, prompts, params)
    run = run_engine(model, prompts, params, TREE)
    greedy = [i for i in range(len(raw)) if i % 3 == 0]
    compare_greedy([base.outputs[i] for i in greedy], [run.outputs[i] for i in greedy], [raw[i] for i in greedy],
                   TieChecker(model))
    assert all(len(o) == 32 for o in run.outputs)
    assert run.tree_stats["rounds"] > 0


@pytest.mark.vllm
def test_async_scheduling_is_refused_at_startup(model):
    from vllm import LLM

    with pytest.raises(Exception, match="async scheduling"):
        LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True, speculative_config=TREE,
            async_scheduling=True)


@pytest.mark.vllm
def test_offline_bad_config_names_the_key(model):
    from vllm import LLM

    from vllm_tree_spec.config import TreeSpecError

    with pytest.raises(TreeSpecError, match="budgets"):
        LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
            speculative_config={**TREE, "budgets": {1: 20}})
    with pytest.raises(TreeSpecError, match="verification"):
        LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
            speculative_config={**TREE, "verification": "sampled"})


@pytest.mark.vllm
def test_budget_zero_at_large_batch_switches_speculation_off(model):
    """Per-batch-size budgets: batches above 2 requests get no drafts (budget 0)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    raw = repetitive_prompts(8, VOCAB, seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    base = run_engine(model, prompts, params)
    run = run_engine(model, prompts, params, {**TREE, "budgets": {2: 8, 1000: 0}})
    assert run.outputs == base.outputs
    alone = run_engine(model, prompts[:1], params, {**TREE, "budgets": {2: 8, 1000: 0}})
    assert alone.tree_stats["rounds"] > 0  # a single request still speculates
    # without the budget all 8 requests would speculate every step (~8x the rounds of one request)
    assert run.tree_stats["rounds"] <= alone.tree_stats["rounds"]


@pytest.mark.vllm
def test_history_dependent_parameters_see_each_rows_own_path(model):
    """Penalties, min_tokens and bad words are applied per tree row with that row's path as history.

    Greedy output must equal the engine without speculation token for token, the parameters must
    change the output (else the test could not fail), and the tree must have drafted and accepted.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.tokenizers import get_tokenizer

    raw = repetitive_prompts(8, VOCAB, seed=5)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    plain = SamplingParams(temperature=0, max_tokens=64)
    free = run_engine(model, prompts, plain).outputs
    tok = get_tokenizer(model)
    # a bad word the unconstrained model would produce; a frequent token as stop token under min_tokens
    bad = tok.decode(free[0][4:6])
    stop = max(set(t for o in free for t in o), key=lambda t: sum(o.count(t) for o in free))
    params = [
        SamplingParams(temperature=0, max_tokens=64, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=64, frequency_penalty=0.3, presence_penalty=0.2,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=64, min_tokens=30, stop_token_ids=[stop]),
        SamplingParams(temperature=0, max_tokens=64, bad_words=[bad], ignore_eos=True),
    ]
    params = [params[i % len(params)] for i in range(len(raw))]
    base = run_engine(model, prompts, params)
    run = run_engine(model, prompts, params, TREE)
    assert sum(a != b for a, b in zip(base.outputs, free)) >= len(raw) // 2, "parameters must change outputs"
    for i, (a, b) in enumerate(zip(base.outputs, run.outputs)):
        assert a == b, f"prompt {i} ({params[i]}): differs at token {next(k for k, (x, y) in enumerate(zip(a, b)) if x != y) if a[:len(b)] != b[:len(a)] else min(len(a), len(b))}"
    assert run.tree_stats["rounds"] > 0 and run.tree_stats["accepted"] > 0, run.tree_stats


@pytest.mark.vllm
def test_requests_near_max_model_len_keep_their_trees(model):
    """Requests that run into max_model_len, batched with requests that do not.

    vLLM zeroes every request's drafts once the longest request in the batch cannot take
    num_spec_tokens more positions; the tree runner sizes each request's tree by its own room
    instead (an engine that scheduled those zeros without a tree behind them crashed mid-request).
    Outputs stop at max_model_len exactly as without speculation, and short requests keep drafting.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = 256
    raw = repetitive_prompts(6, VOCAB, seed=3)
    long_ = [(p * 20)[: max_len - 20 + 3 * i] for i, p in enumerate(raw[:4])]  # 20, 17, 14, 11 positions left
    prompts = [TokensPrompt(prompt_token_ids=p) for p in long_ + raw[4:]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = run_engine(model, prompts, params, max_model_len=max_len)
    run = run_engine(model, prompts, params, TREE, max_model_len=max_len)
    assert [len(o) for o in base.outputs[:4]] == [20, 17, 14, 11]
    assert run.outputs == base.outputs
    assert run.tree_stats["rounds"] > 0 and run.tree_stats["accepted"] > 0
