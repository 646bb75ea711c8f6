"""Tree-masked attention on vLLM's CPU backend (an override of CPU_ATTN).

vLLM's CPU kernel knows causal, sliding-window and per-sequence causal masks,
not tree masks. The override runs the stock kernel for every row (exact for
prefill rows and tree roots, whose visible set is the plain causal prefix) and
then recomputes each draft node's row with an explicit mask over the request's
keys gathered from the paged cache: the committed prefix, the root, and the
node's ancestors-or-self. Positions are depth-based, so a sliding window is
measured in positions. Softcap and attention sinks follow the kernel's math;
ALiBi is refused (it would need per-key distances by position).

It is registered in the worker process by `TreeCPUWorker` (the only place
where tree speculation is active), through vLLM's documented backend
registry. The gather is O(context) per layer and request: fine for CPU
serving of small models; GPUs use the Triton tree-attention kernel.
"""

from __future__ import annotations

import math

import torch

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    tree_aware = True  # asserted by the runner: a missing override must never fall back silently

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        step: TreeStep | None = getattr(attn_metadata, "tree_step", None)
        if attn_metadata is None or not step:
            return output
        if self.alibi_slopes is not None:
            raise NotImplementedError("tree speculation does not support ALiBi attention on CPU")
        kv_layout.self_test(layer.isa, kv_cache.dtype, self.head_size, kv_cache.shape[2], self.num_kv_heads)
        out = output.view(output.shape[0], self.num_heads, self.head_size)  # [T, H, D]
        q = query.view(query.shape[0], self.num_heads, self.head_size)  # [T, H, D]
        for req in step.requests:
            self._tree_rows(req, q, kv_cache, attn_metadata.block_table[req.req_index], out)
        return output

    def _tree_rows(self, req: TreeRequestStep, q: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, out: torch.Tensor) -> None:
        n, seq_len = req.num_nodes, req.seq_len
        block_size = kv_cache.shape[2]
        pos = torch.arange(seq_len)
        slots = block_table[pos // block_size].to(torch.long) * block_size + pos % block_size  # [S]
        k, v = kv_layout.cpu_gather(kv_cache, slots, self.head_size)  # [S, Hkv, D] each
        rows = slice(req.root_row + 1, req.root_row + 1 + n)
        qn = q[rows].float()  # [n, H, D]
        k = k.float().repeat_interleave(self.num_queries_per_kv, dim=1)  # [S, H, D]
        v = v.float().repeat_interleave(self.num_queries_per_kv, dim=1)
        scores = torch.einsum("nhd,shd->hns", qn, k) * self.scale  # [H, n, S]
        if self.logits_soft_cap:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        mask = req.node_mask()  # [n, S]
        if self.sliding_window is not None and self.sliding_window > 0:
            kpos = req.key_positions()
            qpos = req.root_pos + req.tree.depth
            mask &= kpos[None, :] > qpos[:, None] - self.sliding_window
        scores = scores.masked_fill(~mask[None], -math.inf)
        if self.sinks is not None:
            sink = self.sinks.float().view(-1, 1, 1).expand(-1, n, 1)  # [H, n, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        res = torch.einsum("hns,shd->nhd", probs, v)  # [n, H, D]
        out[rows] = res.to(out.dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl
