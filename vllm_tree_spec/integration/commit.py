"""Accepted-path commit for standard attention: compact the path's KV into the first draft slots.

After verification the scheduler rolls back `n - a` tokens exactly as for a
chain whose first `a` drafts were accepted, so the KV of the k-th accepted
node must sit in the slot of row k (position root + k). The next token
(recovered or bonus) is not committed: its KV is computed in the next step,
where it is the new root. Rejected rows keep stale KV that the next step
overwrites, as in vLLM's chain path.

`commit_step` (the serving path) works from the step's device tensors and the
verifier's outputs, with no host sync and no per-request work:

    paged (FLASH_ATTN / TRITON_ATTN, CUDA)  one `kv_commit_paged_triton` launch per KV group
                                            (every layer: a cached table of base addresses)
    cpu_attn, or paged without CUDA         the (src, dst) slots built once per step on the device
                                            (`commit_index_lists`; on CPU from host lists, `moving_rows`,
                                            without the pairs already in place: a step whose paths
                                            all sit in place, chains' usually, copies nothing),
                                            then one gather + one scatter
                                            over all layers of a group when vLLM placed them in
                                            one allocation at a constant stride (vLLM 0.32 does:
                                            `create_kv_cache_views`), else per layer; CPU_ATTN
                                            rows are addressed by `kv_layout.cpu_slot_offsets` for
                                            the group's ISA (vec / vec16 / amx)

`commit_accepted_paths` is the host-list form (per-request paths), kept for
callers that have only those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_tree_spec import verify
from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep


def commit_verified(runner, adapter, step: TreeStep, tree_idx: list[int], result, host) -> tuple[list, list]:
    """After verification (runner-agnostic): move every accepted path's KV into place through the model
    family's adapter (`adapters.py`: on the device from the verifier's tensors, or from host lists) and
    return (requests, accepted paths) in the verifier's order, read from its host copy (no sync)."""
    by_index = step.by_index()
    reqs = [by_index[b] for b in tree_idx]
    acc, num = host.accepted_nodes.tolist(), host.num_accepted.tolist()
    paths = [a[:k] for a, k in zip(acc, num)]
    if getattr(adapter, "device_commit", False):  # on the device, from the verifier's tensors
        adapter.commit(runner, step, result)
    else:
        adapter.commit(runner, reqs, paths)
    return reqs, paths


def commit_accepted_paths(runner, requests: "list[TreeRequestStep] | TreeStep",
                          accepted: "list[list[int]] | TreeVerifyOutput") -> int:  # noqa: F821
    """Move every accepted path into place in every KV cache layer.

    Host lists (per-request paths and `row_slots`): returns the rows copied per layer. A `TreeStep`
    with its `TreeStepMeta` and the verifier's device output: `commit_step` (returns 0; counting
    the rows would need a host sync).
    """
    if isinstance(requests, TreeStep):
        commit_step(runner, requests, accepted)
        return 0
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
        for layer_name, kv_cache, impl, isa in _group_layers(runner, gid):
            layout = getattr(impl, "tree_kv_layout", None)  # declared by our attention overrides
            if layout == "cpu_attn":  # CPU_ATTN [nb, Hkv, bs, 2D], packed per block by the layer's ISA
                kv_layout.cpu_copy_slots(kv_cache, s, d, impl.head_size, isa)
            elif layout == "paged":  # FLASH_ATTN / TRITON_ATTN [nb, Hkv, bs, 2D] (logical order)
                kv_layout.paged_copy_slots(kv_cache, s.to(kv_cache.device), d.to(kv_cache.device))
            else:
                raise kv_layout.UnsupportedKVLayout(
                    f"layer {layer_name}: {type(impl).__name__} (KV cache {tuple(kv_cache.shape)}) has no tree commit")
        moved = max(moved, len(src))
    return moved


# ---------------------------------------------------------------------------
# The device path


@dataclass
class _GroupCommit:
    """How one KV group's layers are moved (built on the first tree step; the caches never move)."""

    layout: str  # "cpu_attn" | "paged"
    head_size: int
    caches: list[torch.Tensor]  # per layer, or one joined [L, ...] view
    joined: bool  # caches == [view over every layer]
    isa: str | None = None  # cpu_attn: the group's CPU_ATTN ISA (vLLM sets one per metadata builder)
    layer_table: torch.Tensor | None = None  # Triton: [L] int64 base addresses


def commit_step(runner, step, result) -> None:
    """Commit the accepted paths of a step (`TreeStepMeta` + the verifier's device outputs), in place."""
    meta = step.meta
    plans = runner.__dict__.setdefault("_tree_commit_groups", {})
    host = not verify.sync_free(result.accepted_nodes.device)
    if host:  # CPU: the moving pairs from host lists, once for every group (most steps move nothing)
        src_rows, dst_rows = moving_rows(meta.cu_num_rows, result.accepted_nodes, result.num_accepted)
        if not src_rows:
            return
        src_rows, dst_rows = torch.tensor(src_rows), torch.tensor(dst_rows)
    for gid, row_slots in meta.row_slots.items():
        plan = plans.get(gid)
        if plan is None:
            plan = plans[gid] = _plan_group(runner, gid)
        if plan is None:
            continue
        if plan.layout == "paged" and plan.caches[0].device.type == "cuda":
            from vllm_tree_spec.tree_attention import load_kernels_package

            load_kernels_package()
            from vllm_tree_spec.kernels.kv_commit_launch import kv_commit_paged_triton

            kv_commit_paged_triton(plan.caches, row_slots, meta.cu_num_rows, result.accepted_nodes,
                                   result.num_accepted, layer_table=plan.layer_table)
            continue
        if host:
            src, dst = row_slots[src_rows], row_slots[dst_rows]
        else:
            src, dst = commit_index_lists(row_slots, meta.cu_num_rows, result.accepted_nodes, result.num_accepted)
        for cache in plan.caches:
            copy_slots(cache, src, dst, plan.layout, plan.head_size, plan.joined, plan.isa)


def commit_index_lists(row_slots, cu_num_rows, accepted_nodes, num_accepted) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) slots [B * D] on the device, no host sync (`kv_layout.compaction_rows`)."""
    src_row, dst_row = kv_layout.compaction_rows(accepted_nodes, num_accepted)  # [B, D] local rows
    row0 = cu_num_rows[:-1, None]
    return row_slots[row0 + src_row].reshape(-1), row_slots[row0 + dst_row].reshape(-1)


def moving_rows(cu_num_rows, accepted_nodes, num_accepted) -> tuple[list[int], list[int]]:
    """CPU: (src, dst) step rows of the pairs that move each accepted path into place (`compaction_pairs` on the
    step's rows: pairs already in place, a chain's accepted prefix, are left out). Host lists: a few accepted
    nodes per request, where each tensor op would cost more than the loop."""
    cu = cu_num_rows.tolist()
    src, dst = [], []
    for b, (nodes, k) in enumerate(zip(accepted_nodes.tolist(), num_accepted.tolist())):
        for s, d in kv_layout.compaction_pairs(range(cu[b], cu[b + 1]), nodes[:k]):
            src.append(s)
            dst.append(d)
    return src, dst


def copy_slots(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, layout: str, head_size: int,
               joined: bool, isa: str | None = None) -> None:
    """cache[dst] <- cache[src] for every slot pair (K and V, every head; every layer if joined), one
    gather and one scatter. Sources are read before any destination is written (overlap-safe); pairs
    with src == dst write back what they read. isa: the CPU_ATTN ISA (layout "cpu_attn" only)."""
    c = cache if joined else cache[None]  # [L, nb, Hkv, bs, 2D] logical
    bs = c.shape[3]
    sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
    if layout == "paged":
        c[:, db, :, do] = c[:, sb, :, so]
        return
    # CPU_ATTN: a slot's 2D elements are scattered over its (block, head) run of bs * 2D elements, at
    # offsets fixed by the ISA's packing (vec: d * bs + o for K, bs * D + o * D + d for V)
    flat = c.flatten(3)  # [L, nb, Hkv, bs * 2D] (a view: each block's run is contiguous)
    size = cache.element_size()
    src_cols = kv_layout.cpu_slot_offsets(isa, so, head_size, bs, size)  # [P, 2D]
    dst_cols = kv_layout.cpu_slot_offsets(isa, do, head_size, bs, size)
    flat[:, db[:, None], :, dst_cols] = flat[:, sb[:, None], :, src_cols]


def _plan_group(runner, gid: int) -> _GroupCommit | None:
    layers = list(_group_layers(runner, gid))
    if not layers:
        return None
    layouts = {getattr(impl, "tree_kv_layout", None) for _, _, impl, _ in layers}
    name, kv, impl, _ = layers[0]
    if len(layouts) != 1 or layouts - {"cpu_attn", "paged"}:
        raise kv_layout.UnsupportedKVLayout(
            f"layer {name}: {type(impl).__name__} (KV cache {tuple(kv.shape)}) has no tree commit")
    layout = layouts.pop()
    caches = [c for _, c, _, _ in layers]
    if layout == "paged" and kv.device.type == "cuda":
        table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=kv.device)
        return _GroupCommit(layout, impl.head_size, caches, False, layer_table=table)
    isa = None
    if layout == "cpu_attn":
        isas = {i for _, _, _, i in layers}
        if len(isas) != 1:
            raise kv_layout.UnsupportedKVLayout(
                f"KV group {gid}: its layers use different CPU_ATTN ISAs {sorted(map(str, isas))}")
        isa = isas.pop()
    joined = join_layers(caches)
    if joined is not None:
        return _GroupCommit(layout, impl.head_size, [joined], True, isa)
    return _GroupCommit(layout, impl.head_size, caches, False, isa)


def join_layers(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """One [L, ...] view over per-layer caches that share an allocation at a constant stride, else None."""
    c0 = caches[0]
    if any(c.shape != c0.shape or c.stride() != c0.stride() or c.dtype != c0.dtype
           or c.untyped_storage().data_ptr() != c0.untyped_storage().data_ptr() for c in caches):
        return None
    order = sorted(caches, key=lambda c: c.data_ptr())
    if len(order) == 1:
        return order[0][None]
    step = order[1].storage_offset() - order[0].storage_offset()
    if step <= 0 or any(b.storage_offset() - a.storage_offset() != step for a, b in zip(order, order[1:])):
        return None
    return torch.as_strided(order[0], (len(order), *c0.shape), (step, *c0.stride()), order[0].storage_offset())


def _group_layers(runner, gid: int):
    seen: set[int] = set()
    ctx = runner.compilation_config.static_forward_context
    for name in runner.kv_cache_config.kv_cache_groups[gid].layer_names:
        layer = ctx.get(name)
        if layer is None or getattr(layer, "tree_draft_kv", False):  # a head's pages: the head writes them
            continue
        kv = layer.kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        if not isinstance(kv, torch.Tensor) or kv.numel() == 0 or kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        yield name, kv, layer.impl, getattr(layer, "isa", None)  # isa: CPU_ATTN layers (vLLM's builder sets it)
