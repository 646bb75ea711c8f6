"""Tree-masked attention on vLLM's CPU backend (an override of CPU_ATTN), one pass per layer.

vLLM's CPU kernel knows causal, sliding-window and per-sequence causal masks,
not tree masks. In a tree step the override calls vLLM's kernel once for every
row of the step. Ordinary rows (prefill, plain decode) and chain-shaped trees
(whose causal mask is their tree mask) go through that call unchanged: a chain
costs what linear speculation costs. The root and nodes of each branching tree
are computed by one of two exact paths:

    kernel (default)  the C++ tree kernel (`kernels/cpu_tree_attention.cpp`) reads each
                      request's prefix blocks once for its root, nodes and query heads,
                      with the tree mask, window, softcap and sinks; in vLLM's call these
                      rows are a 1-key placeholder sequence, then overwritten
    split             vLLM's call computes the prefix part of the root and nodes (one
                      non-causal sequence over the prefix slots), and each node is merged
                      with its tree part by log-sum-exp weights, the prefix's log-sum-exp
                      recomputed on the side (`cpu_tree_split.py`). Used where the kernel
                      cannot be built (no C++ compiler: logged once at model load) or with
                      VLLM_TREE_SPEC_CPU_TREE_KERNEL=0

Positions are depth-based, so a sliding window is measured in positions; on the split
path the prefix part is then computed over the window only. Softcap and
attention sinks follow the kernel's math; ALiBi and quantised KV caches are
refused at model load (`tree_check`), a cache layout the plugin cannot read once
the cache exists (`tree_check_cache`: vec, vec16 and, for bf16 on AMX CPUs, amx
are read; the kernel call's metadata is the same for every ISA: vLLM picks amx
only for block sizes and head sizes that are multiples of 32, which its amx
kernel needs).

The split metadata and node indices are built once per step and shared by
every layer of the KV-cache group. It is registered in the worker process by
`TreeCPUWorker` (the only place where tree speculation is active), through
vLLM's documented backend registry.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_tree_spec.integration import cpu_tree_split as split
from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeStep
from vllm_tree_spec.kernels import cpu_tree_attention_launch as tree_kernel

KERNEL_ENV = "VLLM_TREE_SPEC_CPU_TREE_KERNEL"  # "0": the split path even where the kernel builds


def _kernel_switched_off() -> bool:
    return os.environ.get(KERNEL_ENV, "1") == "0"


def use_tree_kernel() -> bool:
    """Whether branching trees go through the C++ tree kernel (built once per machine, cached)."""
    return not _kernel_switched_off() and tree_kernel.available()[0]


@functools.cache
def prepare_tree_kernel() -> bool:
    """Build the kernel at model load (not in the first tree step) and say which path serves."""
    from vllm.logger import init_logger

    log = init_logger(__name__)
    if _kernel_switched_off():
        log.info("tree attention on CPU: split path (%s=0)", KERNEL_ENV)
        return False
    ok, why = tree_kernel.available()
    if ok:
        log.info("tree attention on CPU: C++ tree kernel (ready in %.1f s)", tree_kernel.load())
    else:
        log.warning("tree attention on CPU: split path, slower for branching trees (exact either way): %s", why)
    return ok


@dataclass
class _Plan:
    """Everything a layer needs for one step (one KV-cache group, one window setting)."""

    kernel: split.KernelSplit
    scheduler_metadata: torch.Tensor
    merged: TreeStep  # the branching trees (chains need no merge)
    nodes: split.NodeRows | None  # their nodes (split path; None: nothing to merge)
    blocks: split.PrefixBlocks | None  # their prefix blocks, windowed layers only (split path)
    tree_reqs: tree_kernel.TreeRequests | None = None  # the tree kernel's request tensors (kernel path)


def _kernel_requests(step: TreeStep, block_table: torch.Tensor, block_size: int, num_kv_heads: int,
                     queries_per_kv: int) -> tree_kernel.TreeRequests:
    """Request tensors of `cpu_tree_attention` for the branching trees of a step."""
    reqs = step.requests
    anc, depth = split.tree_masks(step)
    return tree_kernel.tree_requests(
        root_row=torch.tensor([r.root_row for r in reqs], dtype=torch.long),
        root_pos=torch.tensor([r.root_pos for r in reqs], dtype=torch.long),
        num_nodes=torch.tensor([r.num_nodes for r in reqs], dtype=torch.long),
        block_table=block_table[torch.tensor([r.req_index for r in reqs], dtype=torch.long)],
        anc=anc, depth=depth, block_size=block_size, num_kv_heads=num_kv_heads, queries_per_kv=queries_per_kv)


def _plan(step: TreeStep, attn_metadata, block_size: int, window: int, num_heads: int, num_kv_heads: int,
          head_size: int, dtype: torch.dtype, isa: str, kv_cache_dtype: str) -> _Plan:
    cache = step.__dict__.setdefault("_cpu_attn_plans", {})
    bt = attn_metadata.block_table
    key = (bt.data_ptr(), block_size, window, num_heads)
    if key in cache:
        return cache[key]
    causal = attn_metadata.dynamic_causal if attn_metadata.dynamic_causal is not None else attn_metadata.causal
    external = use_tree_kernel()
    ks = split.kernel_split(step, attn_metadata.query_start_loc, attn_metadata.seq_lens, bt, causal,
                            windowed=window > 0, external=external)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=ks.seq_lens.shape[0], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=ks.seq_lens, dtype=dtype, query_start_loc=ks.query_start_loc, causal=False,
        sliding_window_size=window if window > 0 else -1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=ks.causal, kv_cache_dtype=kv_cache_dtype)
    merged = split.branching(step)
    if external:
        reqs = _kernel_requests(merged, bt, block_size, num_kv_heads, num_heads // num_kv_heads) if merged else None
        plan = _Plan(ks, sched, merged, None, None, reqs)
    else:
        nodes = split.node_rows(merged, bt, block_size) if merged else None
        blocks = split.prefix_blocks(merged, bt, block_size, window) if merged and window > 0 else None
        plan = _Plan(ks, sched, merged, nodes, blocks)
    cache[key] = plan
    return plan


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    tree_aware = True  # asserted at model load; each tree step also checks that every layer marked itself
    tree_kv_layout = "cpu_attn"  # how commit.py moves rows of this cache

    def tree_check(self) -> None:
        """Refuse, at model load, what the tree path cannot compute exactly."""
        from vllm_tree_spec.config import TreeSpecError

        if self.alibi_slopes is not None:
            raise TreeSpecError("tree speculation does not support ALiBi attention on CPU")
        if self.is_fp8_kv_cache:
            raise TreeSpecError(f"tree attention on CPU reads unquantised KV caches only; drop --kv-cache-dtype "
                                f"{self.kv_cache_dtype}")
        prepare_tree_kernel()

    def tree_check_cache(self, layer, kv_cache: torch.Tensor) -> None:
        """Refuse, once the KV cache exists (vLLM's metadata builder has set `layer.isa`), a cache layout
        the tree path cannot read: `kv_layout.self_test` against vLLM's own cache op (amx: on this CPU)."""
        kv_layout.self_test(layer.isa, kv_cache.dtype, self.head_size, kv_cache.shape[2], self.num_kv_heads)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        step: TreeStep | None = getattr(attn_metadata, "tree_step", None)
        if attn_metadata is None or not step:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tree speculation does not support fused output quantisation")
        if self.alibi_slopes is not None:
            raise NotImplementedError("tree speculation does not support ALiBi attention on CPU")
        kv_layout.self_test(layer.isa, kv_cache.dtype, self.head_size, kv_cache.shape[2], self.num_kv_heads)
        if step.all_chains:
            # A chain's tree mask is the causal mask and its positions are linear: vLLM's own call on vLLM's
            # own metadata is exact (the split plan would rebuild the same sequences), so it is used as is.
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        else:
            self._tree_forward(layer, step, query, kv_cache, attn_metadata, output)
        step.mark_applied(getattr(layer, "layer_name", None))  # counted by the runner after the forward
        return output

    def _tree_window(self) -> int:
        return self.sliding_window if self.sliding_window is not None and self.sliding_window > 0 else 0

    def _tree_forward(self, layer, step: TreeStep, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata,
                      output: torch.Tensor) -> None:
        """vLLM's kernel for every row that is not a branching tree's (skipped when there is none), then the
        tree kernel for the branching trees' rows; on the split path, vLLM's kernel with those requests split
        into prefix-only rows, then the node merge."""
        window = self._tree_window()
        plan = _plan(step, attn_metadata, kv_cache.shape[2], window, self.num_heads, self.num_kv_heads,
                     self.head_size, query.dtype, layer.isa, self.kv_cache_dtype)
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)  # as the stock forward does
        ks = plan.kernel
        if not ks.placeholders_only:  # (a step of branching trees only: the tree kernel writes every row)
            t = attn_metadata.num_actual_tokens
            nb, hkv, bs, _ = kv_cache.shape
            key_cache, value_cache = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=query[:t], key_cache=key_cache, value_cache=value_cache, output=output[:t],
                query_start_loc=ks.query_start_loc, seq_lens=ks.seq_lens, scale=self.scale, causal=False,
                alibi_slopes=None, sliding_window=self.sliding_window, block_table=ks.block_table,
                softcap=self.logits_soft_cap, scheduler_metadata=plan.scheduler_metadata, s_aux=self.sinks,
                dynamic_causal=ks.causal, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype)
        if plan.tree_reqs is not None:  # the branching trees' root and node rows, in one pass
            # (whole tensors: the kernel touches the tree rows only, which are all below t)
            tree_kernel.cpu_tree_attention_step(query, kv_cache, output, plan.tree_reqs, layer.isa, self.scale,
                                                self.logits_soft_cap or 0.0, window, self._tree_sinks())
        elif plan.merged:
            self._tree_merge(plan, query, kv_cache, attn_metadata.block_table, output, window, layer.isa)

    def _tree_sinks(self) -> torch.Tensor | None:
        if self.sinks is None:
            return None
        cached = getattr(self, "_tree_sinks_f32", None)
        if cached is None or cached[0] is not self.sinks:
            cached = (self.sinks, self.sinks.float().contiguous())
            self._tree_sinks_f32 = cached
        return cached[1]

    def _tree_merge(self, plan: _Plan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    output: torch.Tensor, window: int, isa: str) -> None:
        """Overwrite every branching tree's node rows with prefix part (+) tree part."""
        nodes = plan.nodes
        hkv, g, d = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        B, n = nodes.rows.shape
        q = query.view(query.shape[0], hkv, g, d)[nodes.rows].float()  # [B, n, Hkv, G, D]
        kw = dict(isa=isa, scale=self.scale, softcap=self.logits_soft_cap, window=window)
        if window > 0:  # the prefix part over the window, here
            lse_p, o_p = split.prefix_part(q, kv_cache, d, plan.blocks, nodes, values=True, **kw)
        else:  # the kernel's prefix output, with its log-sum-exp from the side
            lse_p = split.prefix_lse(q, kv_cache, d, plan.merged, block_table, isa=isa, scale=self.scale,
                                     softcap=self.logits_soft_cap)
            o_p = output.view(output.shape[0], hkv, g, d)[nodes.rows].float()
        lse_t, o_t = split.tree_part(q, kv_cache, d, nodes, **kw)
        res = split.merge(o_p, lse_p, o_t, lse_t, self.sinks, kernel_prefix=window == 0)  # [B, n, Hkv, G, D]
        out = output.view(output.shape[0], hkv * g * d)
        out[nodes.rows[nodes.valid]] = res[nodes.valid].reshape(-1, hkv * g * d).to(out.dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl
