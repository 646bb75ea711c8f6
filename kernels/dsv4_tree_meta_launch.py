"""DeepSeek-V4 tree metadata (per-row index lists): the Triton launchers.

Kernels in `dsv4_tree_meta.py`; what they compute (rows, slot spaces, the window, entry and top-k
lists) is stated in `dsv4_tree_meta_reference.py`, beside the PyTorch twin of each kernel.
Each launcher checks its arguments (device, index dtypes, contiguity, widths) with errors that name
the fix, sizes the tiles and launches once, with no host synchronisation. Triton is imported lazily
inside the `*_triton` launchers. The rows and the twins are re-exported here, so one import serves
a caller that launches a kernel and checks it against its twin.
"""

from __future__ import annotations

import os
import torch

from .dsv4_tree_meta_reference import (
    PAD_SLOT,
    Align,
    DSV4TreeRows,
    TreeEntrySlots,
    tail_width_for,
    tree_entry_slots_reference,
    tree_topk_slots_reference,
    tree_window_slots_reference,
)

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_device(device: torch.device, what: str) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            f"the Triton {what} kernel needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before "
            f"importing triton, or use the *_reference twin")  # fmt: skip


def _check_index(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    if t.dtype not in _INDEX_DTYPES or t.dim() != dim:
        raise TypeError(f"{name} must be a {dim}-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device}")
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")


def _check_rows(rows: DSV4TreeRows, device: torch.device) -> None:
    for name in ("row_req", "parent_rows", "depth", "start", "cu_num_rows"):
        _check_index(name, getattr(rows, name), 1, device)
    r = rows.num_rows
    if rows.parent_rows.numel() != r or rows.depth.numel() != r or rows.cu_num_rows.numel() != rows.batch_size + 1:
        raise ValueError("DSV4TreeRows arrays disagree in length (row_req / parent_rows / depth: [R], "
                         "start: [B], cu_num_rows: [B + 1])")  # fmt: skip


def _rows_block(num_rows: int, cols: int) -> int:
    """Rows per program: the 2-D [rows, cols] int64 tiles stay at <= 2048 elements (no register spills
    at 4 warps on sm_90; checked with ptxas)."""
    import triton

    return max(1, min(64, triton.next_power_of_2(max(num_rows, 1)), 2048 // cols))


def tree_window_slots_triton(
    rows: DSV4TreeRows,
    row_slots: torch.Tensor,  # [R] int32/int64
    block_table: torch.Tensor,  # [B, max_blocks] int32/int64
    block_size: int,
    window: int,
    *,
    align: Align = "left",
    out_width: int | None = None,
    out_dtype: torch.dtype = torch.int32,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # preallocated (slots [R, out_width], lens [R] int32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window slot list of every row along its ancestor path (`dsv4_tree_meta_reference`, "window"); one launch.

    For row r at t = P + depth, column j of `slots` holds position
    p = max(t - W + 1, 0) + j (align="left") or t - W + 1 + j (align="position"):
    `block_table` slot of p if p < P, else `row_slots` of the row's ancestor-or-self
    at depth p - P; -1 for p < 0, p > t and columns >= W. `lens` = min(t + 1, W).
    No host synchronisation (`rows.max_depth` is a host int).
    """
    from .dsv4_tree_meta import tree_window_slots_kernel

    device = row_slots.device
    _check_device(device, "window-slot")
    _check_rows(rows, device)
    _check_index("row_slots", row_slots, 1, device)
    _check_index("block_table", block_table, 2, device)
    if align not in ("left", "position"):
        raise ValueError(f"align must be 'left' or 'position', got {align!r}")
    if window < 1 or block_size < 1:
        raise ValueError(f"window ({window}) and block_size ({block_size}) must be >= 1")
    out_width = window if out_width is None else out_width
    if out_width < window:
        raise ValueError(f"out_width = {out_width} < window = {window}")
    r = rows.num_rows
    if out is None:
        slots = torch.empty(r, out_width, dtype=out_dtype, device=device)
        lens = torch.empty(r, dtype=torch.int32, device=device)
    else:
        slots, lens = out
        if slots.shape != (r, out_width) or lens.shape != (r,) or slots.stride(1) != 1:
            raise ValueError(f"out must be ([R, out_width] = [{r}, {out_width}] row-contiguous, [R])")
    if r == 0:
        return slots, lens
    import triton

    block_w = min(128, triton.next_power_of_2(out_width))
    block_r = _rows_block(r, block_w)
    grid = (triton.cdiv(r, block_r),)
    tree_window_slots_kernel[grid](
        slots, lens, rows.row_req, rows.parent_rows, rows.depth, rows.start, row_slots, block_table,
        r, window, min(rows.max_depth, window - 1) + 1, out_width, block_size, block_table.stride(0),
        slots.stride(0),
        LEFT_ALIGN=align == "left",
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        num_warps=4,
    )  # fmt: skip
    return slots, lens


def tree_entry_slots_triton(
    rows: DSV4TreeRows,
    row_entry_slots: torch.Tensor,  # [R] int32/int64
    block_table: torch.Tensor,  # [B, max_blocks] int32/int64, committed entries
    entries_per_block: int,
    ratio: int,
    *,
    root_committed: bool = False,
    dense_width: int | None = None,
    tail_width: int | None = None,
    out_dtype: torch.dtype = torch.int32,
    dense_out: torch.Tensor | None = None,  # preallocated [R, dense_width] (rows contiguous; e.g. vLLM's buffer)
    lens_out: torch.Tensor | None = None,  # preallocated [R] int32
) -> TreeEntrySlots:
    """Entry lists of one compress ratio (`dsv4_tree_meta_reference`, "entries"); one launch, no host sync.

    Per row (t = P + depth, nv = (t + 1) // m, c = min(P // m, nv), or
    min((P + 1) // m, nv) with root_committed): `dense[r, w]` / `tail[r, w - c]` =
    committed slot for w < c, `row_entry_slots` of the ancestor-or-self at
    position (w + 1) m - 1 for c <= w < nv, -1 after; `write[r]` = the row's
    entry slot iff (t + 1) % m == 0, else -1. `dense_out` / `lens_out` write the dense
    list and the lengths straight into caller buffers (any row stride).
    """
    from .dsv4_tree_meta import tree_entry_slots_kernel

    device = row_entry_slots.device
    _check_device(device, "entry-slot")
    _check_rows(rows, device)
    _check_index("row_entry_slots", row_entry_slots, 1, device)
    _check_index("block_table", block_table, 2, device)
    if ratio < 1 or entries_per_block < 1:
        raise ValueError(f"ratio ({ratio}) and entries_per_block ({entries_per_block}) must be >= 1")
    tail_width = tail_width_for(rows.max_depth, ratio) if tail_width is None else tail_width
    if tail_width < tail_width_for(rows.max_depth, ratio):
        raise ValueError(f"tail_width = {tail_width} cannot hold the path entries of depth {rows.max_depth} "
                         f"(need {tail_width_for(rows.max_depth, ratio)})")  # fmt: skip
    r = rows.num_rows

    def new(*shape, dtype=out_dtype):
        return torch.empty(*shape, dtype=dtype, device=device)

    if dense_out is not None and (dense_width is None or dense_out.shape != (r, dense_width)
                                  or dense_out.stride(1) != 1 or dense_out.device != device):
        raise ValueError(f"dense_out must be a [R, dense_width] = [{r}, {dense_width}] tensor with contiguous rows "
                         f"on {device}")
    if lens_out is not None and (lens_out.shape != (r,) or lens_out.dtype != torch.int32):
        raise ValueError(f"lens_out must be a [R] = [{r}] int32 tensor")
    dense = dense_out if dense_out is not None else new(r, dense_width) if dense_width is not None else None
    res = TreeEntrySlots(dense, new(r, tail_width), lens_out if lens_out is not None else new(r, dtype=torch.int32),
                         new(r, dtype=torch.int32), new(r))  # fmt: skip
    if r == 0:
        return res
    import triton

    block_k = min(128, triton.next_power_of_2(max(dense_width or 1, 1)))
    block_tail = triton.next_power_of_2(tail_width)
    block_r = _rows_block(r, max(block_k if dense_width else 1, block_tail))
    dense = res.dense if res.dense is not None else res.tail  # placeholder pointer when HAS_DENSE is off
    grid = (triton.cdiv(r, block_r),)
    tree_entry_slots_kernel[grid](
        dense, res.tail, res.lens, res.committed, res.write, rows.row_req, rows.parent_rows, rows.depth, rows.start,
        row_entry_slots, block_table,
        r, ratio, rows.max_depth + 1, dense_width or 0, tail_width, entries_per_block, block_table.stride(0),
        dense.stride(0), res.tail.stride(0),
        ROOT_COMMITTED=root_committed,
        HAS_DENSE=res.dense is not None,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        BLOCK_TAIL=block_tail,
        num_warps=4,
    )  # fmt: skip
    return res


def tree_topk_slots_triton(
    rows: DSV4TreeRows,
    topk: torch.Tensor,  # [R, K] int32/int64 local entry ids, -1 = none
    entries: TreeEntrySlots,
    block_table: torch.Tensor,
    entries_per_block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-aware `compute_global_topk_indices_and_lens`: local ids -> (global slots [R, K], lens [R] int32).

    w < committed[r]: block-table slot; committed[r] <= w: tail[r, w - committed[r]]; -1 stays -1.
    One program per row.
    """
    from .dsv4_tree_meta import tree_topk_slots_kernel

    device = topk.device
    _check_device(device, "top-k slot")
    _check_index("topk", topk, 2, device)
    _check_index("block_table", block_table, 2, device)
    r, k = topk.shape
    if out is None:
        slots = torch.empty_like(topk)
        lens = torch.empty(r, dtype=torch.int32, device=device)
    else:
        slots, lens = out
    if r == 0:
        return slots, lens
    import triton

    tree_topk_slots_kernel[(r,)](
        slots, lens, topk, entries.committed, entries.tail, rows.row_req, block_table,
        k, entries.tail.shape[1], entries_per_block, topk.stride(0), slots.stride(0), block_table.stride(0),
        entries.tail.stride(0),
        BLOCK_K=min(1024, triton.next_power_of_2(max(k, 1))),
        num_warps=4,
    )  # fmt: skip
    return slots, lens


__all__ = [
    "PAD_SLOT",
    "DSV4TreeRows",
    "TreeEntrySlots",
    "tail_width_for",
    "tree_entry_slots_reference",
    "tree_entry_slots_triton",
    "tree_topk_slots_reference",
    "tree_topk_slots_triton",
    "tree_window_slots_reference",
    "tree_window_slots_triton",
]
