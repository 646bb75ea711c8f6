"""Overrides on vLLM 0.32's NVIDIA DeepSeek-V4 layers that apply a tree step's plan (touch points N2-N5).

Each reads the step's `GpuTreePlan` from the forward context's metadata (`md.dsv4_tree_nv`, attached by the
adapter for tree steps only) and otherwise runs vLLM's code unchanged. Per-instance bindings (never on the
classes) except N2, whose call site reads a module global.

    N2  `vllm.models.deepseek_v4.nvidia.flashmla.compute_global_topk_indices_and_lens` (module global of the
        caller): with a plan, a CSA layer's top-k local ids map to global slots along each row's ancestor path
        (`tree_topk_slots`: committed entries through the block table, entries completed inside the tree to
        the completing ancestor's scratch slot); without one, vLLM's function.
    N3  `DeepseekCompressor.forward` (main and indexer compressors, per instance): vLLM's forward first (every
        row saves its state row; draft nodes write no entry: the adapter set their slots to -1), then, for the
        draft nodes whose position completes a block, vLLM's own forward again on virtual tokens whose pooling
        windows are the nodes' windows along their ancestor paths (`plan.VirtualCompress`).
    N4  `DeepseekV4Attention._sparse_indexer_and_attn` (CSA layers, per instance, long context): before the
        indexer runs, this layer's virtual indexer pages get the canonical page and the path's keys.
    N5  `DeepseekV4FlashMLAAttention.forward_mqa` (per instance): records that the layer attended through the
        tree lists (for C4 layers: that N2 ran for it), so a lost plan fails the step instead of silently
        attending causally.

Removal: per-query slot-list hooks upstream (FlashMLA already takes per-row index lists; the compressor would
need an explicit gather list or a virtual block table argument, the indexer per-row page tables).
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch

from vllm_tree_spec.integration.dsv4.nvidia.caches import CSA

PLAN_ATTR = "dsv4_tree_nv"
_FLAG = "_tree_spec_dsv4_nv_patched"
FLASHMLA_MODULE = "vllm.models.deepseek_v4.nvidia.flashmla"


def _kernels():
    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    from vllm_tree_spec.kernels import dsv4_refresh_launch, dsv4_tree_meta_launch

    return dsv4_tree_meta_launch, dsv4_refresh_launch


def current_plan(attn_metadata=None):
    """The tree plan of the running forward, or None (stock step, profiling run, another engine)."""
    if attn_metadata is None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict) or not attn_metadata:
        return None
    return getattr(next(iter(attn_metadata.values())), PLAN_ATTR, None)


# ---------------------------------------------------------------------------
# N2: C4 top-k ids -> global slots along the tree


def tree_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token):
    plan = current_plan()
    orig = _ORIGINALS["compute_global_topk_indices_and_lens"]
    if plan is None:
        return orig(topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
    if topk_indices.shape[0] != plan.num_rows:
        raise RuntimeError(f"DeepSeek-V4 tree step: the C4 decode list has {topk_indices.shape[0]} rows, the plan "
                           f"{plan.num_rows}")
    meta, _ = _kernels()
    slots, lens = meta.tree_topk_slots_triton(plan.rows, topk_indices, plan.entries[CSA], block_table, block_size)
    plan.topk_calls += 1
    return slots, lens


_ORIGINALS: dict = {}


def install_module_hooks() -> None:
    """N2, process-wide and idempotent (inert without a plan in the forward context)."""
    mod = sys.modules.get(FLASHMLA_MODULE)
    if mod is None:
        import importlib

        mod = importlib.import_module(FLASHMLA_MODULE)
    current = mod.compute_global_topk_indices_and_lens
    if getattr(current, "_tree_spec", False):
        return
    _ORIGINALS["compute_global_topk_indices_and_lens"] = current
    tree_global_topk_indices_and_lens._tree_spec = True
    mod.compute_global_topk_indices_and_lens = tree_global_topk_indices_and_lens


# ---------------------------------------------------------------------------
# N3: block-completing draft nodes pool their ancestors' rows (vLLM's compress kernel on virtual tokens)


class StateScratch:
    """Per adapter: scratch state blocks (one tensor per row width, grown on demand; layers reuse it in turn)
    and the cached copy plans from a layer's state cache into it."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.plans: dict[tuple, object] = {}

    def tensor(self, state_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        key = (state_cache.shape[1], state_cache.shape[2], state_cache.device)
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < num_blocks:
            n = max(num_blocks, 2 * (buf.shape[0] if buf is not None else 0), 8)
            buf = self.buffers[key] = torch.empty(n, state_cache.shape[1], state_cache.shape[2],
                                                  dtype=state_cache.dtype, device=state_cache.device)
            self.plans = {k: v for k, v in self.plans.items() if k[1] != key}
        return buf

    def copy_plan(self, state_cache: torch.Tensor, scratch: torch.Tensor):
        key = (state_cache.data_ptr(), (scratch.shape[1], scratch.shape[2], scratch.device), scratch.data_ptr())
        plan = self.plans.get(key)
        if plan is None:
            _, r = _kernels()
            plan = self.plans[key] = r.build_copy_plan([(r.state_plane(state_cache), r.state_plane(scratch), 0)],
                                                       state_cache.device)
        return plan


def tree_compressor_forward(self, kv_score: torch.Tensor, positions: torch.Tensor, rotary_emb) -> None:
    self._tree_spec_orig_forward(kv_score, positions, rotary_emb)
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v4.compressor import CompressorMetadata

    ctx = get_forward_context()
    attn_metadata = ctx.attn_metadata
    plan = current_plan(attn_metadata)
    vc = plan.compress.get(self.compress_ratio) if plan is not None else None
    if vc is None:
        return
    _, r = _kernels()
    scratch_store: StateScratch = self._tree_spec_scratch
    state = self.state_cache.kv_cache
    scratch = scratch_store.tensor(state, vc.num_blocks)
    # the nodes' windows: committed rows through the block table, path rows from the ancestors' own rows
    r.copy_rows_triton(scratch_store.copy_plan(state, scratch), vc.fill_src, vc.fill_dst)
    cos_sin = rotary_emb.cos_sin_cache
    table = vc.cos_tables.get(cos_sin.data_ptr())
    if table is None:
        table = torch.zeros(vc.cos_rows, cos_sin.shape[1], dtype=cos_sin.dtype, device=cos_sin.device)
        table[vc.cos_dst] = cos_sin[vc.cos_src]
        vc.cos_tables[cos_sin.data_ptr()] = table
    virtual = dict(attn_metadata)
    virtual[self.state_cache.prefix] = CompressorMetadata(
        block_table=vc.vbt, slot_mapping=vc.vslot, block_size=vc.state_block, token_to_req_indices=vc.t2r,
        num_decode_tokens=None, c128_boundary=True)
    virtual[self.k_cache_prefix] = SimpleNamespace(slot_mapping=vc.kslot)
    self.state_cache.kv_cache = scratch
    ctx.attn_metadata = virtual
    try:
        self._tree_spec_orig_forward(kv_score[vc.kv_rows], vc.vpos, SimpleNamespace(cos_sin_cache=table))
    finally:
        ctx.attn_metadata = attn_metadata
        self.state_cache.kv_cache = state
    plan.step.mark_applied(self.prefix)


# ---------------------------------------------------------------------------
# N4: virtual indexer pages (long context)


def tree_sparse_indexer_and_attn(self, hidden_states, index_q, index_q_scale, index_weights, q, kv, positions,
                                 out) -> None:
    if self.indexer is not None and index_q is not None:  # the indexer's top-k runs this step
        plan = current_plan()
        if plan is not None and plan.indexer is not None:
            _, r = _kernels()
            k_cache = self.indexer.k_cache.kv_cache
            plans = self._tree_spec_page_plans
            key = k_cache.data_ptr()
            if key not in plans:
                plans[key] = (r.build_copy_plan([(r.index_page_plane(k_cache), r.index_page_plane(k_cache), 0)],
                                                k_cache.device),
                              r.build_copy_plan([(p, p, 0) for p in r.index_key_planes(k_cache)], k_cache.device))
            pages, keys = plans[key]
            ix = plan.indexer
            r.copy_rows_triton(pages, ix.page_src, ix.page_dst)  # canonical page -> virtual page
            r.copy_rows_triton(keys, ix.key_src, ix.key_dst)  # then the path's keys over it
            plan.step.mark_applied(self.indexer.k_cache.prefix)
    return self._tree_spec_orig__sparse_indexer_and_attn(hidden_states, index_q, index_q_scale, index_weights, q, kv,
                                                        positions, out)


# ---------------------------------------------------------------------------
# N5: every attention layer attended through the tree lists


def tree_forward_mqa(self, q, kv, positions, output) -> None:
    plan = current_plan()
    before = plan.topk_calls if plan is not None else 0
    self._tree_spec_orig_forward_mqa(q, kv, positions, output)
    if plan is None:
        return
    if self.compress_ratio == CSA and plan.topk_calls == before:
        raise RuntimeError(f"{self.prefix}: the C4 decode list was not mapped along the tree (vLLM's "
                           f"compute_global_topk_indices_and_lens override did not run); refusing the step")
    plan.step.mark_applied(self.prefix)


# ---------------------------------------------------------------------------


def _bind(obj, name: str, fn) -> None:
    orig_name = f"_tree_spec_orig_{name}"
    if getattr(obj, orig_name, None) is None:
        setattr(obj, orig_name, getattr(obj, name))
    setattr(obj, name, types.MethodType(fn, obj))


def patch_model(model, scratch: StateScratch) -> dict[str, int]:
    """N3-N5 on every NVIDIA DeepSeek-V4 attention layer and compressor of `model`; returns counts."""
    from vllm.models.deepseek_v4.compressor import DeepseekCompressor
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    counts = {"attention": 0, "compressor": 0}
    for mod in model.modules():
        if getattr(mod, _FLAG, False):
            continue
        if isinstance(mod, DeepseekV4FlashMLAAttention):
            _bind(mod, "forward_mqa", tree_forward_mqa)
            _bind(mod, "_sparse_indexer_and_attn", tree_sparse_indexer_and_attn)
            mod._tree_spec_page_plans = {}
            counts["attention"] += 1
        elif isinstance(mod, DeepseekCompressor):
            _bind(mod, "forward", tree_compressor_forward)
            mod._tree_spec_scratch = scratch
            counts["compressor"] += 1
        else:
            continue
        setattr(mod, _FLAG, True)
    return counts
