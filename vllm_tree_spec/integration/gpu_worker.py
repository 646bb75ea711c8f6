"""The V1 adapter's GPU worker: V1 GPU runner + tree hooks, tree-aware FLASH_ATTN / TRITON_ATTN.

Selected by the config route on CUDA platforms (never imported on CPU). vLLM's
GPU `Worker` builds its runner through `_make_model_runner`, a documented
subclass hook, so no module global is swapped here (compare patch P3 on CPU).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_tree_spec.config import TreeSpecError
from vllm_tree_spec.integration.gpu_attention import TREE_GPU_BACKENDS
from vllm_tree_spec.integration.runner import TreeRunnerMixin
from vllm_tree_spec.integration.worker_common import TreeWorkerProbes, tree_attention_backends


class TreeGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
    pass


class TreeGPUWorker(TreeWorkerProbes, Worker):
    def _make_model_runner(self) -> TreeGPUModelRunner:
        if self.use_v2_model_runner:
            raise TreeSpecError("tree speculation runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER "
                                "(or set it to 0)")
        return TreeGPUModelRunner(self.vllm_config, self.device)

    def load_model(self, *args, **kwargs):
        with tree_attention_backends(TREE_GPU_BACKENDS):
            return super().load_model(*args, **kwargs)
