"""Accepted-path commit for standard attention: compact the path's KV into the first draft slots.

After verification the scheduler rolls back `n - a` tokens exactly as for a
chain whose first `a` drafts were accepted, so the KV of the k-th accepted
node must sit in the slot of row k (position root + k). The next token
(recovered or bonus) is not committed: its KV is computed in the next step,
where it is the new root. Rejected rows keep stale KV that the next step
overwrites, as in vLLM's chain path.
"""

from __future__ import annotations

import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeRequestStep


def commit_accepted_paths(runner, requests: list[TreeRequestStep], accepted: list[list[int]]) -> int:
    """Move every accepted path into place in every KV cache layer. Returns rows copied per layer."""
    pairs_by_group: dict[int, tuple[list[int], list[int]]] = {}
    for req, path in zip(requests, accepted):
        for gid, slots in req.row_slots.items():
            src, dst = pairs_by_group.setdefault(gid, ([], []))
            for s, d in kv_layout.compaction_pairs(slots, path):
                src.append(s)
                dst.append(d)
    moved = 0
    for gid, (src, dst) in pairs_by_group.items():
        if not src:
            continue
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        for layer_name, kv_cache, impl in _group_layers(runner, gid):
            layout = getattr(impl, "tree_kv_layout", None)  # declared by our attention overrides
            if layout == "cpu_attn":  # CPU_ATTN [nb, Hkv, bs, 2D], K transposed per block
                kv_layout.cpu_copy_slots(kv_cache, s, d, impl.head_size)
            elif layout == "paged":  # FLASH_ATTN / TRITON_ATTN [nb, Hkv, bs, 2D] (logical order)
                kv_layout.paged_copy_slots(kv_cache, s.to(kv_cache.device), d.to(kv_cache.device))
            else:
                raise kv_layout.UnsupportedKVLayout(
                    f"layer {layer_name}: {type(impl).__name__} (KV cache {tuple(kv_cache.shape)}) has no tree commit")
        moved = max(moved, len(src))
    return moved


def _group_layers(runner, gid: int):
    seen: set[int] = set()
    ctx = runner.compilation_config.static_forward_context
    for name in runner.kv_cache_config.kv_cache_groups[gid].layer_names:
        layer = ctx.get(name)
        if layer is None:
            continue
        kv = layer.kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        if not isinstance(kv, torch.Tensor) or kv.numel() == 0 or kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        yield name, kv, layer.impl
