"""Triton kernels for DeepSeek-V4 tree steps on vLLM's NVIDIA path: slot-row copies through a descriptor table
(`@triton.jit` code only).

Launchers, the descriptor layout and the PyTorch twins are in `dsv4_refresh_launch.py`.

Every DeepSeek-V4 store is a paged cache in which a slot's row sits at

    base + (slot // page_slots) * page_stride + (slot % page_slots) * slot_stride     (int32 words)

(vLLM pools the pages of every layer into one allocation, so page_stride is the pooled block, not the
layer's page; an fp8_ds_mla row is two planes: 576 data bytes in the page's data region and 8 scale bytes in
its scale region). A descriptor names one plane of one layer's cache (source and destination may be
different tensors); a work item is (descriptor, first word), so one launch moves rows of every layer, plane
and row width at once. Rows are raw bits.

    dsv4_refresh_kernel   the accepted-path refresh: for request b, k = 1 .. num_accepted[b], row
                          r = cu_num_rows[b] + accepted_nodes[b, k - 1] + 1 copies slot src[space, r] to
                          dst[space, r] (skipping -1 sources and rows already in place), in k order
    dsv4_copy_rows_kernel a list of (src, dst) slot pairs (-1 source = skip), e.g. a compressor's pooling
                          window gathered into scratch state blocks, or virtual indexer pages
"""

import triton
import triton.language as tl


@triton.jit
def _row_ptr(base, slot, page_slots, page_stride, slot_stride):
    return base + (slot // page_slots) * page_stride + (slot % page_slots) * slot_stride


@triton.jit(do_not_specialize=["table_stride", "acc_stride"])
def dsv4_refresh_kernel(
    items_ptr,  # [I, 2] int32: (descriptor, first word) of every work item
    desc_ptr,  # [D, 10] int64 descriptors (dsv4_refresh_launch.DESC_FIELDS)
    src_table_ptr,  # [S, R] int64 source slot of every tree row in slot space s (-1 = nothing to commit)
    dst_table_ptr,  # [S, R] int64 destination slot of every tree row in slot space s
    cu_num_rows_ptr,  # [B + 1] row offsets (root first)
    accepted_ptr,  # [B, D] local node indices of the accepted path
    num_accepted_ptr,  # [B]
    table_stride,
    acc_stride,
    BLOCK: tl.constexpr,  # words per work item
):
    b = tl.program_id(0).to(tl.int64)
    it = tl.program_id(1).to(tl.int64)
    d = tl.load(items_ptr + it * 2).to(tl.int64)
    w0 = tl.load(items_ptr + it * 2 + 1).to(tl.int64)
    dp = desc_ptr + d * 10
    space = tl.load(dp + 0)
    base = tl.load(dp + 1).to(tl.pointer_type(tl.int32))
    page_stride = tl.load(dp + 2)
    slot_stride = tl.load(dp + 3)
    page_slots = tl.load(dp + 4)
    words = tl.load(dp + 9)
    cols = w0 + tl.arange(0, BLOCK).to(tl.int64)
    cmask = cols < words
    row0 = tl.load(cu_num_rows_ptr + b).to(tl.int64)
    n_acc = tl.load(num_accepted_ptr + b).to(tl.int64)
    for k in range(1, n_acc + 1):
        node = tl.load(accepted_ptr + b * acc_stride + k - 1).to(tl.int64)
        r = row0 + node + 1
        src = tl.load(src_table_ptr + space * table_stride + r).to(tl.int64)
        dst = tl.load(dst_table_ptr + space * table_stride + r).to(tl.int64)
        if (src >= 0) & (src != dst):
            vals = tl.load(_row_ptr(base, src, page_slots, page_stride, slot_stride) + cols, mask=cmask)
            tl.store(_row_ptr(base, dst, page_slots, page_stride, slot_stride) + cols, vals, mask=cmask)
        # step k's copy lands before step k + 1 reads (per-token rows compact in place)
        tl.debug_barrier()


@triton.jit
def dsv4_copy_rows_kernel(
    items_ptr,  # [I, 2] int32: (descriptor, first word)
    desc_ptr,  # [D, 10] int64 descriptors
    src_ptr,  # [K] int64 source slots (-1 = skip the pair)
    dst_ptr,  # [K] int64 destination slots
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    it = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + p).to(tl.int64)
    if src < 0:
        return
    dst = tl.load(dst_ptr + p).to(tl.int64)
    d = tl.load(items_ptr + it * 2).to(tl.int64)
    w0 = tl.load(items_ptr + it * 2 + 1).to(tl.int64)
    dp = desc_ptr + d * 10
    src_base = tl.load(dp + 1).to(tl.pointer_type(tl.int32))
    dst_base = tl.load(dp + 5).to(tl.pointer_type(tl.int32))
    cols = w0 + tl.arange(0, BLOCK).to(tl.int64)
    cmask = cols < tl.load(dp + 9)
    vals = tl.load(_row_ptr(src_base, src, tl.load(dp + 4), tl.load(dp + 2), tl.load(dp + 3)) + cols, mask=cmask)
    tl.store(_row_ptr(dst_base, dst, tl.load(dp + 8), tl.load(dp + 6), tl.load(dp + 7)) + cols, vals, mask=cmask)
