"""Slot-row copies for DeepSeek-V4 tree steps on vLLM's NVIDIA path: planes, descriptor tables, launchers, twins.

Kernels in `dsv4_refresh.py` (Triton imported lazily). What is copied is described by `Plane`s: one plane of
one layer's paged cache, a row of `row_bytes` per slot at

    byte address = base + (slot // page_slots) * page_stride + (slot % page_slots) * slot_stride

with `page_stride` the cache's own `stride(0)` (vLLM pools every layer's page of a block into one allocation
and pads pages to a multiple of 576 bytes, so the stride is the pooled block, never page_slots * row bytes).
The layouts of vLLM 0.32's DeepSeek-V4 caches (`fp8_ds_mla_planes`, `index_key_planes`, `state_plane`):

    fp8_ds_mla (SWA window KV, C4 / C128 entries), page of bs rows:
        data plane   base + off * 576, 576 bytes (448 e4m3 + 64 bf16 RoPE values)
        scale plane  base + bs * 576 + off * 8, 8 bytes (7 UE8M0 exponents + 1 pad)
    FP8 indexer keys: data base + off * 128 (128 bytes), scale base + bs * 128 + off * 4 (fp32)
    compressor state (float32 [pages, bs, W]): base + off * 4W, 4W bytes

A `CopyPlan` packs (source plane, destination plane, slot space) triples into one descriptor table
(`DESC_FIELDS`, int64 on the device) and work items (descriptor, first word): one launch then moves rows of
every layer and plane, each program one word block of one descriptor. Rows are copied as int32 words (every
DeepSeek-V4 row and plane offset is a multiple of 4 bytes).

    refresh_triton / refresh_reference      accepted-path refresh from per-row slot tables (no host sync)
    copy_rows_triton / copy_rows_reference  a list of (src, dst) slot pairs
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

DESC_FIELDS = ("space", "src_base", "src_page_stride", "src_slot_stride", "src_page_slots", "dst_base",
               "dst_page_stride", "dst_slot_stride", "dst_page_slots", "words")  # strides in int32 words
WORD = 4


@dataclass(frozen=True)
class Plane:
    """One plane of one layer's paged cache (bytes; see the module docstring)."""

    owner: torch.Tensor  # the cache tensor (keeps the storage alive; its device)
    base: int  # byte address of page 0, slot 0 of the plane
    page_stride: int  # bytes between pages (the cache's stride(0) in bytes)
    slot_stride: int  # bytes between slots of one page
    page_slots: int  # slots per page (1: the whole page is one row)
    row_bytes: int

    def byte_view(self) -> torch.Tensor:
        """[num_pages, page_slots, row_bytes] uint8 view of the plane (PyTorch twins, tests)."""
        storage = self.owner.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=self.owner.device).set_(storage)
        offset = self.base - storage.data_ptr()
        num_pages = self.owner.shape[0]
        return torch.as_strided(flat, (num_pages, self.page_slots, self.row_bytes),
                                (self.page_stride, self.slot_stride, 1), offset)


def _page(cache: torch.Tensor) -> tuple[int, int]:
    """(byte address of the cache's first page, page stride in bytes)."""
    if cache.dim() < 2:
        raise ValueError(f"a paged cache needs [num_pages, page_slots, ...], got {tuple(cache.shape)}")
    return cache.data_ptr(), cache.stride(0) * cache.element_size()


def fp8_ds_mla_planes(cache: torch.Tensor) -> tuple[Plane, Plane]:
    """(data, scale) planes of an fp8_ds_mla cache view [num_pages, bs, 584] uint8."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != 584:
        raise ValueError(f"fp8_ds_mla caches are uint8 [num_pages, bs, 584], got {cache.dtype} {tuple(cache.shape)}")
    base, stride = _page(cache)
    bs = cache.shape[1]
    return (Plane(cache, base, stride, 576, bs, 576), Plane(cache, base + bs * 576, stride, 8, bs, 8))


def index_key_planes(cache: torch.Tensor) -> tuple[Plane, Plane]:
    """(values, scale) planes of an FP8 indexer-key cache view [num_pages, bs, 132] uint8."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != 132:
        raise ValueError(f"FP8 indexer caches are uint8 [num_pages, bs, 132], got {cache.dtype} {tuple(cache.shape)}")
    base, stride = _page(cache)
    bs = cache.shape[1]
    return (Plane(cache, base, stride, 128, bs, 128), Plane(cache, base + bs * 128, stride, 4, bs, 4))


def index_page_plane(cache: torch.Tensor) -> Plane:
    """A whole indexer-key page (values then scales) as one row: slot = page id."""
    base, stride = _page(cache)
    return Plane(cache, base, stride, 0, 1, cache.shape[1] * cache.shape[2])


def state_plane(cache: torch.Tensor) -> Plane:
    """A compressor state cache [num_pages, bs, W] float32 (rows contiguous)."""
    if cache.dtype != torch.float32 or cache.dim() != 3 or cache.stride(2) != 1:
        raise ValueError(f"compressor state caches are float32 [num_pages, bs, W] with contiguous rows, got "
                         f"{cache.dtype} {tuple(cache.shape)} strides {cache.stride()}")
    base, stride = _page(cache)
    return Plane(cache, base, stride, cache.stride(1) * 4, cache.shape[1], cache.shape[2] * 4)


@dataclass
class CopyPlan:
    """Descriptors and work items of one family of copies (built once per cache set; reused every step)."""

    planes: list[tuple[Plane, Plane, int]]  # (source, destination, slot space)
    desc: torch.Tensor  # [D, 10] int64
    items: torch.Tensor  # [I, 2] int32
    block: int

    @property
    def num_items(self) -> int:
        return self.items.shape[0]


def build_copy_plan(planes: Sequence[tuple[Plane, Plane, int]], device, block: int | None = None) -> CopyPlan:
    """Pack (source plane, destination plane, slot space) triples; both planes of a triple must have the same
    row width. block: words per work item (default: the widest row, at most 1024 words)."""
    rows = []
    for src, dst, space in planes:
        if src.row_bytes != dst.row_bytes:
            raise ValueError(f"source and destination rows differ ({src.row_bytes} vs {dst.row_bytes} bytes)")
        for p in (src, dst):
            if p.base % WORD or p.page_stride % WORD or p.slot_stride % WORD or p.row_bytes % WORD:
                raise ValueError(f"plane {p} is not 4-byte aligned; rows are copied as int32 words")
        rows.append([space, src.base, src.page_stride // WORD, src.slot_stride // WORD, src.page_slots, dst.base,
                     dst.page_stride // WORD, dst.slot_stride // WORD, dst.page_slots, src.row_bytes // WORD])
    widest = max((r[-1] for r in rows), default=1)
    if block is None:
        block = 1 << max(0, (min(widest, 1024) - 1).bit_length())
    items = [[d, w0] for d, r in enumerate(rows) for w0 in range(0, r[-1], block)]
    desc = torch.tensor(rows or [[0] * len(DESC_FIELDS)], dtype=torch.int64).to(device)
    items_t = torch.tensor(items or [[0, 0]], dtype=torch.int32).to(device)
    return CopyPlan(list(planes), desc, items_t[: len(items)], block)


def _check_device(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"the Triton slot-copy kernels need CUDA tensors (got {device}); on CPU set "
                           f"TRITON_INTERPRET=1 before importing triton, or use the *_reference twins")


def refresh_triton(plan: CopyPlan, src_table: torch.Tensor, dst_table: torch.Tensor, cu_num_rows: torch.Tensor,
                   accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """One launch: for request b and k = 1 .. num_accepted[b], tree row r = cu_num_rows[b] + accepted_nodes[b,
    k - 1] + 1 copies, in every descriptor of slot space s, the row at src_table[s, r] to dst_table[s, r] (in
    place; -1 sources and src == dst skipped; k in order). No host synchronisation."""
    from .dsv4_refresh import dsv4_refresh_kernel

    b = num_accepted.shape[0]
    if b == 0 or plan.num_items == 0:
        return
    _check_device(src_table.device)
    if src_table.shape != dst_table.shape or src_table.dim() != 2 or src_table.stride(1) != 1 \
            or dst_table.stride() != src_table.stride():
        raise ValueError("src_table / dst_table must be [S, R] tensors with the same contiguous rows")
    if accepted_nodes.dim() != 2 or accepted_nodes.shape[0] != b or cu_num_rows.shape[0] != b + 1:
        raise ValueError("accepted_nodes [B, D], num_accepted [B], cu_num_rows [B + 1] disagree")
    if not (num_accepted.is_contiguous() and cu_num_rows.is_contiguous() and accepted_nodes[0].is_contiguous()):
        raise ValueError("num_accepted, cu_num_rows and the rows of accepted_nodes must be contiguous (the kernel "
                         "indexes them with stride 1; e.g. a column of a packed tensor needs .contiguous())")
    if accepted_nodes.shape[1] == 0:
        return  # nothing but roots, which are never copied
    dsv4_refresh_kernel[(b, plan.num_items)](
        plan.items, plan.desc, src_table, dst_table, cu_num_rows, accepted_nodes, num_accepted,
        src_table.stride(0), accepted_nodes.stride(0), BLOCK=plan.block, num_warps=4)


def copy_rows_triton(plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor) -> None:
    """One launch: every pair (src[i], dst[i]) with src[i] >= 0, in every descriptor of the plan."""
    from .dsv4_refresh import dsv4_copy_rows_kernel

    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError("src and dst must be [K] slot lists of the same length")
    if src.numel() == 0 or plan.num_items == 0:
        return
    _check_device(src.device)
    dsv4_copy_rows_kernel[(src.numel(), plan.num_items)](plan.items, plan.desc, src, dst, BLOCK=plan.block,
                                                         num_warps=4)


# ---------------------------------------------------------------------------
# PyTorch twins (host loops over the semantics: the test oracles)


def _rows(plane: Plane, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v = plane.byte_view()
    s = slots.to(torch.long).to(v.device)
    return v, s // plane.page_slots, s % plane.page_slots


def copy_rows_reference(plan: CopyPlan, src: torch.Tensor, dst: torch.Tensor) -> None:
    keep = src.to(torch.long) >= 0
    s, d = src.to(torch.long)[keep], dst.to(torch.long)[keep]
    for sp, dp, _ in plan.planes:
        vs, ps, os_ = _rows(sp, s)
        vd, pd, od = _rows(dp, d)
        vd[pd, od] = vs[ps, os_].clone()


def refresh_reference(plan: CopyPlan, src_table: torch.Tensor, dst_table: torch.Tensor, cu_num_rows: torch.Tensor,
                      accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> int:
    """Returns the (plane, row) copies made."""
    cu, acc, num = cu_num_rows.tolist(), accepted_nodes.tolist(), num_accepted.tolist()
    st, dt = src_table.tolist(), dst_table.tolist()
    n = 0
    for b in range(len(num)):
        for k in range(1, int(num[b]) + 1):
            r = cu[b] + acc[b][k - 1] + 1
            for sp, dp, space in plan.planes:
                s, d = st[space][r], dt[space][r]
                if s < 0 or s == d:
                    continue
                vs, ps, os_ = _rows(sp, torch.tensor([s]))
                vd, pd, od = _rows(dp, torch.tensor([d]))
                vd[pd, od] = vs[ps, os_].clone()
                n += 1
    return n


__all__ = ["CopyPlan", "DESC_FIELDS", "Plane", "build_copy_plan", "copy_rows_reference", "copy_rows_triton",
           "fp8_ds_mla_planes", "index_key_planes", "index_page_plane", "refresh_reference", "refresh_triton",
           "state_plane"]
