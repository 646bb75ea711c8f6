"""Per-instance method overrides on vLLM 0.32's DeepSeek-V4 CPU layers (tree engines only).

Each override reads the step's `DSV4TreePlan` from the attention metadata
(`md.dsv4_tree`, attached by the adapter for tree steps only) and otherwise
runs vLLM's own method unchanged. They are bound on the *instances* of the
tree engine's model (never on the classes), so a stock engine in the same
process is untouched; binding twice is a no-op.

    D2a  DeepseekV4CPUAttention.forward_mqa
         stock: SWA window slots and compressed-entry slots resolved by position through the block table.
         tree:  positions >= P come from the node's ancestor rows; entries completed inside the tree come
                from the completing ancestor's scratch slot.
    D2b  DeepseekV4CPUAttention._sparse_indexer_and_attn
         stock: the CSA indexer's top-k kernel reads the request's page-table row.
         tree (long context): before the kernel, fill this layer's virtual indexer pages (canonical page
                + the path's keys); the metadata already points tree rows at them.
    D2c  DeepseekV4CPUCompressor.forward (main and indexer compressors)
         stock: the pooling window is gathered by position through the state block table.
         tree:  window rows at positions >= P are the node's ancestors' state rows.
    D3   DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler (builder instances)
         stock: returns keys swaonly/c4a/c128a, the shared builder reads c1a/c2a -> KeyError 'c1a' on the
                first forward (a vLLM 0.32 CPU bug, not tree-specific).
         fix:   also return c1a / c2a = None.

Removal (D2*): a tree/per-query slot-list hook in vLLM's DeepSeek-V4 attention and compressor
(both kernels already take explicit per-query slot lists on CPU). D3: fixed upstream builder.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch

from vllm_tree_spec.integration.dsv4 import layout

_FLAG = "_tree_spec_dsv4_patched"


def _plan_of(md):
    return getattr(md, "dsv4_tree", None) if md is not None else None


# ---------------------------------------------------------------------------
# D2a: attention index lists


def tree_forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, output: torch.Tensor) -> None:
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    attn_metadata = get_forward_context().attn_metadata
    swa_metadata = attn_metadata.get(self.swa_cache_layer.prefix) if isinstance(attn_metadata, dict) else None
    plan = _plan_of(swa_metadata)
    if plan is None:
        return self._tree_spec_orig_forward_mqa(q, kv, positions, output)

    req_idx = swa_metadata.token_to_req_indices
    swa_only = self.compress_ratio <= 1
    flashmla_metadata = attn_metadata.get(self.prefix)
    num_tokens = q.shape[0]
    device = q.device

    # SWA window, as the stock method computes it ...
    window = self.window_size
    win_offsets = torch.arange(window, device=device)
    start_pos = (positions - window + 1).clamp(min=0)
    local_pos = start_pos.unsqueeze(-1) + win_offsets
    valid_win = local_pos <= positions.unsqueeze(-1)
    win_local = torch.where(valid_win, local_pos, torch.full_like(local_pos, -1))
    window_slots = map_local_to_global_slots_cpu(win_local, req_idx, swa_metadata.block_table,
                                                 swa_metadata.block_size)
    # ... then the path above the committed prefix comes from the node's ancestors' rows
    plan.remap_window_slots(window_slots, win_local, swa_metadata.slot_mapping)
    window_cache_2d = self.swa_cache_layer.kv_cache.view(self.swa_cache_layer.kv_cache.shape[0], -1)

    if swa_only:
        compressed_slots = window_slots.new_full((num_tokens, 0), -1)
        compressed_cache_2d = window_cache_2d
        compressed_block_size = 1
    else:
        main_block_size = flashmla_metadata.block_size // self.compress_ratio
        if self.compress_ratio == 4:
            local_topk = self.topk_indices_buffer[:num_tokens]
        else:
            width = -(-self.max_model_len // self.compress_ratio)
            num_compressed = torch.div(positions + 1, self.compress_ratio, rounding_mode="floor").clamp(max=width)
            arange_w = torch.arange(width, device=device)
            local_topk = torch.where(arange_w.unsqueeze(0) < num_compressed.unsqueeze(-1),
                                     arange_w.unsqueeze(0).expand(num_tokens, width),
                                     torch.full((num_tokens, width), -1, device=device, dtype=torch.int64))
        compressed_slots = map_local_to_global_slots_cpu(local_topk, req_idx, flashmla_metadata.block_table,
                                                         main_block_size)
        # entries completed inside the tree live in the completing ancestor's scratch slot
        plan.remap_entry_slots(compressed_slots, local_topk, self.compress_ratio)
        compressed_cache_2d = self.kv_cache.view(self.kv_cache.shape[0], -1)
        compressed_block_size = main_block_size

    torch.ops._C.flash_mla_with_kvcache_cpu(
        output, q, window_cache_2d, window_slots, swa_metadata.block_size, compressed_cache_2d,
        compressed_slots, compressed_block_size, self.attn_sink, self.scale)
    step = getattr(swa_metadata, "tree_step", None)
    if step is not None:
        step.mark_applied(self.prefix)  # counted by the runner after the forward (no silent fallback)


# ---------------------------------------------------------------------------
# D2b: virtual indexer pages before the top-k kernel


def tree_sparse_indexer_and_attn(self, hidden_states, index_q, index_q_scale, index_weights, q, kv, positions,
                                 out) -> None:
    from vllm.forward_context import get_forward_context

    if self.indexer is not None and index_q is not None:  # the long-context top-k kernel runs this step
        attn_metadata = get_forward_context().attn_metadata
        md = attn_metadata.get(self.indexer.k_cache.prefix) if isinstance(attn_metadata, dict) else None
        plan = _plan_of(md)
        if plan is not None and plan.indexer is not None:
            ix = plan.indexer
            k_cache = self.indexer.k_cache.kv_cache  # [nb, 64, 132] this layer's indexer keys
            layout.copy_pages(k_cache, ix.copy_src, ix.copy_dst)
            if len(ix.key_src_slots):
                layout.write_rows(k_cache, ix.key_dst_slots, layout.read_rows(k_cache, ix.key_src_slots))
    return self._tree_spec_orig__sparse_indexer_and_attn(hidden_states, index_q, index_q_scale, index_weights, q,
                                                        kv, positions, out)


# ---------------------------------------------------------------------------
# D2c: compressor pooling windows along the ancestor path


def tree_compressor_forward(self, kv_score: torch.Tensor, positions: torch.Tensor, rotary_emb) -> None:
    from vllm._custom_ops import (compress_norm_rope_store_cpu, compress_norm_rope_store_indexer_cpu,
                                  save_partial_states_cpu)
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    attn_metadata = get_forward_context().attn_metadata
    state_metadata = attn_metadata.get(self.state_cache.prefix) if isinstance(attn_metadata, dict) else None
    plan = _plan_of(state_metadata)
    if plan is None:
        return self._tree_spec_orig_forward(kv_score, positions, rotary_emb)

    kv, score = kv_score.split([self.coff * self.head_dim, self.coff * self.head_dim], dim=-1)
    slot_mapping = state_metadata.slot_mapping
    num_actual = slot_mapping.shape[0]
    state_cache = self.state_cache.kv_cache
    # every row (root and nodes) owns a unique state row: the write needs no change
    save_partial_states_cpu(kv, score, self.ape, positions, state_cache, slot_mapping)

    k_cache_metadata = cast(Any, attn_metadata[self.k_cache_prefix])
    kv_cache = self._static_forward_context[self.k_cache_prefix].kv_cache
    window = (1 + self.overlap) * self.compress_ratio
    win_offsets = torch.arange(window, device=positions.device)
    win_local = positions.unsqueeze(-1) - window + 1 + win_offsets
    req_idx = state_metadata.token_to_req_indices[:num_actual]
    gather_slots = map_local_to_global_slots_cpu(win_local, req_idx, state_metadata.block_table,
                                                 state_metadata.block_size)
    plan.remap_window_slots(gather_slots, win_local, slot_mapping)
    store_fn = compress_norm_rope_store_cpu if self.head_dim == 512 else compress_norm_rope_store_indexer_cpu
    # k_cache_metadata.slot_mapping already sends tree nodes' entries to scratch (adapter.on_metadata)
    store_fn(state_cache, gather_slots, positions, k_cache_metadata.slot_mapping, self._norm_weight_fp32,
             self.rms_norm_eps, rotary_emb.cos_sin_cache, kv_cache.view(kv_cache.shape[0], -1), kv_cache.shape[1],
             self.compress_ratio)


# ---------------------------------------------------------------------------
# D3: tile-scheduler keys


def fixed_build_tile_scheduler(self, num_decode_tokens: int) -> dict:
    return {k: None for k in ("swaonly", "c4a", "c128a", "c1a", "c2a")}


# ---------------------------------------------------------------------------


def _bind(obj, name: str, fn) -> None:
    orig_name = f"_tree_spec_orig_{name}"
    if getattr(obj, orig_name, None) is None:
        setattr(obj, orig_name, getattr(obj, name))
    setattr(obj, name, types.MethodType(fn, obj))


def patch_model(model) -> dict[str, int]:
    """Bind D2a-c on every DeepSeek-V4 CPU attention layer / compressor of `model`; returns counts."""
    from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    counts = {"attention": 0, "compressor": 0}
    for mod in model.modules():
        if getattr(mod, _FLAG, False):
            continue
        if isinstance(mod, DeepseekV4CPUAttention):
            _bind(mod, "forward_mqa", tree_forward_mqa)
            _bind(mod, "_sparse_indexer_and_attn", tree_sparse_indexer_and_attn)
            counts["attention"] += 1
        elif isinstance(mod, DeepseekV4CPUCompressor):
            _bind(mod, "forward", tree_compressor_forward)
            counts["compressor"] += 1
        else:
            continue
        setattr(mod, _FLAG, True)
    return counts


def attention_layer_names(model) -> set[str]:
    """The DeepSeek-V4 CPU attention layers of `model` (each must apply a tree step's plan)."""
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    return {mod.prefix for mod in model.modules() if isinstance(mod, DeepseekV4CPUAttention)}


def patch_builders(runner) -> int:
    """D3 on this runner's SWA metadata builders (instances only)."""
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder

    n = 0
    for groups in runner.attn_groups:
        for ag in groups:
            for b in getattr(ag, "metadata_builders", None) or []:
                if isinstance(b, DeepseekV4CPUSparseSWAMetadataBuilder) and not getattr(b, _FLAG, False):
                    b.build_tile_scheduler = types.MethodType(fixed_build_tile_scheduler, b)
                    setattr(b, _FLAG, True)
                    n += 1
    return n
