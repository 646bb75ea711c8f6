"""Accepted-path KV commit for standard paged attention: Triton launchers and PyTorch references.

Kernel in `kv_commit.py`. Triton is imported lazily inside the launchers, so
the PyTorch functions here work without it.

What it does (semantics of `vllm_tree_spec.integration.kv_layout.compaction_pairs`):
request b's tree rows sit at cache slots `row_slots[cu_num_rows[b] + r]` (row 0
= root, row i + 1 = draft node i); after verification accepted the path
n_1 < ... < n_a (`accepted_nodes[b, :a]`, a = `num_accepted[b]`), the K/V of
row n_k + 1 moves to the slot of row k, k = 1..a, so the committed sequence is
contiguous in position order (root, then the path). The recovered / bonus
token is not committed (its KV is written next step, as the new root).

    kv_commit_reference   host loop over `compaction_pairs` + `gpu_copy_slots` (reads every
                          source before writing any destination); the test oracle
    kv_commit_torch       the same on the device without a host sync: pair lists built with
                          tensor ops, one gather + scatter per layer (the benchmark baseline)
    kv_commit_triton      one launch for all layers, index construction inside the kernel
    kv_commit_rows_triton the same for a generic [num_slots, row] cache view
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from vllm_tree_spec.integration.kv_layout import compaction_pairs, gpu_copy_slots

_INDEX_DTYPES = (torch.int32, torch.int64)
# widest integer views first: a row is copied as raw bits, in as few loads as its size allows
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _as_list(caches) -> list[torch.Tensor]:
    return [caches] if isinstance(caches, torch.Tensor) else list(caches)


# ---------------------------------------------------------------------------
# PyTorch


def commit_pairs(
    row_slots: torch.Tensor, cu_num_rows: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[list[int], list[int]]:
    """(src, dst) slot lists of every request, via `compaction_pairs` (host)."""
    slots, cu = row_slots.tolist(), cu_num_rows.tolist()
    src, dst = [], []
    for b in range(len(cu) - 1):
        path = accepted_nodes[b, : int(num_accepted[b])].tolist()
        for s, d in compaction_pairs(slots[cu[b] : cu[b + 1]], path):
            src.append(s)
            dst.append(d)
    return src, dst


def kv_commit_reference(
    kv_caches: torch.Tensor | Sequence[torch.Tensor],  # each [2, num_blocks, block_size, Hkv, D]
    row_slots: torch.Tensor,  # [R] slot of every tree row
    cu_num_rows: torch.Tensor,  # [B + 1]
    accepted_nodes: torch.Tensor,  # [B, D]
    num_accepted: torch.Tensor,  # [B]
) -> int:
    """Reference commit (in place): every source read before any destination is written. Returns pairs copied."""
    src, dst = commit_pairs(row_slots, cu_num_rows, accepted_nodes, num_accepted)
    if src:
        for cache in _as_list(kv_caches):
            s = torch.tensor(src, dtype=torch.long, device=cache.device)
            d = torch.tensor(dst, dtype=torch.long, device=cache.device)
            gpu_copy_slots(cache, s, d)
    return len(src)


def kv_commit_rows_reference(caches, row_slots, cu_num_rows, accepted_nodes, num_accepted) -> int:
    """`kv_commit_reference` for [num_slots, ...] caches (one plane)."""
    src, dst = commit_pairs(row_slots, cu_num_rows, accepted_nodes, num_accepted)
    if src:
        for cache in _as_list(caches):
            s = torch.tensor(src, dtype=torch.long, device=cache.device)
            d = torch.tensor(dst, dtype=torch.long, device=cache.device)
            cache[d] = cache[s].clone()
    return len(src)


def commit_index_lists(
    row_slots: torch.Tensor, cu_num_rows: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side (src, dst) slots [B * D] without a host sync; unused entries are self-copies (src == dst)."""
    b, d = accepted_nodes.shape
    dev = accepted_nodes.device
    k = torch.arange(1, d + 1, device=dev)  # destination rows
    row0 = cu_num_rows[:-1].to(torch.long)[:, None]
    valid = k[None, :] <= num_accepted.to(torch.long)[:, None]  # [B, D]
    zero = torch.zeros_like(valid, dtype=torch.long)
    src_row = torch.where(valid, accepted_nodes.to(torch.long) + 1, zero)  # unused: the root onto itself
    dst_row = torch.where(valid, k[None, :].expand(b, d), zero)
    slots = row_slots.to(torch.long)
    return slots[row0 + src_row].reshape(-1), slots[row0 + dst_row].reshape(-1)


def kv_commit_torch(kv_caches, row_slots, cu_num_rows, accepted_nodes, num_accepted) -> None:
    """PyTorch on-device commit: index lists from tensors, then one gather + scatter per layer (in place)."""
    src, dst = commit_index_lists(row_slots, cu_num_rows, accepted_nodes, num_accepted)
    if src.numel() == 0:
        return
    for cache in _as_list(kv_caches):
        two, nb, bs = cache.shape[:3]
        flat = cache.view(two, nb * bs, *cache.shape[3:])
        flat[:, dst] = flat[:, src]  # advanced indexing gathers into a new tensor first: overlap-safe


# ---------------------------------------------------------------------------
# Triton


def _row_view(cache: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.dtype]:
    """cache with the dims after the first `keep` flattened to one contiguous row, viewed as the widest int type."""
    try:  # .view, not .flatten: a copy would silently commit into a temporary
        row = cache.view(*cache.shape[:keep], -1)
    except RuntimeError:
        row = None
    if row is None or row.stride(-1) != 1:
        raise ValueError(
            f"the per-slot row (dims {keep}..) of a cache {tuple(cache.shape)} with strides {tuple(cache.stride())} "
            f"must be contiguous")
    for w in _WORD_DTYPES:
        try:
            v = row.view(w)
        except RuntimeError:
            continue
        if v.data_ptr() % v.element_size() == 0:
            return v, w
    raise AssertionError("unreachable: uint8 always works")


def _launch(views: list[torch.Tensor], row_slots, cu_num_rows, accepted_nodes, num_accepted,
            *, num_planes: int, page_size: int, strides: tuple[int, int, int], layer_table, block) -> None:
    import triton

    from .kv_commit import kv_commit_kernel

    device = views[0].device
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"the Triton KV-commit kernel needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            f"before importing triton, or use kv_commit_torch / kv_commit_reference"
        )
    for name, t, dim in (("row_slots", row_slots, 1), ("cu_num_rows", cu_num_rows, 1),
                         ("accepted_nodes", accepted_nodes, 2), ("num_accepted", num_accepted, 1)):  # fmt: skip
        if t.dtype not in _INDEX_DTYPES or t.dim() != dim:
            raise TypeError(f"{name} must be a {dim}-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; the caches are on {device}")
        if t.numel() and not t[(0,) * (dim - 1)].is_contiguous():  # the kernel indexes the last dim with stride 1
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride()}); e.g. a column of a "
                             f"packed tensor needs .contiguous()")
    batch = num_accepted.shape[0]
    if cu_num_rows.shape[0] != batch + 1 or accepted_nodes.shape[0] != batch:
        raise ValueError(
            f"{batch} requests need cu_num_rows [B + 1] and accepted_nodes [B, D]; "
            f"got {tuple(cu_num_rows.shape)} and {tuple(accepted_nodes.shape)}"
        )
    first = views[0]
    for v in views[1:]:
        if v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype or v.device != device:
            raise ValueError("all layers of one launch must share shape, strides, dtype and device; group them")
    if batch == 0 or accepted_nodes.shape[1] == 0:
        return
    row = first.shape[-1]
    if block is None:
        block = min(triton.next_power_of_2(row), 1024)
    col_tiles = triton.cdiv(row, block)
    use_table = len(views) > 1
    if use_table and layer_table is None:
        layer_table = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)
    table_arg = layer_table if use_table else torch.zeros(1, dtype=torch.int64, device=device)
    grid = (batch, num_planes * col_tiles, len(views) if use_table else 1)
    kv_commit_kernel[grid](
        first, table_arg, row_slots, cu_num_rows, accepted_nodes, num_accepted,
        page_size, strides[0], strides[1], strides[2], accepted_nodes.stride(0),
        ROW=row,
        BLOCK=block,
        COL_TILES=col_tiles,
        USE_LAYER_TABLE=use_table,
        num_warps=max(1, min(8, block // 256)),
    )  # fmt: skip


def kv_commit_triton(
    kv_caches: torch.Tensor | Sequence[torch.Tensor],  # each [2, num_blocks, block_size, Hkv, D], any dtype
    row_slots: torch.Tensor,  # [R] int32/int64 slot of every tree row (vLLM slot_mapping of the rows)
    cu_num_rows: torch.Tensor,  # [B + 1] int32/int64 row offsets (root row first)
    accepted_nodes: torch.Tensor,  # [B, D] int32/int64 local node indices, increasing along the path
    num_accepted: torch.Tensor,  # [B] int32/int64
    *,
    layer_table: torch.Tensor | None = None,  # [L] int64 data_ptr of each cache (cache it across steps)
    block: int | None = None,
) -> None:
    """Commit accepted paths in vLLM's GPU KV layout, every layer in one launch, in place.

    For each request b and k = 1..num_accepted[b], with n_k = accepted_nodes[b, k - 1]
    and slot(r) = row_slots[cu_num_rows[b] + r]:

        cache[:, slot(k) // bs, slot(k) % bs] <- cache[:, slot(n_k + 1) // bs, slot(n_k + 1) % bs]

    (K and V planes, all heads), skipping n_k + 1 == k. Equivalent to applying
    `compaction_pairs` with every source read before any destination is
    written, given that the path's node indices increase (true for any path of
    a topologically ordered tree; not checked on the device) and that rows
    have distinct slots. No host synchronisation; the index lists are built
    inside the kernel from the verifier's outputs. The layers must share shape,
    strides and dtype (group them otherwise); rows are copied as raw bits.
    """
    caches = _as_list(kv_caches)
    if not caches:
        return
    c0 = caches[0]
    if c0.dim() != 5 or c0.shape[0] != 2:
        raise ValueError(f"expected vLLM's GPU layout [2, num_blocks, block_size, Hkv, D], got {tuple(c0.shape)}")
    views = []
    for c in caches:
        v, _ = _row_view(c, 3)  # [2, nb, bs, Hkv * D] as int64 / int32 / int16 / uint8
        views.append(v)
    v0 = views[0]
    _launch(views, row_slots, cu_num_rows, accepted_nodes, num_accepted, num_planes=2, page_size=v0.shape[2],
            strides=(v0.stride(0), v0.stride(1), v0.stride(2)), layer_table=layer_table, block=block)


def kv_commit_paged_triton(
    kv_caches: torch.Tensor | Sequence[torch.Tensor],  # each [num_blocks, Hkv, block_size, 2 * D] (logical)
    row_slots: torch.Tensor,  # [R]
    cu_num_rows: torch.Tensor,  # [B + 1]
    accepted_nodes: torch.Tensor,  # [B, D]
    num_accepted: torch.Tensor,  # [B]
    *,
    layer_table: torch.Tensor | None = None,
    block: int | None = None,
) -> None:
    """`kv_commit_triton` for vLLM 0.32's FLASH_ATTN / TRITON_ATTN caches, [num_blocks, Hkv, block_size, 2D]
    in logical order with any physical order of the first three dims (the 2D row must be contiguous).

    Each head is a plane (its K|V row of 2D elements); when the heads of a slot are adjacent in memory
    (physically [num_blocks, block_size, Hkv, 2D]) they are copied as one row. One launch for all layers.
    """
    caches = _as_list(kv_caches)
    if not caches:
        return
    c0 = caches[0]
    if c0.dim() != 4:
        raise ValueError(f"expected a paged cache [num_blocks, Hkv, block_size, 2D], got {tuple(c0.shape)}")
    views = [_row_view(c, 3)[0] for c in caches]  # [nb, Hkv, bs, 2D] as int words
    v0 = views[0]
    hkv, row = v0.shape[1], v0.shape[3]
    if v0.stride(1) == row and v0.stride(2) == hkv * row:  # heads adjacent: one row per slot
        views = [v.as_strided((v.shape[0], v.shape[2], hkv * row), (v.stride(0), v.stride(2), 1)) for v in views]
        planes, strides = 1, (0, views[0].stride(0), views[0].stride(1))
    else:
        planes, strides = hkv, (v0.stride(1), v0.stride(0), v0.stride(2))
    _launch(views, row_slots, cu_num_rows, accepted_nodes, num_accepted, num_planes=planes, page_size=v0.shape[2],
            strides=strides, layer_table=layer_table, block=block)


def kv_commit_rows_triton(
    caches: torch.Tensor | Sequence[torch.Tensor],  # each [num_slots, ...] (one row per slot)
    row_slots: torch.Tensor,  # [R]
    cu_num_rows: torch.Tensor,  # [B + 1]
    accepted_nodes: torch.Tensor,  # [B, D]
    num_accepted: torch.Tensor,  # [B]
    *,
    layer_table: torch.Tensor | None = None,
    block: int | None = None,
) -> None:
    """`kv_commit_triton` for a generic cache view with one row per slot (e.g. [num_slots, row_bytes] uint8,
    or any [num_blocks * block_size, ...] view whose per-slot dims are contiguous)."""
    caches = _as_list(caches)
    if not caches:
        return
    views = []
    for c in caches:
        if c.dim() < 1:
            raise ValueError("a row cache needs a leading slot dim")
        v, _ = _row_view(c if c.dim() > 1 else c[:, None], 1)  # [num_slots, row]
        views.append(v)
    v0 = views[0]
    _launch(views, row_slots, cu_num_rows, accepted_nodes, num_accepted, num_planes=1, page_size=1,
            strides=(0, v0.stride(0), 0), layer_table=layer_table, block=block)


__all__ = [
    "commit_index_lists",
    "commit_pairs",
    "kv_commit_paged_triton",
    "kv_commit_reference",
    "kv_commit_rows_reference",
    "kv_commit_rows_triton",
    "kv_commit_torch",
    "kv_commit_triton",
]
