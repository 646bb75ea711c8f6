"""The V2 adapter's GPU worker (vLLM 0.34): V2's GPU runner + the tree hooks, tree-aware FLASH_ATTN /
TRITON_ATTN. vLLM's GPU `Worker` builds its runner through `_make_model_runner`, a documented subclass
hook, so nothing is swapped. Selected by the config route only for tree engines on Model Runner V2."""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_tree_spec.integration.gpu_attention import TREE_GPU_BACKENDS
from vllm_tree_spec.integration.v2.runner import TreeV2RunnerMixin
from vllm_tree_spec.integration.worker_common import TreeWorkerProbes, tree_attention_backends


class TreeV2GPUModelRunner(TreeV2RunnerMixin, GPUModelRunner):
    pass


class TreeV2GPUWorker(TreeWorkerProbes, Worker):
    def _make_model_runner(self) -> TreeV2GPUModelRunner:
        return TreeV2GPUModelRunner(self.vllm_config, self.device)

    def load_model(self, *args, **kwargs):
        with tree_attention_backends(TREE_GPU_BACKENDS):
            return super().load_model(*args, **kwargs)
