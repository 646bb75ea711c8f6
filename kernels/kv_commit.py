"""Triton kernel for the accepted-path KV commit (`@triton.jit` code only).

The typed launchers, whose docstrings state the contract, are in
`vllm_tree_spec.kernels.kv_commit_launch` (`kv_commit_triton` for vLLM's GPU
layout, `kv_commit_rows_triton` for a generic [num_slots, row] cache), next to
the PyTorch reference `kv_commit_reference` (built on
`vllm_tree_spec.integration.kv_layout.compaction_pairs`).

After verification request b accepted a nodes n_1 < n_2 < ... < n_a (a path,
so the node indices increase). Row k (k = 1..a) must receive row n_k + 1:

    slot(row k) <- slot(row n_k + 1)      skipped when n_k + 1 == k (already in place)

Safety of an in-place, in-order copy (no second buffer, no host index list):
the destination row of step k is k, and every later source row n_j + 1
(j > k) is >= j > k (strictly increasing non-negative node indices give
n_j >= j - 1), so no step overwrites a row that a later step reads. A source
row equal to an earlier destination has already been read. The program copies
step after step, with a barrier between steps so the argument holds whatever
thread owns which column.

Grid: (request, plane x column tile, layer). A plane is K or V (2 planes in
vLLM's [2, num_blocks, block_size, Hkv, D] layout, 1 for a generic row view);
a column tile is BLOCK elements of the slot's row (all heads x head_dim), in
an integer dtype as wide as the row allows (raw bits: any cache dtype, fp8
included). Layers sharing a layout are one launch: their base addresses come
from a pointer table. Programs touch disjoint columns / planes / layers /
requests, so only the in-order argument above is needed.
"""

import triton
import triton.language as tl


# Batch-dependent values change every step; do not recompile for them.
@triton.jit(do_not_specialize=["stride_acc"])
def kv_commit_kernel(
    cache_ptr,  # layer 0's cache as raw integers; element type of every layer (USE_LAYER_TABLE)
    layer_ptrs_ptr,  # [L] int64 base addresses of the layers' caches (USE_LAYER_TABLE)
    row_slots_ptr,  # [R] int cache slot of every tree row this step (root row first per request)
    cu_num_rows_ptr,  # [B + 1] row offsets
    accepted_nodes_ptr,  # [B, D] int64 local node indices of the accepted path (verify output)
    num_accepted_ptr,  # [B] int accepted nodes a (after EOS / max_tokens cuts)
    page_size,  # slots per block (1 for a flat [num_slots, row] view)
    stride_plane,  # elements between the K and V planes
    stride_block,  # elements between blocks
    stride_offset,  # elements between slots of one block
    stride_acc,
    ROW: tl.constexpr,  # elements per slot row in one plane (Hkv * D, in the integer view)
    BLOCK: tl.constexpr,  # columns per program
    COL_TILES: tl.constexpr,  # cdiv(ROW, BLOCK)
    USE_LAYER_TABLE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    plane = (tile // COL_TILES).to(tl.int64)
    cols = (tile % COL_TILES) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < ROW
    if USE_LAYER_TABLE:
        layer = tl.program_id(2).to(tl.int64)
        base = tl.load(layer_ptrs_ptr + layer).to(tl.pointer_type(cache_ptr.dtype.element_ty))
    else:
        base = cache_ptr
    base = base + plane * stride_plane
    row0 = tl.load(cu_num_rows_ptr + b).to(tl.int64)
    n_acc = tl.load(num_accepted_ptr + b).to(tl.int64)
    for k in range(1, n_acc + 1):  # in order: destination rows 1, 2, ..., a
        src_row = tl.load(accepted_nodes_ptr + b * stride_acc + k - 1).to(tl.int64) + 1
        if src_row != k:
            src = tl.load(row_slots_ptr + row0 + src_row).to(tl.int64)
            dst = tl.load(row_slots_ptr + row0 + k).to(tl.int64)
            src_ptr = base + (src // page_size) * stride_block + (src % page_size) * stride_offset
            dst_ptr = base + (dst // page_size) * stride_block + (dst % page_size) * stride_offset
            vals = tl.load(src_ptr + cols, mask=col_mask)
            tl.store(dst_ptr + cols, vals, mask=col_mask)
        # Step k's reads and writes complete before step k + 1 (its destination may be a row read here).
        tl.debug_barrier()
