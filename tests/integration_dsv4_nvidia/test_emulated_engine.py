"""vLLM 0.32's NVIDIA DeepSeek-V4 model, emulated on the CPU platform (nvidia_emulation.py), end to end.

* Greedy identity with an independent implementation: HF transformers' DeepSeek-V4 (float32, no FP8 caches)
  on the decisive tiny checkpoint, prompts that cross CSA (C4) and HCA (C128) boundaries and the 128-token
  window: at every generated position transformers' argmax (teacher-forced on the engine's sequence) is the
  engine's token.
* The decode path against the prefill path of the same engine (flat checkpoint): decode rows attend through
  FlashMLA's sparse decode over the paged FP8 caches and vLLM's decode index lists (SWA decode_swa_indices /
  lens, C4 top-k -> global slots, C128 dense lists); prefills through the gathered workspace and the combined
  prefill lists. FP8 rounding differs between batch shapes (the bf16 projections feeding the quantizers round
  differently), so single tokens differ by up to ~0.2; the median is ~5e-4. Negative controls (extended set): a decode
  list that drops the row's own window row, and lists that drop the newest compressed entry, move the median
  to 3e-2 and 1.5e-2.
* Every substituted op runs (no silent fallback): FlashMLA decode with each layer type's extra list, FlashMLA
  prefill, the CuTeDSL-contract compressor at ratios 4 and 128, the mHC ops.
"""

import random
import statistics

import pytest

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = (61, 130, 260)  # C4 every 4; C128 at 127 and 255; window 128
MAX_TOKENS = 16
MEDIAN_DECODE_PREFILL = 3e-3  # measured ~5.4e-4 on a 2-core EPYC; the planted bugs give 1.5e-2 .. 3e-2


def _prompts(seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_greedy_equals_transformers(decisive_model):
    import nvidia_harness as H
    from vllm import SamplingParams

    prompts = _prompts()
    run = H.run_nvidia(decisive_model, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1))
    ref = H.transformers_logprobs(decisive_model, [p + o for p, o in zip(prompts, run.outputs)])
    deltas = []
    for p, out, lps, r in zip(prompts, run.outputs, run.logprobs, ref):
        hf_greedy = [int(r[len(p) + j - 1].argmax()) for j in range(len(out))]
        assert out == hf_greedy, f"prompt of {len(p)} tokens: engine {out} vs transformers {hf_greedy}"
        deltas += [abs(lp - float(r[len(p) + j - 1, t])) for j, (t, lp) in enumerate(zip(out, lps))]
    print(f"log-prob |engine - transformers|: mean {statistics.mean(deltas):.4f} max {max(deltas):.4f}")


def _drop_own_window_row(orig):
    def flash_mla_with_kvcache(*args, **kwargs):
        kwargs["topk_length"] = (kwargs["topk_length"] - 1).clamp(min=0)
        return orig(*args, **kwargs)
    return flash_mla_with_kvcache


def _drop_newest_entry(orig):
    def flash_mla_with_kvcache(*args, **kwargs):
        if kwargs.get("extra_topk_length") is not None:
            kwargs["extra_topk_length"] = (kwargs["extra_topk_length"] - 1).clamp(min=0)
        return orig(*args, **kwargs)
    return flash_mla_with_kvcache


@pytest.mark.extended  # ~17 s; the default run keeps test_greedy_equals_transformers
def test_decode_path_matches_prefill_path_and_every_substitute_runs(flat_model):
    import nvidia_harness as H

    with H.nvidia_engine(flat_model) as llm:
        with H.OpCalls() as calls:
            _, diffs = H.decode_vs_prefill(llm, _prompts(), MAX_TOKENS)
    median = statistics.median(diffs)
    print(f"|decode - prefill| log-prob: median {median:.2e} mean {statistics.mean(diffs):.2e} "
          f"max {max(diffs):.3f} over {len(diffs)} tokens")
    assert median <= MEDIAN_DECODE_PREFILL
    # what ran: every layer type's FlashMLA decode list, the prefill kernel, both compressor ratios, mHC
    assert calls.extra_topk_widths == {None, 512, 128}, calls.extra_topk_widths  # SWA-only, C4, C128
    assert calls.count["flash_mla_sparse_fwd"] > 0
    assert calls.compress_ratios == {4, 128} and calls.count["cutedsl_compressor"] > 0
    for op in ("mhc_pre_broadcast_tilelang", "mhc_fused_post_pre_tilelang", "mhc_post_tilelang",
               "hc_head_fused_kernel_tilelang"):
        assert calls.count[op] > 0, op


@pytest.mark.extended
@pytest.mark.parametrize("plant", [_drop_own_window_row, _drop_newest_entry], ids=lambda p: p.__name__)
def test_planted_decode_list_bugs_break_decode_vs_prefill(flat_model, plant):
    import nvidia_harness as H

    with H.nvidia_engine(flat_model) as llm:
        with H.planted("vllm.models.deepseek_v4.nvidia.flashmla", "flash_mla_with_kvcache", plant):
            _, bad = H.decode_vs_prefill(llm, _prompts(), MAX_TOKENS)
    print(f"negative control {plant.__name__}: median {statistics.median(bad):.2e}")
    assert statistics.median(bad) > 2.5 * MEDIAN_DECODE_PREFILL
