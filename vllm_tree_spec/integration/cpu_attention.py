"""Tree-masked attention on vLLM's CPU backend (an override of CPU_ATTN).

vLLM's CPU kernel knows causal, sliding-window and per-sequence causal masks,
not tree masks. The override runs the stock kernel for every row (exact for
prefill rows and tree roots, whose visible set is the plain causal prefix) and
then recomputes every draft node's row with an explicit mask over its
request's keys gathered from the paged cache: the committed prefix, the root,
and the node's ancestors-or-self. Positions are depth-based, so a sliding
window is measured in positions. Softcap and attention sinks follow the
kernel's math; ALiBi is refused.

All tree requests of a layer are handled in one padded batch; the gather
indices and masks are built once per step (`_plan`) and shared by every layer
of the KV-cache group. It is registered in the worker process by
`TreeCPUWorker` (the only place where tree speculation is active), through
vLLM's documented backend registry. The gather is O(context) per layer: fine
for CPU serving of small models; GPUs use the Triton tree-attention kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeStep


@dataclass
class _Plan:
    """Gather indices and masks for all tree requests of one step (one KV-cache group)."""

    slots: torch.Tensor  # [B, S] cache slot of every key (padding: slot 0, masked)
    rows: torch.Tensor  # [B, n] flattened query row of every draft node (padding: row 0)
    row_valid: torch.Tensor  # [B, n] bool
    mask: torch.Tensor  # [B, n, S] bool: node may attend to key


def _plan(step: TreeStep, block_table: torch.Tensor, block_size: int, window: int) -> _Plan:
    cache = step.__dict__.setdefault("_cpu_attn_plans", {})
    key = (block_table.data_ptr(), block_size, window)
    if key in cache:
        return cache[key]
    reqs = step.requests
    B = len(reqs)
    S = max(r.seq_len for r in reqs)
    n = max(r.num_nodes for r in reqs)
    slots = torch.zeros(B, S, dtype=torch.long)
    rows = torch.zeros(B, n, dtype=torch.long)
    row_valid = torch.zeros(B, n, dtype=torch.bool)
    mask = torch.zeros(B, n, S, dtype=torch.bool)
    for b, r in enumerate(reqs):
        pos = torch.arange(r.seq_len)
        slots[b, : r.seq_len] = block_table[r.req_index, pos // block_size].to(torch.long) * block_size + \
            pos % block_size
        rows[b, : r.num_nodes] = torch.arange(r.root_row + 1, r.root_row + 1 + r.num_nodes)
        row_valid[b, : r.num_nodes] = True
        m = r.node_mask()  # [n_b, S_b]
        if window > 0:
            kpos = r.key_positions()
            qpos = r.root_pos + r.tree.depth
            m &= kpos[None, :] > qpos[:, None] - window
        mask[b, : r.num_nodes, : r.seq_len] = m
    cache[key] = _Plan(slots, rows, row_valid, mask)
    return cache[key]


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    tree_aware = True  # asserted at model load; each tree step also checks that every layer marked itself
    tree_kv_layout = "cpu_attn"  # how commit.py moves rows of this cache

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
        self._tree_rows(step, query, kv_cache, attn_metadata.block_table, output)
        step.mark_applied(getattr(layer, "layer_name", None))  # counted by the runner after the forward
        return output

    def _tree_rows(self, step: TreeStep, query: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, output: torch.Tensor) -> None:
        """Recompute every draft node's output row with its tree mask (all tree requests at once)."""
        window = self.sliding_window if self.sliding_window is not None and self.sliding_window > 0 else 0
        plan = _plan(step, block_table, kv_cache.shape[2], window)
        B, S = plan.slots.shape
        n = plan.rows.shape[1]
        hkv, g, d = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        k, v = kv_layout.cpu_gather(kv_cache, plan.slots.flatten(), d)  # [B * S, Hkv, D] each
        out = output.view(output.shape[0], hkv * g * d)
        valid = plan.row_valid.flatten()
        if self.sinks is None and not self.logits_soft_cap:
            # fused SDPA with a boolean mask; GQA without materialising repeated K/V
            qs = query.view(query.shape[0], hkv * g, d)[plan.rows].transpose(1, 2)  # [B, H, n, D]
            ks = k.view(B, S, hkv, d).transpose(1, 2).to(qs.dtype)  # [B, Hkv, S, D]
            vs = v.view(B, S, hkv, d).transpose(1, 2).to(qs.dtype)
            res = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=plan.mask[:, None], scale=self.scale, enable_gqa=g > 1)  # [B, H, n, D]
            out[plan.rows.flatten()[valid]] = res.transpose(1, 2).reshape(B * n, -1)[valid].to(out.dtype)
            return
        k = k.view(B, S, hkv, d).float()
        v = v.view(B, S, hkv, d).float()
        q = query.view(query.shape[0], hkv, g, d)[plan.rows].float()  # [B, n, Hkv, G, D]
        scores = torch.einsum("bnkgd,bskd->bkgns", q, k) * self.scale  # [B, Hkv, G, n, S]
        if self.logits_soft_cap:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        scores = scores.masked_fill(~plan.mask[:, None, None], -math.inf)
        if self.sinks is not None:
            sink = self.sinks.float().view(1, hkv, g, 1, 1).expand(B, hkv, g, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        res = torch.einsum("bkgns,bskd->bnkgd", probs, v)  # [B, n, Hkv, G, D]
        out[plan.rows.flatten()[valid]] = res.reshape(B * n, hkv * g * d)[valid].to(out.dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl
