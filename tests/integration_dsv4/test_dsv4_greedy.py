"""DeepSeek-V4 end to end, greedy: tree speculation inside vLLM's own model equals no speculation.

Three prompts (61, 125 and 250 tokens, 40 generated tokens each) put tree
steps across CSA boundaries (every 4 positions), the HCA boundaries at
positions 127 and 255, and the 128-token window. Drafters:

* the oracle drafter (dsv4_harness): random trees around the true greedy
  continuation, so accepted paths are long, leave the first branch, and
  sibling branches complete the same C4 / C128 block with different entries;
* vLLM-free model drafters on a static tree (explicit paths) and a dynamic
  shape (s3_k2_d6), and the MTP head (test_dsv4_mtp.py). The decisive
  checkpoint mostly continues a token by a fixed successor, so these get
  "recall" prompts: prompt + its greedy output + the prompt's last 4 tokens
  (the continuation repeats text the n-gram / suffix drafters have seen).

Outputs are judged by the greedy-identity oracle (dsv4_harness.dsv4_oracle,
docs/testing.md): identical, or one divergence at a proven near-tie followed by
exactly the target's greedy continuation. The checkpoint is the decisive one
(tiny_dsv4.DECISIVE_BIGRAM). Its greedy output hardly depends on attention
(removing the row refresh leaves it unchanged), so the negative controls
(`_controls`: no branch isolation, no row refresh, no entry refresh, a planted
commit off-by-one) run on the flat checkpoint in test_dsv4_amx_emulation.py,
where the oracle must reject each.
"""

import pytest
from dsv4_harness import OracleTreeDrafter, dsv4_oracle, random_prompts, run_dsv4

PROMPT_LENGTHS = (61, 125, 250)
MAX_TOKENS = 40
BUDGET = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}  # 8 draft slots; the drafter is replaced


@pytest.fixture(scope="module")
def setup(dsv4_model):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    raw = random_prompts(PROMPT_LENGTHS, seed=1, repeat=0.6)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = run_dsv4(dsv4_model, prompts, params)
    truth = {tuple(p): o for p, o in zip(raw, base.outputs)}
    return raw, prompts, params, base, truth, dsv4_oracle(dsv4_model, raw, params)


@pytest.fixture(scope="module")
def recall_setup(dsv4_model, setup):
    from vllm.inputs import TokensPrompt

    raw, _, params, base, _, _ = setup
    recall = [p + o + p[-4:] for p, o in zip(raw, base.outputs)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in recall]
    rbase = run_dsv4(dsv4_model, prompts, params)
    return recall, prompts, params, rbase, None, dsv4_oracle(dsv4_model, recall, params)


def _assert_identical(setup, run):
    raw, _, _, base, _, oracle = setup
    for line in oracle.check(raw, base.outputs, run.outputs).lines():
        print(line)


@pytest.mark.vllm
@pytest.mark.parametrize("shape", ["random", "two_branch", "chain"])
def test_oracle_trees_identical_to_no_speculation(dsv4_model, setup, shape):
    raw, prompts, params, base, truth, _ = setup
    run = run_dsv4(dsv4_model, prompts, params, BUDGET,
                   drafter_factory=lambda cfg: OracleTreeDrafter(truth, shape, seed=3))
    _assert_identical(setup, run)
    st, ad = run.tree_stats, run.adapter_stats
    assert st["accepted"] > 40, st
    assert ad["refresh_c4"] > 0 and ad["refresh_c128"] > 0, f"no C4 / C128 entry refreshed: {ad}"
    if shape != "chain":
        assert st["off_first_branch"] > 0 and ad["refresh_rows"] > 0, (st, ad)
    # vLLM's own counters see an ordinary accepted chain
    assert run.metrics["num_accepted_tokens"] == st["accepted"]


@pytest.mark.vllm
@pytest.mark.parametrize("spec", [
    {"method": "tree", "drafter": "suffix", "tree": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]"},
    {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6"},
    {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4},
], ids=["suffix-static", "suffix-dynamic-s3_k2_d6", "ngram-chain6"])
def test_model_free_drafters_identical(dsv4_model, recall_setup, spec):
    raw, prompts, params, base, truth, _ = recall_setup
    run = run_dsv4(dsv4_model, prompts, params, spec)
    _assert_identical(recall_setup, run)
    assert run.tree_stats["rounds"] > 10 and run.tree_stats["accepted"] > 0, run.tree_stats


def _controls():
    from vllm_tree_spec.integration.dsv4.adapter import DeepseekV4TreeAdapter

    def no_isolation(self, runner, step, attn_metadata):  # stock DeepSeek-V4 path, tree positions only
        self.plan = None

    def no_entry_refresh(self, plan, ratio, reqs, paths, block_table_c):
        return 0

    real_commit = DeepseekV4TreeAdapter.commit

    def no_row_refresh(self, runner, reqs, paths):
        groups, self.row_groups = self.row_groups, []
        try:
            return real_commit(self, runner, reqs, paths)
        finally:
            self.row_groups = groups

    from vllm_tree_spec.integration import kv_layout

    return {
        "no-isolation": (DeepseekV4TreeAdapter, "on_metadata", no_isolation),
        "no-entry-refresh": (DeepseekV4TreeAdapter, "_refresh_entries", no_entry_refresh),
        "no-row-refresh": (DeepseekV4TreeAdapter, "commit", no_row_refresh),
        "commit-off-by-one": (kv_layout, "compaction_pairs", commit_off_by_one),
    }


def commit_off_by_one(row_slots, accepted):
    """A planted bug: the k-th accepted node's row is copied from the slot one row early (row n, not 1 + n)."""
    return [(row_slots[n], row_slots[k]) for k, n in enumerate(accepted, start=1) if n + 1 != k]
