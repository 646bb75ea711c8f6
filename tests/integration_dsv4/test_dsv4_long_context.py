"""Long context: the CSA indexer's top-k really selects (more than 512 compressed entries).

A 2100-token prompt gives 525+ C4 entries against index_topk 512, so vLLM's CPU
indexer runs its top-k kernel (`fp8_paged_mqa_logits_cpu` + `topk_transform_512_cpu`)
instead of selecting everything. Tree rows then need their own indexer inputs:
seq_len from the node's depth position and a virtual page-table row holding the
path's keys (plan.py / adapter.on_metadata / patches D2b).

Checks: greedy output identical to no speculation (the greedy-identity oracle,
docs/testing.md); caches after every refresh on the shared prefix equal
sequential decoding; per-node log-probs of the first tree steps equal
vLLM without speculation on context + path; and a control that leaves tree rows
on vLLM's stock indexer inputs (query-order seq_lens, canonical page table)
changes the node rows that have path entries.
"""

import pytest
import torch
from dsv4_harness import (OracleTreeDrafter, dsv4_oracle, random_prompts, record_base_snapshots, record_tree_steps,
                          run_dsv4, snapshot_mismatches)

PROMPT_LEN = 2100
MAX_MODEL_LEN = 2300
MAX_TOKENS = 24
BUDGET = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(dsv4_model):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    raw = random_prompts([PROMPT_LEN], seed=7)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in raw]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base_snaps: dict = {}
    base = run_dsv4(dsv4_model, prompts, params, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
                    on_llm=record_base_snapshots(base_snaps))
    truth = {tuple(p): o for p, o in zip(raw, base.outputs)}
    records, snaps = [], {}
    tree = run_dsv4(dsv4_model, prompts, params, BUDGET, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
                    drafter_factory=lambda cfg: OracleTreeDrafter(truth, "random", seed=2, p_full=0.4),
                    on_llm=record_tree_steps(records, snaps))
    return raw, params, truth, base, base_snaps, tree, records, snaps


def test_long_context_identical_and_refreshed(dsv4_model, runs):
    from test_dsv4_hook import shared_prefix_keys

    raw, params, truth, base, base_snaps, tree, records, snaps = runs
    assert PROMPT_LEN // 4 > 512  # the indexer drops entries
    oracle = dsv4_oracle(dsv4_model, raw, params, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    for line in oracle.check(raw, base.outputs, tree.outputs).lines():
        print(line)
    assert tree.adapter_stats["virtual_pages"] > 0, tree.adapter_stats
    assert tree.tree_stats["off_first_branch"] > 0, tree.tree_stats
    common = shared_prefix_keys(raw, base.outputs, tree.outputs, snaps, base_snaps)
    assert len(common) >= 3
    for k in common:
        diff = snapshot_mismatches(base_snaps[k], snaps[k])
        assert not diff, f"after refresh at length {k[1]}: {diff}"


def test_long_context_node_rows_equal_sequential(dsv4_model, runs):
    from test_dsv4_hook import LOGPROB_TOL, _node_errors, _sequential_logprobs

    *_, records, _ = runs
    first = records[:1]  # one tree step: every leaf path is a 2100-token prefill for the oracle
    seq = _sequential_logprobs(dsv4_model, first, MAX_MODEL_LEN)
    errs, argmax_bad = _node_errors(first, seq)
    assert len(errs) >= 4 and argmax_bad == 0 and float(errs.max()) <= LOGPROB_TOL, (len(errs), argmax_bad,
                                                                                      errs.max())


def test_stock_indexer_rows_change_tree_rows(dsv4_model, runs, monkeypatch):
    from vllm.inputs import TokensPrompt

    from vllm_tree_spec.integration.dsv4.adapter import DeepseekV4TreeAdapter

    raw, params, truth, base, base_snaps, tree, records, snaps = runs
    monkeypatch.setattr(DeepseekV4TreeAdapter, "_indexer_metadata", lambda self, md, plan: None)
    ctrl_records: list = []
    run_dsv4(dsv4_model, [TokensPrompt(prompt_token_ids=p) for p in raw], params, BUDGET,
             max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
             drafter_factory=lambda cfg: OracleTreeDrafter(truth, "random", seed=2, p_full=0.4),
             on_llm=record_tree_steps(ctrl_records))
    changed = compared = 0
    for a, b in zip(records, ctrl_records):
        if (a.root_pos, a.tokens, a.parents) != (b.root_pos, b.tokens, b.parents):
            break  # the control's output diverged: later trees differ
        for i, p in enumerate(a.parents):
            depth = 1
            while p >= 0:
                depth, p = depth + 1, a.parents[p]
            has_path_entry = any((a.root_pos + d + 1) % 4 == 0 for d in range(1, depth + 1))
            if has_path_entry:
                compared += 1
                changed += not torch.equal(a.logprobs[i + 1], b.logprobs[i + 1])
    assert compared > 0 and changed > 0, (compared, changed)
