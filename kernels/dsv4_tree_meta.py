"""Triton kernels for DeepSeek-V4 tree metadata: per-row index lists (`@triton.jit` code only).

Typed launchers are in `vllm_tree_spec.kernels.dsv4_tree_meta_launch`; every
list is defined precisely, beside its PyTorch twin, in
`vllm_tree_spec.kernels.dsv4_tree_meta_reference`; the semantics are those of
the reference model's `tree` policy (`vllm_tree_spec/reference/dsv4_plan.py`).

Rows. A step holds R flattened query rows; a request's rows are its root (the
last sampled token, position P = committed length) and its draft nodes at
P + depth. Every kernel here sees the tree as three per-row arrays
(`row_req`, `parent_rows` = flattened parent row or -1, `depth`) plus
`start[b]` = P, so it never needs the request's row offset and any mix of
trees and chains (prefill, decode) is one layout.

Slot resolution (the whole idea). Position p of row r's context is

    p <  P    a committed row:          block_table[b, p // bs] * bs + p % bs
    p >= P    the row's ancestor-or-self at depth p - P: that row's own slot

and entry w (ratio m) of row r, with c = committed entries of r, is

    w <  c    committed:                entry_block_table[b, w // epb] * epb + w % epb
    w >= c    the scratch entry of the ancestor-or-self at position (w + 1) m - 1

Walks. A program owns BLOCK_R rows (vectorised, rows of different requests
mixed) and walks their ancestor chains together, k = 0, 1, ... (k-th ancestor
at position t - k), storing the path part of each list as it goes; the
committed part is one 2-D block-table gather. The two parts cover disjoint
columns, so no ordering between the stores is needed.

All program ids are widened to int64 before address arithmetic; runtime sizes
that change every step are `do_not_specialize`.
"""

import triton
import triton.language as tl


# Sizes that change with the batch must not trigger recompiles.
@triton.jit(do_not_specialize=["num_rows", "window", "num_steps", "out_width", "block_size", "stride_bt",
                               "stride_out"])  # fmt: skip
def tree_window_slots_kernel(
    out_ptr,  # [R, out_width] int32/int64 slot list of every row (-1 = none)
    lens_ptr,  # [R] int32 valid entries per row (min(t + 1, window))
    row_req_ptr,  # [R] request index of every row
    parent_ptr,  # [R] flattened parent row, -1 for a root
    depth_ptr,  # [R] depth below the request's root (root: 0)
    start_ptr,  # [B] P: position of the root = committed tokens of the request
    row_slots_ptr,  # [R] the store's slot of every row's own token (tree rows' private rows)
    block_table_ptr,  # [B, max_blocks] committed rows: slot(p) = bt[b, p // bs] * bs + p % bs
    num_rows,
    window,  # W (SWA window, or coff * m for a compressor's pooling window)
    num_steps,  # min(max depth, W - 1) + 1: ancestors to walk
    out_width,  # columns of out (>= W; the extra ones are -1)
    block_size,
    stride_bt,
    stride_out,
    LEFT_ALIGN: tl.constexpr,  # True: column j <-> position max(t-W+1, 0) + j (vLLM); False: t-W+1+j (reference)
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < num_rows
    b = tl.load(row_req_ptr + rows, mask=rmask, other=0).to(tl.int64)
    depth = tl.load(depth_ptr + rows, mask=rmask, other=0).to(tl.int64)
    P = tl.load(start_ptr + b, mask=rmask, other=0).to(tl.int64)
    t = P + depth  # [BLOCK_R] positions
    first = tl.maximum(t - window + 1, 0)  # oldest position in the window
    if LEFT_ALIGN:
        lo = first
    else:
        lo = t - window + 1
    tl.store(lens_ptr + rows, (t - first + 1).to(tl.int32), mask=rmask)

    # committed rows (p < P) and padding, column tile by column tile
    for c0 in range(0, out_width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W).to(tl.int64)
        pc = lo[:, None] + cols[None, :]  # [BLOCK_R, BLOCK_W] positions
        in_win = (pc >= first[:, None]) & (pc <= t[:, None]) & (cols[None, :] < window)
        committed = in_win & (pc < P[:, None])
        blk = tl.load(block_table_ptr + b[:, None] * stride_bt + pc // block_size,
                      mask=committed & rmask[:, None], other=0).to(tl.int64)  # fmt: skip
        cslot = tl.where(committed, blk * block_size + pc % block_size, -1)
        on_path = in_win & (pc >= P[:, None])
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], cslot.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols[None, :] < out_width) & ~on_path)  # fmt: skip

    # the path: the k-th ancestor (k = 0: the row itself) sits at position t - k >= P
    cur = rows
    for k in range(0, num_steps):
        p = t - k
        ok = rmask & (k <= depth) & (p >= first)
        slot = tl.load(row_slots_ptr + cur, mask=ok, other=-1)
        tl.store(out_ptr + rows * stride_out + (p - lo), slot.to(out_ptr.dtype.element_ty), mask=ok)
        cur = tl.load(parent_ptr + cur, mask=ok & (k < depth), other=0).to(tl.int64)


@triton.jit(do_not_specialize=["num_rows", "ratio", "num_steps", "dense_width", "tail_width", "entries_per_block",
                               "stride_bt", "stride_dense", "stride_tail"])  # fmt: skip
def tree_entry_slots_kernel(
    dense_ptr,  # [R, dense_width] slot of entry w for row r (column w), -1 when not visible (HAS_DENSE)
    tail_ptr,  # [R, tail_width] slot of entry committed[r] + i (the row's path entries), -1 after
    lens_ptr,  # [R] int32 visible entries nv = (t + 1) // m
    committed_ptr,  # [R] int32 c: entries w < c resolve through the block table
    write_ptr,  # [R] entry slot the row writes (its position completes a block), else -1
    row_req_ptr,  # [R]
    parent_ptr,  # [R] flattened parent row, -1 for a root
    depth_ptr,  # [R]
    start_ptr,  # [B] P
    row_entry_slots_ptr,  # [R] scratch entry slot owned by every row
    block_table_ptr,  # [B, max_blocks] committed entries: slot(w) = bt[b, w // epb] * epb + w % epb
    num_rows,
    ratio,  # m
    num_steps,  # max depth + 1
    dense_width,
    tail_width,
    entries_per_block,
    stride_bt,
    stride_dense,
    stride_tail,
    ROOT_COMMITTED: tl.constexpr,  # True: the root's own entry is written to / read from its canonical slot
    HAS_DENSE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < num_rows
    b = tl.load(row_req_ptr + rows, mask=rmask, other=0).to(tl.int64)
    depth = tl.load(depth_ptr + rows, mask=rmask, other=0).to(tl.int64)
    P = tl.load(start_ptr + b, mask=rmask, other=0).to(tl.int64)
    t = P + depth
    nv = (t + 1) // ratio  # entry w is visible iff w < floor((t + 1) / m)
    if ROOT_COMMITTED:
        c = tl.minimum((P + 1) // ratio, nv)
    else:
        c = tl.minimum(P // ratio, nv)
    tl.store(lens_ptr + rows, nv.to(tl.int32), mask=rmask)
    tl.store(committed_ptr + rows, c.to(tl.int32), mask=rmask)

    emits = ((t + 1) % ratio) == 0
    own = tl.load(row_entry_slots_ptr + rows, mask=rmask & emits, other=-1).to(tl.int64)
    if ROOT_COMMITTED:
        w_own = nv - 1
        root_emits = rmask & emits & (depth == 0)
        rblk = tl.load(block_table_ptr + b * stride_bt + w_own // entries_per_block, mask=root_emits,
                       other=0).to(tl.int64)  # fmt: skip
        canon = rblk * entries_per_block + w_own % entries_per_block
        own = tl.where(depth == 0, canon, own)
    write = tl.where(emits, own, -1)
    tl.store(write_ptr + rows, write.to(write_ptr.dtype.element_ty), mask=rmask)

    if HAS_DENSE:  # committed entries and padding (path entries w in [c, nv) come from the walk)
        for k0 in range(0, dense_width, BLOCK_K):
            wd = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            dcommitted = (wd[None, :] < c[:, None]) & rmask[:, None]
            dblk = tl.load(block_table_ptr + b[:, None] * stride_bt + wd[None, :] // entries_per_block,
                           mask=dcommitted, other=0).to(tl.int64)  # fmt: skip
            dslot = tl.where(dcommitted, dblk * entries_per_block + wd[None, :] % entries_per_block, -1)
            don_path = (wd[None, :] >= c[:, None]) & (wd[None, :] < nv[:, None])
            tl.store(dense_ptr + rows[:, None] * stride_dense + wd[None, :], dslot.to(dense_ptr.dtype.element_ty),
                     mask=rmask[:, None] & (wd[None, :] < dense_width) & ~don_path)  # fmt: skip
    for i0 in range(0, tail_width, BLOCK_TAIL):
        i = i0 + tl.arange(0, BLOCK_TAIL).to(tl.int64)
        pad = (c[:, None] + i[None, :]) >= nv[:, None]
        tl.store(tail_ptr + rows[:, None] * stride_tail + i[None, :], tl.full([BLOCK_R, BLOCK_TAIL], -1,
                 tail_ptr.dtype.element_ty), mask=rmask[:, None] & (i[None, :] < tail_width) & pad)  # fmt: skip

    # the path: an ancestor-or-self at position p with (p + 1) % m == 0 completed entry (p + 1) / m - 1
    cur = rows
    for k in range(0, num_steps):
        p = t - k
        ok = rmask & (k <= depth)
        w = (p + 1) // ratio - 1
        hit = ok & (((p + 1) % ratio) == 0) & (w >= c)
        pslot = tl.load(row_entry_slots_ptr + cur, mask=hit, other=-1)
        if HAS_DENSE:
            tl.store(dense_ptr + rows * stride_dense + w, pslot.to(dense_ptr.dtype.element_ty),
                     mask=hit & (w < dense_width))  # fmt: skip
        tl.store(tail_ptr + rows * stride_tail + (w - c), pslot.to(tail_ptr.dtype.element_ty),
                 mask=hit & ((w - c) < tail_width))  # fmt: skip
        cur = tl.load(parent_ptr + cur, mask=ok & (k < depth), other=0).to(tl.int64)


@triton.jit(do_not_specialize=["topk", "tail_width", "entries_per_block", "stride_topk", "stride_out", "stride_bt",
                               "stride_tail"])  # fmt: skip
def tree_topk_slots_kernel(
    out_ptr,  # [R, topk] global entry slots of the selected entries, -1 kept
    lens_ptr,  # [R] int32 selected (>= 0) entries per row
    topk_ptr,  # [R, topk] local entry ids chosen by the indexer (w), -1 = none
    committed_ptr,  # [R] c from tree_entry_slots_kernel
    tail_ptr,  # [R, tail_width] path entries from tree_entry_slots_kernel
    row_req_ptr,  # [R]
    block_table_ptr,  # [B, max_blocks] committed entries
    topk,
    tail_width,
    entries_per_block,
    stride_topk,
    stride_out,
    stride_bt,
    stride_tail,
    BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    b = tl.load(row_req_ptr + r).to(tl.int64)
    c = tl.load(committed_ptr + r).to(tl.int64)
    count = tl.zeros((), dtype=tl.int32)
    for k0 in range(0, topk, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        jm = j < topk
        w = tl.load(topk_ptr + r * stride_topk + j, mask=jm, other=-1).to(tl.int64)
        committed = jm & (w >= 0) & (w < c)
        on_path = jm & (w >= c) & ((w - c) < tail_width)
        blk = tl.load(block_table_ptr + b * stride_bt + w // entries_per_block, mask=committed, other=0).to(tl.int64)
        from_tail = tl.load(tail_ptr + r * stride_tail + (w - c), mask=on_path, other=-1).to(tl.int64)
        slot = tl.where(committed, blk * entries_per_block + w % entries_per_block, from_tail)
        tl.store(out_ptr + r * stride_out + j, slot.to(out_ptr.dtype.element_ty), mask=jm)
        count += tl.sum((slot >= 0).to(tl.int32), axis=0)
    tl.store(lens_ptr + r, count)
