"""Worker subclasses that build the tree runner and install the tree-aware attention.

The config route sets `parallel_config.worker_cls` to one of these when (and
only when) tree speculation is configured, so everything here runs in the
worker process of a tree engine and nowhere else.
"""

from __future__ import annotations

import contextlib

from vllm.v1.worker.cpu_worker import CPUWorker

TREE_CPU_WORKER = "vllm_tree_spec.integration.worker.TreeCPUWorker"


TREE_CPU_ATTN = "vllm_tree_spec.integration.cpu_attention.TreeCPUAttentionBackend"


@contextlib.contextmanager
def tree_cpu_attention():
    """Route CPU_ATTN to the tree-aware subclass while this worker builds its model (patch P2).

    Uses vLLM's documented backend registry. The selector caches backend classes
    per process, so the cache is cleared on entry (an earlier engine in the same
    process must not leak its causal backend into us) and on exit (our backend
    must not leak into a later engine without tree speculation).
    """
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    previous = _ATTN_OVERRIDES.get(AttentionBackendEnum.CPU_ATTN)
    register_backend(AttentionBackendEnum.CPU_ATTN, TREE_CPU_ATTN)
    _cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            AttentionBackendEnum.CPU_ATTN.clear_override()
        else:
            register_backend(AttentionBackendEnum.CPU_ATTN, previous)
        _cached_get_attn_backend.cache_clear()


class TreeCPUWorker(CPUWorker):
    def load_model(self, *args, **kwargs):
        with tree_cpu_attention():
            return super().load_model(*args, **kwargs)

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
