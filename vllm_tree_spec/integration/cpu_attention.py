"""Tree-masked attention on vLLM's CPU backend (an override of CPU_ATTN).

vLLM's CPU kernel knows causal, sliding-window and per-sequence causal masks,
not tree masks. In a tree step the override calls vLLM's kernel once for every
ordinary row (prefill, plain decode) and every chain-shaped tree (whose causal
mask is its tree mask): a chain costs what linear speculation costs. The root
and nodes of each branching tree are computed by one of three paths, chosen with
VLLM_TREE_SPEC_CPU_TREE_ATTENTION:

    decode (default)  vLLM's own kernel decodes every path: each branching tree is cut into
                      chains, and each chain is one causal sequence over prefix + path, the path's
                      K/V written over the request's draft slots for its wave and restored after
                      (`cpu_tree_decode.py`). Bit-identical to decoding without speculation on
                      every ISA (vec, vec16, amx) and dtype; each chain re-reads its prefix
    kernel            the C++ tree kernel (`kernels/cpu_tree_attention.cpp`) reads each request's
                      prefix blocks once for its root, nodes and query heads, with the tree mask,
                      window, softcap and sinks; exact attention, but rounded in its own order (one
                      ulp from vLLM's kernel in many elements), so greedy output can differ from no
                      speculation at near-ties. Falls back to `split` where it cannot be built
    split             vLLM's call computes the prefix part of the root and nodes (one non-causal
                      sequence over the prefix slots), and each node is merged with its tree part by
                      log-sum-exp weights (`cpu_tree_split.py`); rounded like `kernel`

Positions are depth-based, so a sliding window is measured in positions (on the
decode path every chain sequence has its true positions, so vLLM's window applies as
in a decode step). ALiBi and quantised KV caches are refused at model load
(`tree_check`), a cache layout the plugin cannot read once the cache exists
(`tree_check_cache`: vec, vec16 and, for bf16 on AMX CPUs, amx are read).

The plan of a step is built once per KV-cache group and shared by every layer. It is
registered in the worker process by `TreeCPUWorker` (the only place where tree
speculation is active), through vLLM's documented backend registry.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_tree_spec.integration import cpu_tree_decode as decode
from vllm_tree_spec.integration import cpu_tree_split as split
from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeStep
from vllm_tree_spec.kernels import cpu_tree_attention_launch as tree_kernel

MODE_ENV = "VLLM_TREE_SPEC_CPU_TREE_ATTENTION"  # decode (default) | kernel | split
MODES = ("decode", "kernel", "split")


def tree_attention_mode() -> str:
    """How branching trees' rows are computed (module docstring); `kernel` becomes `split` where the C++
    kernel cannot be built."""
    mode = os.environ.get(MODE_ENV, "decode").strip().lower() or "decode"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: choose one of {', '.join(MODES)} (default decode: bit-identical "
                         f"to decoding without speculation)")
    if mode == "kernel" and not tree_kernel.available()[0]:
        return "split"
    return mode


@functools.cache
def prepare_tree_attention() -> str:
    """Choose the path at model load (and build the kernel there, not in the first tree step); log it once."""
    from vllm.logger import init_logger

    log = init_logger(__name__)
    mode = tree_attention_mode()
    if mode == "decode":
        log.info("tree attention on CPU: vLLM's kernel decodes every tree path (bit-identical to decoding)")
    elif mode == "kernel":
        log.info("tree attention on CPU: C++ tree kernel (ready in %.1f s; %s=kernel)", tree_kernel.load(), MODE_ENV)
    elif os.environ.get(MODE_ENV, "").strip().lower() == "kernel":
        log.warning("tree attention on CPU: split path, the C++ tree kernel cannot be built: %s",
                    tree_kernel.available()[1])
    else:
        log.info("tree attention on CPU: split path (%s=split)", MODE_ENV)
    return mode


@dataclass
class _Plan:
    """Everything a layer needs for one step (one KV-cache group, one window setting)."""

    kernel: split.KernelSplit
    scheduler_metadata: torch.Tensor
    merged: TreeStep  # the branching trees (chains need no merge)
    nodes: split.NodeRows | None  # their nodes (split path; None: nothing to merge)
    blocks: split.PrefixBlocks | None  # their prefix blocks, windowed layers only (split path)
    tree_reqs: tree_kernel.TreeRequests | None = None  # the tree kernel's request tensors (kernel path)
    paths: decode.PathPlan | None = None  # the chain sequences, in waves (decode path)
    wave_metadata: list[torch.Tensor] | None = None  # vLLM's scheduler metadata of each wave


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


def _kernel_blocks(scratch: range, num_kernel_blocks: int) -> range:
    """The scratch blocks (block-manager ids: the last ones of the cache) as the kernel's block ids (vLLM may
    split a manager block into `ratio` kernel blocks)."""
    if not scratch:
        return scratch
    ratio = num_kernel_blocks // scratch.stop
    return range(scratch.start * ratio, scratch.stop * ratio)


def _plan(step: TreeStep, attn_metadata, block_size: int, window: int, num_heads: int, num_kv_heads: int,
          head_size: int, dtype: torch.dtype, isa: str, kv_cache_dtype: str, num_kernel_blocks: int) -> _Plan:
    cache = step.__dict__.setdefault("_cpu_attn_plans", {})
    bt = attn_metadata.block_table
    key = (bt.data_ptr(), block_size, window, num_heads)
    if key in cache:
        return cache[key]
    causal = attn_metadata.dynamic_causal if attn_metadata.dynamic_causal is not None else attn_metadata.causal
    mode = tree_attention_mode()
    ks = split.kernel_split(step, attn_metadata.query_start_loc, attn_metadata.seq_lens, bt, causal,
                            windowed=window > 0, external=mode != "split")

    def scheduler_metadata(seq_lens, query_start_loc, dynamic_causal, is_causal=False):
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=is_causal,
            sliding_window_size=window if window > 0 else -1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=dynamic_causal, kv_cache_dtype=kv_cache_dtype)

    sched = scheduler_metadata(ks.seq_lens, ks.query_start_loc, ks.causal)
    merged = split.branching(step)
    if mode == "decode":
        paths = decode.plan_paths(merged, bt, block_size, isa=isa, num_kv_heads=num_kv_heads, head_dim=head_size,
                                  itemsize=torch.empty((), dtype=dtype).element_size(),
                                  scratch=_kernel_blocks(step.scratch_blocks, num_kernel_blocks)) if merged else None
        plan = _Plan(ks, sched, merged, None, None, paths=paths, wave_metadata=[
            scheduler_metadata(w.seq_lens, w.query_start_loc, None, True) for w in paths.waves] if paths else None)
    elif mode == "kernel":
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
        prepare_tree_attention()

    @property
    def tree_needs_scratch(self) -> bool:
        """The decode path reads chains through scratch blocks reserved at KV-cache allocation (kv_scratch.py)."""
        return tree_attention_mode() == "decode"

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
                     self.head_size, query.dtype, layer.isa, self.kv_cache_dtype, kv_cache.shape[0])
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
        if plan.paths is not None:  # the branching trees' rows, as vLLM's decode of each chain
            self._tree_decode(layer, plan.paths, plan.wave_metadata, query, kv_cache, output)
        elif plan.tree_reqs is not None:  # the branching trees' root and node rows, in one pass
            # (whole tensors: the kernel touches the tree rows only, which are all below t)
            tree_kernel.cpu_tree_attention_step(query, kv_cache, output, plan.tree_reqs, layer.isa, self.scale,
                                                self.logits_soft_cap or 0.0, window, self._tree_sinks())
        elif plan.merged:
            self._tree_merge(plan, query, kv_cache, attn_metadata.block_table, output, window, layer.isa)

    def _tree_decode(self, layer, paths: decode.PathPlan, wave_metadata: list[torch.Tensor], query: torch.Tensor,
                     kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """vLLM's causal call over each wave of chain sequences (cpu_tree_decode.py)."""
        nb, hkv, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
        sched = {id(w): m for w, m in zip(paths.waves, wave_metadata)}

        def attend(q: torch.Tensor, out: torch.Tensor, wave: decode.PathWave) -> None:
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=wave.query_start_loc, seq_lens=wave.seq_lens, scale=self.scale, causal=True,
                alibi_slopes=None, sliding_window=self.sliding_window, block_table=wave.block_table,
                softcap=self.logits_soft_cap, scheduler_metadata=sched[id(wave)], s_aux=self.sinks,
                dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype)

        paths.run(query, kv_cache, output, attend)

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
