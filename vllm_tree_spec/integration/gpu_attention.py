"""Tree-masked attention on vLLM's GPU backends (overrides of TRITON_ATTN and FLASH_ATTN).

Same design as the CPU override (`cpu_attention.py`): the stock kernel runs for
every row (exact for prefill rows and tree roots, whose visible set is the
plain causal prefix), then the rows of every tree request are recomputed by
this project's Triton tree-attention kernel (`kernels/tree_attention*.py`)
straight from the paged cache, with the bit-packed ancestor mask and
depth-based positions. Both backends store the cache as
[num_blocks, Hkv, block_size, 2 * D] in vLLM 0.32's logical order; the kernel
reads the K and V halves through strided views, whatever the physical order.

The per-step metadata (rows, sub-batch block table, packed masks, depths) is
built once per step and KV-cache group (`plan_tree_rows`) and reused by every layer.
Attention must run eagerly for this (a Python step per layer), so the config
route sets CUDA graphs to PIECEWISE, where vLLM keeps attention outside the
graphs. Features the kernel does not cover (ALiBi, quantised KV caches,
chunked-local attention, head size > 256) are refused when the model is
loaded (`tree_check`), before any request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_tree_spec.integration.tree_step import TreeStep
from vllm_tree_spec.tree import TreeBatch
from vllm_tree_spec.tree_attention import tree_batch_kernel_inputs


@dataclass
class _Plan:
    """Kernel inputs for the tree requests of one step (one KV-cache group), on the device."""

    rows: torch.Tensor  # [R] flattened query row of every tree row (root + nodes per request)
    node_rows: torch.Tensor  # [T] flattened query row of every draft node
    node_local: torch.Tensor  # [T] index of each draft node within `rows`
    block_table: torch.Tensor  # [B, max_blocks] int32, the tree requests' rows
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32 over `rows`
    cu_num_nodes: torch.Tensor  # [B + 1] int32
    packed_mask: torch.Tensor  # [T, W] int32 ancestor-or-self bits, local columns
    depth: torch.Tensor  # [T] int32
    max_query_len: int
    max_seq_len: int


def plan_tree_rows(step: TreeStep, block_table: torch.Tensor) -> _Plan:
    """Build (once per step and block table) the sub-batch of tree requests the kernel verifies."""
    cache = step.__dict__.setdefault("_gpu_attn_plans", {})
    key = (block_table.data_ptr(), str(block_table.device))
    if key in cache:
        return cache[key]
    device = block_table.device
    reqs = step.requests
    rows, node_local, qsl = [], [], [0]
    for r in reqs:
        node_local.extend(range(len(rows) + 1, len(rows) + 1 + r.num_nodes))
        rows.extend(range(r.root_row, r.root_row + 1 + r.num_nodes))
        qsl.append(len(rows))
    tree_inputs = tree_batch_kernel_inputs(TreeBatch.from_trees([r.tree for r in reqs]), device)

    def dev(x, dtype):
        return torch.as_tensor(x, dtype=dtype).to(device, non_blocking=True)

    rows_t = dev(rows, torch.long)
    node_local_t = dev(node_local, torch.long)
    plan = _Plan(
        rows=rows_t,
        node_rows=rows_t[node_local_t],
        node_local=node_local_t,
        block_table=block_table[dev([r.req_index for r in reqs], torch.long)].contiguous(),
        seq_lens=dev([r.seq_len for r in reqs], torch.int32),
        query_start_loc=dev(qsl, torch.int32),
        cu_num_nodes=tree_inputs["cu_num_nodes"],
        packed_mask=tree_inputs["packed_mask"],
        depth=tree_inputs["depth"],
        max_query_len=max((r.num_nodes + 1 for r in reqs), default=1),
        max_seq_len=max((r.seq_len for r in reqs), default=1),
    )
    cache[key] = plan
    return plan


def tree_rows_paged(
    step: TreeStep,
    query: torch.Tensor,  # [T_all, H_q * D] or [T_all, H_q, D], this step's queries (pre-roped)
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * D] (vLLM 0.32 FLASH_ATTN / TRITON_ATTN)
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32, rows in batch order
    output: torch.Tensor,  # [T_all, H_q * D] or [T_all, H_q, D], overwritten at the draft nodes' rows
    *,
    num_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "triton",
) -> None:
    """Recompute every draft node's attention output with its tree mask, in place."""
    from vllm_tree_spec.tree_attention import tree_attention

    plan = plan_tree_rows(step, block_table)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)  # [nb, bs, Hkv, D] views
    q = query.view(query.shape[0], num_heads, head_size)[plan.rows]  # [R, H, D]
    kw = dict(max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len) if backend == "triton" else {}
    res = tree_attention(
        q, key_cache, value_cache, plan.block_table, plan.seq_lens, plan.query_start_loc, plan.cu_num_nodes,
        plan.packed_mask, plan.depth, scale=scale, sliding_window=sliding_window, softcap=softcap,
        sinks=None if sinks is None else sinks.float(), backend=backend, **kw)  # [R, H, D]
    out = output.view(output.shape[0], num_heads, head_size)
    out[plan.node_rows] = res[plan.node_local].to(out.dtype)


class TreePagedAttentionMixin:
    """Mixed in front of vLLM's TritonAttentionImpl / FlashAttentionImpl."""

    tree_aware = True  # asserted at model load; each tree step also checks that every layer marked itself
    tree_kv_layout = "paged"  # how commit.py moves rows of this cache

    def tree_check(self) -> None:
        """Refuse, at model load, what the tree kernel cannot compute exactly."""
        from vllm_tree_spec.config import TreeSpecError

        name = type(self).__name__
        if self.alibi_slopes is not None:
            raise TreeSpecError(f"{name}: tree speculation does not support ALiBi attention")
        if not str(self.kv_cache_dtype).startswith("auto") and self.kv_cache_dtype not in (
                "float16", "bfloat16", "float32"):
            raise TreeSpecError(f"{name}: tree attention reads unquantised KV caches only; "
                                f"drop --kv-cache-dtype {self.kv_cache_dtype}")
        if self.head_size > 256:
            raise TreeSpecError(f"{name}: head size {self.head_size} > 256 is not supported by the tree kernel")
        if getattr(self, "chunk_lookback", -1) not in (-1, None):
            raise TreeSpecError(f"{name}: chunked-local attention is not supported with tree speculation")

    def _tree_window(self) -> int | None:
        left = self.sliding_window[0] if isinstance(self.sliding_window, tuple) else self.sliding_window
        return None if left is None or left < 0 else left + 1  # vLLM stores (W - 1, 0)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        step: TreeStep | None = getattr(attn_metadata, "tree_step", None)
        if step and output_scale is not None:
            raise NotImplementedError("tree speculation does not support fused output quantisation")
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        if attn_metadata is None or not step:
            return output
        tree_rows_paged(step, query, kv_cache, attn_metadata.block_table, output, num_heads=self.num_heads,
                        head_size=self.head_size, scale=self.scale, sliding_window=self._tree_window(),
                        softcap=self.logits_soft_cap or None, sinks=self.sinks)
        step.mark_applied(getattr(layer, "layer_name", None))  # counted by the runner after the forward
        return output


# vLLM's GPU backends import on the CPU build too (tests run this module under TRITON_INTERPRET=1).
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl  # noqa: E402


class TreeTritonAttentionImpl(TreePagedAttentionMixin, TritonAttentionImpl):
    pass


class TreeFlashAttentionImpl(TreePagedAttentionMixin, FlashAttentionImpl):
    pass


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeTritonAttentionImpl]:
        return TreeTritonAttentionImpl


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeFlashAttentionImpl]:
        return TreeFlashAttentionImpl


TREE_GPU_BACKENDS = {  # AttentionBackendEnum member name -> our class path (patch record P2)
    "TRITON_ATTN": "vllm_tree_spec.integration.gpu_attention.TreeTritonAttentionBackend",
    "FLASH_ATTN": "vllm_tree_spec.integration.gpu_attention.TreeFlashAttentionBackend",
}
