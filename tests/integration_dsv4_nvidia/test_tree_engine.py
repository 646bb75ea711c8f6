"""Tree speculation on vLLM 0.32's NVIDIA DeepSeek-V4 path, emulated on the CPU (the default-run checks).

The engine is nvidia_emulation's (vLLM's NVIDIA model classes, the reference pack for the CUDA-only ops,
vLLM's Triton kernels and ours under Triton's interpreter), with tree speculation through the NVIDIA
adapter (vllm_tree_spec/integration/dsv4/nvidia). The oracle drafter hides the target's greedy continuation
in random trees (siblings complete the same C4 block in different branches; accepted paths leave the first
branch), on prompts whose trees cross C4 blocks, the 128-token window and the C128 boundaries at 127 / 255:

* greedy output identical to the same engine without speculation, and the log-prob of every emitted token
  (computed in the verify step's row of its node) equal to the stock engine's within rounding;
* after every refresh, every store of the request (SWA window rows, CSA main / indexer and HCA compressor
  state rows, C4 / C128 entries, indexer keys) equals the stores of the stock engine that decoded the same
  tokens one by one (fp8 rows dequantized within one code step, dsv4_harness.compare_snapshots; fp32 state rows
  within the emulation's batch-shape rounding, nv_tree_harness.STATE_REL_TOL);
* the plan ran what it is for: block-completing draft nodes of both ratios, entries of both ratios refreshed.

The extended checks (marker `extended`) are in test_tree_engine_slow.py: negative controls planted in the
adapter, every node's row against sequential decoding, n-gram chains and static / dynamic suffix trees; tree
steps past the indexer's short-context bypass in test_tree_engine_long_context.py, the MTP drafter in
test_tree_engine_mtp.py. Not run here: sampled requests.
"""

import random

import pytest

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = (61, 124, 253)
MAX_TOKENS = 16
SPEC = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}
EMITTED_LOGPROB_TOL = 5e-2  # measured 2.3e-2, the same as root rows of all-wrong trees (the batch-shape floor)


def prompts(seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def base(decisive_model):
    import nvidia_harness as H
    import nv_tree_harness as T
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    snaps: dict = {}
    with H.nvidia_engine(decisive_model) as llm:
        T.record_base_snapshots(snaps)(llm)
        run = H.generate(llm, prompts(), params)
    return params, run, snaps


@pytest.fixture(scope="module")
def tree(decisive_model, base):
    import nv_tree_harness as T
    from dsv4_harness import OracleTreeDrafter

    params, run, _ = base
    truth = {tuple(p): o for p, o in zip(prompts(), run.outputs)}
    records, snaps = [], {}
    tree = T.run_tree(decisive_model, prompts(), params, SPEC,
                      drafter_factory=lambda cfg: OracleTreeDrafter(truth, "random", seed=11, p_full=0.7),
                      on_llm=T.record_tree_steps(records, snaps))
    return tree, records, snaps


def test_greedy_identical_and_emitted_rows_equal_stock(base, tree):
    import nv_tree_harness as T

    _, run, _ = base
    tr, records, _ = tree
    assert tr.adapter == "DeepseekV4NvidiaTreeAdapter"
    assert tr.outputs == run.outputs
    d = T.emitted_logprob_deltas(tr.outputs, tr.logprobs, run.outputs, run.logprobs)
    print(f"emitted-token |dlogprob| max {max(d):.2e} over {len(d)} tokens; adapter {tr.adapter_stats}")
    assert len(d) == sum(map(len, run.outputs)) and max(d) <= EMITTED_LOGPROB_TOL
    cross = T.block_crossings(records)
    assert cross["c4"] > 10 and cross["c128"] > 0 and cross["same_block"] > 0, cross
    assert tr.adapter_stats["emitters_c4"] > 0 and tr.adapter_stats["emitters_c128"] > 0
    assert tr.tree_stats["off_first_branch"] > 0 and tr.tree_stats["accepted"] > len(records)


def refreshed_entries(records) -> dict[int, int]:
    """Accepted nodes whose position completes a C4 / C128 block (entries the refresh moved)."""
    out = {4: 0, 128: 0}
    for rec in records:
        for k, _ in enumerate(rec.accepted, start=1):
            for m in out:
                out[m] += (rec.root_pos + k + 1) % m == 0
    return out


def test_caches_after_refresh_equal_sequential_decode(base, tree):
    from nv_tree_harness import snapshot_mismatches
    from test_dsv4_hook import worst_per_store

    _, run, base_snaps = base
    tr, records, snaps = tree
    common = [k for k in snaps if k in base_snaps]
    assert len(common) >= 8, f"only {len(common)} refresh points to compare"
    stores = set(next(iter(snaps.values())))
    for suffix in ("attn.swa_cache", "attn.compressor.state_cache", "indexer.compressor.state_cache",
                   "indexer.k_cache"):
        assert any(s.endswith(suffix) for s in stores), (suffix, sorted(stores))
    moved = refreshed_entries(records)
    assert moved[4] > 0 and moved[128] > 0, moved
    bad = {k: d for k in common if (d := snapshot_mismatches(base_snaps[k], snaps[k]))}
    print(f"worst row per store over {len(common)} refresh points:", worst_per_store(base_snaps, snaps, common))
    assert not bad, f"{len(bad)} of {len(common)} refresh points differ, e.g. {next(iter(bad.items()))}"
