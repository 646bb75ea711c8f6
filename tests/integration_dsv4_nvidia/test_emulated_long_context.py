"""The emulated NVIDIA engine past the CSA indexer's short-context bypass (slow).

A 2100-token prompt holds 525 C4 entries against index_topk 512, so every CSA layer runs the lightning indexer:
prefill through `cp_gather_indexer_k_quant_cache` -> DeepGEMM `fp8_fp4_mqa_logits` -> `top_k_per_row_prefill`,
decode through the builder's DeepGEMM schedule -> `fp8_fp4_paged_mqa_logits` -> the radix top-k -> global slots
for FlashMLA's extra list. Checked: those ops run; the decode path agrees with the prefill path (as in
test_emulated_engine.py); a builder that rewrites the decode seq_lens after building the schedule (what a tree
step must not do) makes the logits op refuse the stale schedule inside the engine.
"""

import random
import statistics

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

LONG = 2100
MEDIAN_DECODE_PREFILL = 3e-3


def _shift_decode_seq_lens(orig_build):
    def build(self, *args, **kwargs):
        md = orig_build(self, *args, **kwargs)
        if md.decode is not None:
            md.decode.seq_lens.sub_(1)  # e.g. tree depth lengths written after the schedule was built
        return md
    return build


def test_long_context_indexer_path(flat_model):
    import nvidia_harness as H
    from vllm import SamplingParams
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder

    from vllm_tree_spec.reference.dsv4_gpu_ops.indexer import StaleScheduleError

    rng = random.Random(5)
    prompts = [[rng.randrange(7, 500) for _ in range(LONG)]]
    with H.nvidia_engine(flat_model, max_model_len=LONG + 64, max_num_seqs=2) as llm:
        with H.OpCalls() as calls:
            _, diffs = H.decode_vs_prefill(llm, prompts, 8)
        median = statistics.median(diffs)
        print(f"|decode - prefill| log-prob at {LONG} tokens: median {median:.2e} max {max(diffs):.3f}")
        assert median <= MEDIAN_DECODE_PREFILL
        assert calls.count["_fp8_fp4_mqa_logits_impl"] >= 2  # both CSA layers' prefill
        assert calls.count["_get_paged_mqa_logits_metadata_impl"] >= 7  # one schedule per decode step
        assert calls.count["_fp8_fp4_paged_mqa_logits_impl"] >= 2 * 7  # both CSA layers per decode step
        assert calls.schedule_rows == {(1, 1)}  # one request, one row: SM90 native next_n = 1
        orig = DeepseekV32IndexerMetadataBuilder.build
        DeepseekV32IndexerMetadataBuilder.build = _shift_decode_seq_lens(orig)
        try:
            with pytest.raises(Exception) as err:
                llm.generate([{"prompt_token_ids": prompts[0][:LONG - 1]}], SamplingParams(max_tokens=2),
                             use_tqdm=False)
        finally:
            DeepseekV32IndexerMetadataBuilder.build = orig
        assert "StaleScheduleError" in repr(err.value) or isinstance(err.value, StaleScheduleError) \
            or "rebuild the schedule" in str(err.value)
