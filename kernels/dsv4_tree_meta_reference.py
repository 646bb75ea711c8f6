"""DeepSeek-V4 tree metadata (per-row index lists): the semantics and PyTorch twins.

This module defines what the Triton kernels compute: the per-row tree arrays (`DSV4TreeRows`), the
slot lists below, and a PyTorch twin (`*_reference`) of every kernel. The kernels
are in `dsv4_tree_meta.py`, their launchers in `dsv4_tree_meta_launch.py`; nothing here imports
Triton. The semantics are the reference model's `tree` policy
(`vllm_tree_spec/reference/dsv4_plan.py::build_plan`); the tests check the twins
against `build_plan` and the kernels against the twins, integer lists exactly.

Rows (`DSV4TreeRows`)
---------------------
A step has R flattened query rows. Request b's rows are its root (the last
sampled token, whose rows are not in the cache yet) at position P = `start[b]`
(its committed length) and its draft nodes at P + depth, flattened
request-major (`TreeBatch` order: row 0 = root, row i + 1 = node i). Per row:

    row_req[r]      request b of the row            (vLLM: token_to_req_indices)
    parent_rows[r]  flattened row of its parent, -1 for a root
    depth[r]        0 for a root
    t = start[row_req[r]] + depth[r]                the row's position

A chain (prefill, decode, linear speculation) is a tree whose rows are each
other's parents, so mixed batches need no special case.

Slot spaces
-----------
Every store is read through explicit slot lists (as vLLM's sparse kernels do).
A list mixes two kinds of slot:

    committed   a position p < P (or entry w < c) of request b, through a block table:
                    slot = block_table[b, p // block_size] * block_size + p % block_size
    row-owned   the slot a tree row itself owns in that store: `row_slots[r]` for per-token rows
                (vLLM: the row's `slot_mapping`), `row_entry_slots[r]` for its compressed entry
                (vLLM: a scratch slot reserved for the step)

The reference model's virtual slot space is the special case
`block_table = arange(B)[:, None]`, `block_size = S` (so slot = b * S + p) and
`row_slots = B * S + arange(R)` (scratch row r); entries use S // m.

Lists (PAD_SLOT = -1 everywhere)
--------------------------------
window (`tree_window_slots_*`), [R, out_width], out_width >= W, plus lens [R] = min(t + 1, W):
    the W positions t - W + 1 .. t of the row's window along its ancestor path; position
    p < P is committed, p >= P is the row-owned slot of the ancestor-or-self at depth p - P.
    align="left"      vLLM's `decode_swa_indices` / CPU `window_slots` layout: column j holds
                      position max(t - W + 1, 0) + j for j < lens, -1 after (and in columns >= W).
    align="position"  the reference layout (`StepPlan.window`, and a compressor's `gather`):
                      column j holds position t - W + 1 + j, -1 where that is < 0.
    Use "left" with W = 128 for the SWA attention list, "position" with W = coff * m for the
    compressor pooling window (its column index says which a/b half a row contributes).

entries (`tree_entry_slots_*`, one compress ratio m), all per row:
    lens       nv = (t + 1) // m: entry w is visible iff w < floor((t + 1) / m)
    committed  c = min(P // m, nv) (reference: the root's entry lives in scratch), or
               c = min((P + 1) // m, nv) with root_committed=True (the vLLM integration's
               `plan.py` convention: the root, always committed, writes its canonical slot)
    dense      [R, dense_width]: column w = slot of entry w for w < nv, -1 after.
               w < c: committed (entry block table, `entries_per_block` entries per block);
               c <= w < nv: row_entry_slots of the ancestor-or-self at position (w + 1) m - 1.
               = `RatioPlan.entries` of the reference; vLLM's C128A
               `c128a_global_decode_topk_indices` layout (with lens = `c128a_decode_topk_lens`);
               for CSA the local -> global map of the indexer's top-k ids.
    tail       [R, tail_width]: the path part only, column i = slot of entry c + i (-1 past nv);
               tail_width >= ceil((max_depth + 1) / m) holds every path entry. Together with
               `committed` it is the compact form `tree_topk_slots_*` maps CSA top-k ids with.
    write      [R]: the entry slot the row writes, iff (t + 1) % m == 0: its row_entry_slots
               (or, with root_committed, the canonical slot for a root), else -1.
               = the compressor's output slot mapping (reference `RatioPlan.entry_write`).

top-k (`tree_topk_slots_*`): CSA indexer local ids [R, K] (-1 padded) -> global entry slots
    [R, K] + lens [R] (count of selected ids), w < c through the block table, else tail[r, w - c].
    The tree-aware replacement of vLLM's `compute_global_topk_indices_and_lens`.

The accepted-path commit on vLLM's layout is the refresh of `dsv4_refresh_launch.py` (slot-row copies
from per-row source / destination tables the NVIDIA adapter builds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

PAD_SLOT = -1
Align = Literal["left", "position"]


# ---------------------------------------------------------------------------
# Rows


@dataclass(frozen=True)
class DSV4TreeRows:
    """The tree structure of one step as per-row arrays (see the module docstring)."""

    row_req: torch.Tensor  # [R] request of each row
    parent_rows: torch.Tensor  # [R] flattened parent row, -1 for a root
    depth: torch.Tensor  # [R] 0 for a root
    start: torch.Tensor  # [B] P = root position = committed tokens
    cu_num_rows: torch.Tensor  # [B + 1] row offsets (a request's rows are contiguous, root first)
    max_depth: int  # host copy of depth.max() (loop bounds without a device sync)

    @property
    def num_rows(self) -> int:
        return self.row_req.numel()

    @property
    def batch_size(self) -> int:
        return self.start.numel()

    @property
    def positions(self) -> torch.Tensor:
        """[R] P + depth."""
        return self.start.to(torch.long)[self.row_req.to(torch.long)] + self.depth.to(torch.long)

    @staticmethod
    def from_parents(
        local_parents: Sequence[Sequence[int]], starts: Sequence[int], device=None, dtype=torch.int32
    ) -> "DSV4TreeRows":
        """From each request's local row parents (row 0 = root with parent -1; reference `Segment.parents`)."""
        row_req, parents, depth, cu = [], [], [], [0]
        for b, par in enumerate(local_parents):
            base = cu[-1]
            d: list[int] = []
            for i, p in enumerate(par):
                if (p == -1) != (i == 0) or p >= i:
                    raise ValueError(f"request {b}: local parents {list(par)} must start with the root (-1) and "
                                     f"list every parent before its children")  # fmt: skip
                d.append(0 if p == -1 else d[p] + 1)
                parents.append(-1 if p == -1 else base + p)
                row_req.append(b)
            depth += d
            cu.append(base + len(par))
        if len(starts) != len(local_parents):
            raise ValueError(f"{len(local_parents)} requests but {len(starts)} start positions")

        def t(x):
            return torch.tensor(x, dtype=dtype, device=device)

        return DSV4TreeRows(t(row_req), t(parents), t(depth), t(list(starts)), t(cu), max(depth, default=0))

    @staticmethod
    def from_tree_batch(batch, starts: Sequence[int] | torch.Tensor, device=None, dtype=torch.int32) -> "DSV4TreeRows":
        """From a `vllm_tree_spec.tree.TreeBatch` (rows: root, then the nodes) and each request's P."""
        starts = [int(s) for s in (starts.tolist() if isinstance(starts, torch.Tensor) else starts)]
        return DSV4TreeRows.from_parents([[-1] + [p + 1 for p in t.parents.tolist()] for t in batch.trees], starts,
                                         device, dtype)  # fmt: skip


def _ancestors(rows: DSV4TreeRows, steps: int) -> torch.Tensor:
    """[R, steps] int64: column k = the row's k-th ancestor (0 = itself), -1 past its root."""
    r = rows.num_rows
    depth, parent = rows.depth.long(), rows.parent_rows.long()
    anc = torch.full((r, max(steps, 1)), PAD_SLOT, dtype=torch.long, device=depth.device)
    cur = torch.arange(r, device=depth.device)
    for k in range(steps):
        anc[:, k] = torch.where(k <= depth, cur, PAD_SLOT)
        cur = torch.where(k < depth, parent[cur].clamp(min=0), cur)
    return anc


def _block_slots(block_table: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, block_size: int,
                 valid: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """block_table[b, idx // bs] * bs + idx % bs where valid, -1 elsewhere (idx may be out of range there)."""
    bt = block_table.long()
    i = torch.where(valid, idx, torch.zeros_like(idx))
    blk = bt[b.expand_as(i), (i // block_size).clamp(0, bt.shape[1] - 1)]
    return torch.where(valid, blk * block_size + i % block_size, torch.full_like(i, PAD_SLOT))


# ---------------------------------------------------------------------------
# PyTorch twins


def tree_window_slots_reference(
    rows: DSV4TreeRows,
    row_slots: torch.Tensor,  # [R] slot of each row's own token in this store
    block_table: torch.Tensor,  # [B, max_blocks] committed positions
    block_size: int,
    window: int,
    *,
    align: Align = "left",
    out_width: int | None = None,
    out_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window slot list along each row's ancestor path -> (slots [R, out_width], lens [R] int32)."""
    out_width = window if out_width is None else out_width
    b = rows.row_req.long()
    depth = rows.depth.long()
    P = rows.start.long()[b]
    t = P + depth
    first = (t - window + 1).clamp(min=0)
    lo = first if align == "left" else t - window + 1
    cols = torch.arange(out_width, device=t.device)
    p = lo[:, None] + cols[None, :]  # [R, out_width]
    in_win = (p >= first[:, None]) & (p <= t[:, None]) & (cols[None, :] < window)
    committed = in_win & (p < P[:, None])
    slot_c = _block_slots(block_table, b[:, None], p, block_size, committed)
    steps = min(rows.max_depth, window - 1) + 1
    anc = _ancestors(rows, steps)
    k = (t[:, None] - p).clamp(0, steps - 1)
    src = anc.gather(1, k)
    slot_t = row_slots.long()[src.clamp(min=0)]
    on_path = in_win & ~committed
    out = torch.where(committed, slot_c, torch.where(on_path, slot_t, torch.full_like(slot_c, PAD_SLOT)))
    return out.to(out_dtype), (t - first + 1).to(torch.int32)


@dataclass
class TreeEntrySlots:
    """Entry lists of one compress ratio for every row (module docstring, "entries")."""

    dense: torch.Tensor | None  # [R, dense_width] slot of entry w (column w), -1 when not visible
    tail: torch.Tensor  # [R, tail_width] slot of entry committed + i
    lens: torch.Tensor  # [R] int32 visible entries (t + 1) // m
    committed: torch.Tensor  # [R] int32 entries resolved through the block table
    write: torch.Tensor  # [R] entry slot written by the row, -1 if its position completes no block


def tail_width_for(max_depth: int, ratio: int) -> int:
    """Columns that hold every path entry of a row at depth <= max_depth (positions P .. P + max_depth)."""
    return max(1, -(-(max_depth + 1) // ratio))


def tree_entry_slots_reference(
    rows: DSV4TreeRows,
    row_entry_slots: torch.Tensor,  # [R] scratch entry slot owned by each row
    block_table: torch.Tensor,  # [B, max_blocks] committed entries
    entries_per_block: int,
    ratio: int,
    *,
    root_committed: bool = False,
    dense_width: int | None = None,  # None: no dense list
    tail_width: int | None = None,
    out_dtype: torch.dtype = torch.int32,
) -> TreeEntrySlots:
    """Compressed-entry lists of one ratio m along each row's ancestor path (module docstring)."""
    tail_width = tail_width_for(rows.max_depth, ratio) if tail_width is None else tail_width
    b = rows.row_req.long()
    depth = rows.depth.long()
    P = rows.start.long()[b]
    t = P + depth
    nv = (t + 1) // ratio
    c = torch.minimum((P + 1) // ratio if root_committed else P // ratio, nv)
    emits = (t + 1) % ratio == 0
    own = row_entry_slots.long()
    if root_committed:
        canon = _block_slots(block_table, b, nv - 1, entries_per_block, emits & (depth == 0))
        own = torch.where(depth == 0, canon, own)
    write = torch.where(emits, own, torch.full_like(own, PAD_SLOT))
    anc = _ancestors(rows, rows.max_depth + 1)

    def resolve(w: torch.Tensor) -> torch.Tensor:  # w [R, n] entry ids
        committed = (w < c[:, None]) & (w >= 0)
        on_path = (w >= c[:, None]) & (w < nv[:, None])
        slot_c = _block_slots(block_table, b[:, None], w, entries_per_block, committed)
        k = (t[:, None] - ((w + 1) * ratio - 1)).clamp(0, anc.shape[1] - 1)
        slot_t = row_entry_slots.long()[anc.gather(1, k).clamp(min=0)]
        return torch.where(committed, slot_c, torch.where(on_path, slot_t, torch.full_like(slot_c, PAD_SLOT)))

    dense = None
    if dense_width is not None:
        dense = resolve(torch.arange(dense_width, device=t.device)[None, :].expand(t.numel(), -1)).to(out_dtype)
    tail = resolve(c[:, None] + torch.arange(tail_width, device=t.device)[None, :]).to(out_dtype)
    return TreeEntrySlots(dense, tail, nv.to(torch.int32), c.to(torch.int32), write.to(out_dtype))


def tree_topk_slots_reference(
    rows: DSV4TreeRows,
    topk: torch.Tensor,  # [R, K] local entry ids (-1 = none)
    entries: TreeEntrySlots,
    block_table: torch.Tensor,  # [B, max_blocks] committed entries
    entries_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA top-k local ids -> (global entry slots [R, K], lens [R] int32)."""
    b = rows.row_req.long()[:, None]
    w = topk.long()
    c = entries.committed.long()[:, None]
    committed = (w >= 0) & (w < c)
    i = w - c
    on_path = (w >= c) & (i < entries.tail.shape[1])
    slot_c = _block_slots(block_table, b, w, entries_per_block, committed)
    slot_t = entries.tail.long().gather(1, i.clamp(0, entries.tail.shape[1] - 1))
    out = torch.where(committed, slot_c, torch.where(on_path, slot_t, torch.full_like(w, PAD_SLOT)))
    return out.to(topk.dtype), (out >= 0).sum(1).to(torch.int32)
