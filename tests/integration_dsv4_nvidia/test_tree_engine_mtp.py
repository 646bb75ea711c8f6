"""The MTP tree drafter on vLLM's NVIDIA DeepSeek-V4 layers, emulated on the CPU.

The drafter (drafters/mtp.py) runs the checkpoint's MTP layer in PyTorch and mixes its hc streams with the
target's own mHC ops: on vLLM's NVIDIA layers the fused kernels the NVIDIA model calls
(integration/dsv4/mhc_ops.py; in this emulation the reference pack's versions of them, bound where the model
reads them). The engine's checkpoint is the decisive one with an MTP layer that passes the next token's
embedding through (tiny_dsv4 `mtp_bigram`), so MTP trees get accepted, deep enough to cross C4 blocks:

* unit (bf16, the kernels' contract): an MTP head mixing with the NVIDIA kernels' contract (the reference pack's
  mHC ops) gives the rows of one mixing with the drafter's PyTorch fallbacks, and each tree node's row equals
  that head run as a chain along the node's path (the path invariant for the draft head);
* engine: the drafter is bound to the NVIDIA model's kernels; dynamic (s3_k2_d6) MTP trees give output
  identical to the same engine without speculation, with accepted nodes completing C4 blocks, and every store
  after each refresh equal to sequential decoding.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = (61, 124, 253)
MAX_TOKENS = 16
SPEC = {"method": "tree", "drafter": "mtp", "tree": "s3_k2_d6"}
BF16_PROB_TOL = 2e-2  # bf16 rows of the same maths in different op orders / batch shapes


def _nv_ops():
    from vllm_tree_spec.reference.dsv4_gpu_ops import mhc

    return dict(mhc_pre=mhc.mhc_pre_tilelang, mhc_post=mhc.mhc_post_tilelang, hc_head=mhc.hc_head_fused_kernel_tilelang)


def _tokens(n, seed):
    from test_dsv4_mtp import SMALL

    return [int(t) for t in torch.randint(0, SMALL.vocab, (n,), generator=torch.Generator().manual_seed(seed))]


def test_nvidia_kernel_mixing_equals_the_pytorch_fallbacks():
    from test_dsv4_mtp import _caught_up, small_head

    from vllm_tree_spec.drafters.mtp import MTPTreeDrafter

    tokens = _tokens(14, 2)
    states = [_caught_up(MTPTreeDrafter("s3_k2_d6", head=small_head(0, torch.bfloat16, **ops), dtype=torch.bfloat16),
                         tokens, pieces=2)[0] for ops in ({}, _nv_ops())]
    p = [torch.softmax(s.root_logits.float(), -1) for s in states]
    diff = float((p[0] - p[1]).abs().max())
    print(f"root q, NVIDIA-contract mixing vs PyTorch mixing: max |dp| {diff:.2e}")
    assert diff <= BF16_PROB_TOL and int(p[0].argmax()) == int(p[1].argmax())


def test_tree_rows_with_nvidia_kernel_mixing_equal_chains():
    from test_dsv4_mtp import _caught_up, _chain_q, small_head

    from vllm_tree_spec import build
    from vllm_tree_spec.drafters.mtp import MTPTreeDrafter, _Session

    d = MTPTreeDrafter("s3_k2_d6", head=small_head(0, torch.bfloat16, **_nv_ops()), dtype=torch.bfloat16)
    assert d.head._mhc_pre is _nv_ops()["mhc_pre"]  # mixing with the kernels' contract, not the fallbacks
    st, _ = _caught_up(d, _tokens(14, 2), pieces=3)
    session = _Session(d, [st])
    worst = 0.0
    with torch.no_grad():
        tree = build.build_dynamic_batch(session, d.policy.shape, [()])[0].tree
        assert tree.num_nodes >= 5
        expanded = session.nodes[0]
        assert len(expanded) >= 2
        for path, (x, _) in expanded.items():
            got = torch.softmax(d.head.logits(x[None])[0].float(), -1)
            ref = _chain_q(d, st, path).float()
            worst = max(worst, float((got - ref).abs().max()))
    print(f"tree rows vs chains (NVIDIA-contract mixing, bf16): max |dp| {worst:.2e} over {len(expanded)} rows")
    assert worst <= BF16_PROB_TOL


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    from tiny_dsv4 import DECISIVE_BIGRAM, make_tiny_dsv4

    return str(make_tiny_dsv4(tmp_path_factory.mktemp("nv_mtp") / "dsv4", bigram=DECISIVE_BIGRAM, mtp_bigram=True))


def _prompts(seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.extended  # ~55 s; by default the MTP mixing and tree-row tests above, and the oracle tree engine
def test_mtp_trees_greedy_identical_with_stores_equal_to_sequential_decode(mtp_model):
    import sys

    import nv_tree_harness as T
    import nvidia_harness as H
    from test_tree_engine import refreshed_entries
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    base_snaps: dict = {}
    with H.nvidia_engine(mtp_model) as llm:
        T.record_base_snapshots(base_snaps)(llm)
        run = H.generate(llm, _prompts(), params)
    records, snaps, bound = [], {}, {}

    def on_llm(llm):
        T.record_tree_steps(records, snaps)(llm)
        head = T.worker_runner(llm).drafter.drafter.head
        nv = sys.modules["vllm.models.deepseek_v4.nvidia.model"]
        bound.update(pre=head._mhc_pre is nv.mhc_pre_tilelang, post=head._mhc_post is nv.mhc_post_tilelang,
                     head=head._hc_head is nv.hc_head_fused_kernel_tilelang)

    tr = T.run_tree(mtp_model, _prompts(), params, SPEC, on_llm=on_llm)
    assert bound == {"pre": True, "post": True, "head": True}, bound  # the NVIDIA model's own mHC kernels
    assert tr.adapter == "DeepseekV4NvidiaTreeAdapter"
    assert tr.outputs == run.outputs
    moved = refreshed_entries(records)
    print(f"MTP trees: {tr.tree_stats['accepted']} accepted over {len(records)} tree rows, "
          f"mean accepted length {tr.tree_stats['mean_accepted_length']:.2f}, entries moved {moved}")
    assert tr.tree_stats["accepted"] > 2 * len(records) and moved[4] > 0
    common = [k for k in snaps if k in base_snaps]
    assert len(common) >= 8, f"only {len(common)} refresh points to compare"
    bad = {k: d for k in common if (d := T.snapshot_mismatches(base_snaps[k], snaps[k]))}
    assert not bad, f"{len(bad)} of {len(common)} refresh points differ, e.g. {next(iter(bad.items()))}"
