"""The V1 adapter's CPU worker: builds the V1 tree runner and installs the tree-aware attention.

The config route sets `parallel_config.worker_cls` to one of the tree workers when (and
only when) tree speculation is configured, so everything here runs in the
worker process of a tree engine and nowhere else. `TreeCPUWorker` is defined
here; the V1 GPU one lives in `gpu_worker.py` (it imports the CUDA worker), the V2 ones
in `v2/worker.py`; what they share (the backend registry swap, the read-only probes)
in `worker_common.py`.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_tree_spec.integration.runner import TreeRunnerMixin
from vllm_tree_spec.integration.worker_common import (TREE_CPU_BACKENDS, TreeWorkerProbes,  # noqa: F401
                                                      tree_attention_backends, tree_cpu_attention)


class TreeCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
    pass


class TreeCPUWorker(TreeWorkerProbes, CPUWorker):
    def determine_available_memory(self) -> int:
        # scratch blocks for tree paths come out of the measured KV-cache memory (kv_scratch.py, P11)
        available = super().determine_available_memory()
        reserve = getattr(self.model_runner.tree_adapter, "reserve_memory", None)
        return available if reserve is None else reserve(self.model_runner, available)

    def load_model(self, *args, **kwargs):
        with tree_cpu_attention():
            return super().load_model(*args, **kwargs)

    def init_device(self):
        # CPUWorker.init_device builds `CPUModelRunner` by its module-global name;
        # swap in the tree runner for that one call (patch record P3).
        import vllm.v1.worker.cpu_worker as cpu_worker_mod

        original = cpu_worker_mod.CPUModelRunner
        cpu_worker_mod.CPUModelRunner = TreeCPUModelRunner
        try:
            super().init_device()
        finally:
            cpu_worker_mod.CPUModelRunner = original
        assert isinstance(self.model_runner, TreeCPUModelRunner), (
            "tree speculation needs the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
