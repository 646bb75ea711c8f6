"""Per-model-family tree hooks: what differs between standard attention and compressed attention.

The runner (runner.py) owns the model-independent part of a tree step: drafts,
depth positions, the per-request `TreeStep`, verification. An adapter owns
what depends on how the model stores its decode state:

    check(runner)              after model load: refuse models it cannot serve (no silent fallback)
    tree_layers(runner)        the layers that must apply the tree mask in a tree step (checked after
                               every tree step's forward: `TreeStep.check_applied`)
    prepare(runner, step)      after the step is built, before the forward (e.g. index lists, scratch)
    commit(runner, reqs, paths)  after verification: make the persistent state equal to an accepted chain;
                               adapters with `device_commit = True` get (step, verifier output on the
                               device) instead of host lists, and the runner keeps the slots on the device

`StandardAttentionAdapter` covers paged KV attention (one slot per token, the
tree mask in the attention override, commit = KV compaction). DeepSeek-V4's
compressed attention gets its own adapter (`integration/dsv4/`).
"""

from __future__ import annotations

from vllm_tree_spec.integration.commit import commit_accepted_paths


class StandardAttentionAdapter:
    name = "standard-attention"
    device_commit = True  # commit(runner, step, result): the runner keeps the step's slots on the device

    def __init__(self) -> None:
        self.layer_names: set[str] = set()

    def check(self, runner) -> None:
        from vllm.model_executor.layers.attention import Attention

        runner.tree_check_attention()
        # the target model's own layers (a drafter's layers may share the forward context, not the forward)
        self.layer_names = {m.layer_name for m in runner.get_model().modules() if isinstance(m, Attention)}
        if not self.layer_names:
            raise RuntimeError(f"{type(runner.get_model()).__name__}: no attention layers found for the tree mask")

    def tree_layers(self, runner) -> set[str]:
        return self.layer_names

    def prepare(self, runner, step) -> None:
        return None

    def commit(self, runner, reqs, paths) -> int:
        return commit_accepted_paths(runner, reqs, paths)


def select_adapter(runner):
    arch = (getattr(runner.model_config.hf_config, "architectures", None) or [""])[0]
    if "DeepseekV4" in arch:
        try:
            from vllm_tree_spec.integration.dsv4.adapter import DeepseekV4TreeAdapter
        except ImportError as e:
            raise RuntimeError(f"{arch}: the DeepSeek-V4 tree adapter is not available ({e})") from None
        return DeepseekV4TreeAdapter(runner)
    return StandardAttentionAdapter()
