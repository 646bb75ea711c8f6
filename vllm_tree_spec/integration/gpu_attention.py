"""Tree-masked attention on vLLM's GPU backends (overrides of TRITON_ATTN and FLASH_ATTN), one pass per layer.

In a step with trees the stock kernel does not run: this project's Triton
tree-attention kernel (`kernels/tree_attention*.py`) computes every row of the
step in one launch, straight from the paged cache. Requests without a tree are
trees with no nodes (their rows are plain causal rows: prefill chunks, decode),
tree requests get the bit-packed ancestor mask and depth-based positions, so
each row's attention is computed once. Steps without trees run the stock
kernel unchanged. Both backends store the cache as
[num_blocks, Hkv, block_size, 2 * D] in vLLM 0.32's logical order; the kernel
reads the K and V halves through strided views, whatever the physical order.

The per-step metadata (node counts per request, packed masks, depths) is built
once per step on the host and copied without waiting (`plan_step`); the row
offsets, sequence lengths and block table are vLLM's own metadata tensors, and
the launch takes vLLM's host-side max lengths, so the path has no device->host
sync. Attention must run eagerly for this (a Python step per layer), so the
config route sets CUDA graphs to PIECEWISE, where vLLM keeps attention outside
the graphs. Features the kernel does not cover (ALiBi, quantised KV caches,
chunked-local attention, head size > 256) are refused when the model is loaded
(`tree_check`), before any request; per-step features it does not model
(non-causal or multimodal-prefix metadata, decode context parallelism) raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_tree_spec.integration.tree_step import TreeStep
from vllm_tree_spec.tree import NO_PARENT, Tree, TreeBatch


@dataclass
class _Plan:
    """The tree side of the kernel inputs for one step, on the device (all requests of the batch)."""

    cu_num_nodes: torch.Tensor  # [R + 1] int32 draft-node offsets (0 nodes for requests without a tree)
    packed_mask: torch.Tensor  # [T, W] int32 ancestor-or-self bits, local columns, batch order
    depth: torch.Tensor  # [T] int32


def plan_step(step: TreeStep, num_reqs: int, device: torch.device | str) -> _Plan:
    """Build (once per step and device) the node layout of the whole batch: host work, non-blocking copies."""
    cache = step.__dict__.setdefault("_gpu_attn_plans", {})
    key = (num_reqs, str(device))
    if key in cache:
        return cache[key]
    reqs = sorted(step.requests, key=lambda r: r.req_index)
    counts = torch.zeros(num_reqs + 1, dtype=torch.int32)
    for r in reqs:
        if r.req_index >= num_reqs:
            raise RuntimeError(f"tree request {r.req_id} at batch row {r.req_index} is outside the {num_reqs} "
                               f"requests of the attention metadata")
        counts[r.req_index + 1] = r.num_nodes + r.num_pads
    batch = TreeBatch.from_trees([_with_pads(r.tree, r.num_pads) for r in reqs])

    def dev(x):
        return x.to(dtype=torch.int32).pin_memory().to(device, non_blocking=True) if torch.device(device).type == \
            "cuda" else x.to(device=device, dtype=torch.int32)

    plan = _Plan(cu_num_nodes=dev(counts.cumsum(0)), packed_mask=dev(batch.packed_mask).contiguous(),
                 depth=dev(batch.depth))
    cache[key] = plan
    return plan


def _with_pads(tree: Tree, num_pads: int) -> Tree:
    """The kernel reads a request's last N query rows as its draft nodes: Model Runner V2's pad rows (after
    the nodes) join as leaves under the root that see only the prefix, the root and themselves (their output
    is never read; one launch computes them with the rest)."""
    if not num_pads:
        return tree
    return Tree(torch.cat([tree.parents, torch.full((num_pads,), NO_PARENT)]),
                torch.cat([tree.tokens, torch.zeros(num_pads, dtype=torch.long)]))


def attention_paged(
    step: TreeStep,
    query: torch.Tensor,  # [T, H_q * D] or [T, H_q, D], this step's queries (pre-roped), T >= num_tokens
    kv_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, 2 * D] (vLLM 0.32 FLASH_ATTN / TRITON_ATTN)
    attn_metadata,  # vLLM's metadata: query_start_loc [R + 1], seq_lens [R], block_table [R, max_blocks] int32,
    #                 num_actual_tokens, max_query_len, max_seq_len (host ints)
    output: torch.Tensor,  # [T, H_q * D] or [T, H_q, D], written for the first num_actual_tokens rows
    *,
    num_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "triton",
) -> None:
    """Every row of a step with trees: tree rows with their masks, all other rows causal, in one launch."""
    from vllm_tree_spec.tree_attention import tree_attention

    md = attn_metadata
    causal = getattr(md, "causal", True)
    if isinstance(causal, torch.Tensor) or not causal:  # per-request flags or bidirectional attention
        raise NotImplementedError("tree speculation supports causal decoder attention only (metadata is non-causal)")
    for field in ("mm_prefix_range_tensor", "dcp_context_kv_lens", "rswa_prefix_lens"):
        if getattr(md, field, None) is not None:
            raise NotImplementedError(f"tree speculation does not support attention metadata with {field} "
                                      f"(multimodal bidirectional prefixes, decode context parallelism, RSWA)")
    n = md.num_actual_tokens
    num_reqs = md.seq_lens.shape[0]
    plan = plan_step(step, num_reqs, query.device)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)  # [nb, bs, Hkv, D] views
    q = query[:n].view(n, num_heads, head_size)
    out = output[:n].view(n, num_heads, head_size)
    kw = dict(max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, out=out) if backend == "triton" else {}
    res = tree_attention(
        q, key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc, plan.cu_num_nodes,
        plan.packed_mask, plan.depth, scale=scale, sliding_window=sliding_window, softcap=softcap,
        sinks=None if sinks is None else sinks.float(), backend=backend, **kw)  # [n, H, D]
    if res is not out:
        out.copy_(res)


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
        if attn_metadata is None or not step:  # no tree this step: the stock kernel
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tree speculation does not support fused output quantisation")
        if step.all_chains:  # causal mask = tree mask, linear positions: vLLM's kernel is exact (host flag, no sync)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        else:
            attention_paged(step, query, kv_cache, attn_metadata, output, num_heads=self.num_heads,
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
