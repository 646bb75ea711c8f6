"""Worker subclasses that build the tree runner and install the tree-aware attention.

The config route sets `parallel_config.worker_cls` to one of these when (and
only when) tree speculation is configured, so everything here runs in the
worker process of a tree engine and nowhere else.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

TREE_CPU_WORKER = "vllm_tree_spec.integration.worker.TreeCPUWorker"


def install_cpu_attention_override() -> None:
    """Route CPU_ATTN to the tree-aware subclass (vLLM's documented backend registry)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "vllm_tree_spec.integration.cpu_attention.TreeCPUAttentionBackend")


class TreeCPUWorker(CPUWorker):
    def __init__(self, *args, **kwargs):
        # Register before the model (and its attention layers) is built in this process.
        install_cpu_attention_override()
        super().__init__(*args, **kwargs)

    def init_device(self):
        # CPUWorker.init_device builds `CPUModelRunner` by its module-global name;
        # swap in the tree runner for that one call (patch record P3).
        import vllm.v1.worker.cpu_worker as cpu_worker_mod

        from vllm_tree_spec.integration.runner import TreeCPUModelRunner

        original = cpu_worker_mod.CPUModelRunner
        cpu_worker_mod.CPUModelRunner = TreeCPUModelRunner
        try:
            super().init_device()
        finally:
            cpu_worker_mod.CPUModelRunner = original
        assert isinstance(self.model_runner, TreeCPUModelRunner), (
            "tree speculation needs the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
