"""DeepSeek-V4 CPU cache rows: where a token's (or entry's) bytes live, how to copy them, and scratch blocks.

vLLM 0.32 packs every DeepSeek-V4 cache into one backing allocation, block
outermost: block b of layer l starts at `offset + l * layer_stride + b *
block_stride`, and the five cache groups overlay each other (a block id is
owned by one group at a time). Per layer, the views are:

    cache                         view [nb, bs, row]     bytes of slot s = (b, o) inside block b's page
    SWA window KV (fp8_ds_mla)    [nb, 64, 584] uint8     data o*576 .. +576, then UE8M0 scales bs*576 + o*8 .. +8
    compressed entries C4 / C128  [nb, 64|2, 584] uint8   same layout, bs = 256 / ratio entries per block
    indexer keys (C4)             [nb, 64, 132] uint8     data o*128 .. +128, then fp32 scale bs*128 + o*4 .. +4
    compressor state rows         [nb, 4|8, W] float32    plain rows (kv state | score state)

(checked against the CPU kernels: `fused_qnorm_rope_kv_insert_cpu`,
`compress_norm_rope_store_indexer_cpu`; `self_test` repeats the check at start-up).

Scratch: tree steps need slots the scheduler never hands out (branch-specific
compressed entries and indexer keys, and per-row virtual indexer pages). The
worker's copy of the KV cache config is extended by `reserve` blocks at the end
of the backing allocation; the scheduler keeps its own `num_blocks`, so block
ids >= that number are ours. Because groups overlay, a scratch block is used by
one group (the compressed-entry group) per step.
"""

from __future__ import annotations

import copy
import functools

import torch

# row bytes -> data bytes (the rest of the row is the per-row scale, stored after all data rows of the block)
_SPLIT_ROWS = {584: 576, 132: 128}


class UnsupportedDSV4Layout(NotImplementedError):
    pass


def _page_view(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """[nb, bs * row_bytes] byte pages of a uint8 [nb, bs, row] view, plus bs and row bytes."""
    nb, bs, row = cache.shape
    return cache.view(nb, bs * row), bs, row


def row_byte_index(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids [n], byte offsets [n, row]) of each slot's bytes inside its block page (uint8 caches)."""
    _, bs, row = cache.shape
    data = _SPLIT_ROWS.get(row)
    if data is None:
        raise UnsupportedDSV4Layout(f"uint8 cache rows of {row} bytes have no known DeepSeek-V4 layout")
    scale = row - data
    blk, off = slots // bs, slots % bs
    d = off[:, None] * data + torch.arange(data)  # [n, data]
    s = bs * data + off[:, None] * scale + torch.arange(scale)  # [n, scale]
    return blk, torch.cat([d, s], dim=1)


def read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, row] the bytes / values of the given slots (a copy)."""
    slots = slots.to(torch.long)
    if cache.dtype == torch.uint8:
        pages, _, _ = _page_view(cache)
        blk, idx = row_byte_index(cache, slots)
        return pages[blk[:, None], idx]
    bs = cache.shape[1]
    return cache[slots // bs, slots % bs].clone()


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    slots = slots.to(torch.long)
    if cache.dtype == torch.uint8:
        pages, _, _ = _page_view(cache)
        blk, idx = row_byte_index(cache, slots)
        pages[blk[:, None], idx] = rows
        return
    bs = cache.shape[1]
    cache[slots // bs, slots % bs] = rows


def copy_rows(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache[dst] <- cache[src], every source read before any destination is written."""
    if len(src):
        write_rows(cache, dst, read_rows(cache, src))


def copy_pages(cache: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """Whole-block copy (this layer's page only)."""
    if len(src_blocks):
        pages = cache.view(cache.shape[0], -1)
        pages[dst_blocks.to(torch.long)] = pages[src_blocks.to(torch.long)].clone()


@functools.lru_cache(maxsize=None)
def self_test() -> None:
    """Check the byte layouts above against vLLM's own CPU cache-write kernels (once per process)."""
    from vllm import _custom_ops as ops

    bs = 64
    cache = torch.zeros(2, bs, 584, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(2, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([3, 9], dtype=torch.int64)
    slots = torch.tensor([5, bs + 7], dtype=torch.int64)
    cs = torch.randn(64, 64, generator=g)
    ops.fused_qnorm_rope_kv_insert_cpu(q, kv, pos, cache.view(2, -1), slots, cs, 1, 1e-6, bs)
    rows = read_rows(cache, slots)
    touched = int((cache != 0).sum())
    if int((rows != 0).sum()) != touched or touched == 0:
        raise UnsupportedDSV4Layout(
            "vLLM's fp8_ds_mla CPU cache layout is not the one this plugin copies rows in; "
            "tree speculation for DeepSeek-V4 cannot run on this vLLM build")


# ---------------------------------------------------------------------------
# Scratch blocks


def extend_kv_cache_config(kv_cache_config, extra_blocks: int):
    """A copy of the worker's KV cache config with `extra_blocks` more blocks in the backing allocation.

    Only the block-outermost packing (every DeepSeek-V4 cache on CPU) is supported:
    there, adding blocks appends whole block strides at the end and leaves every
    existing address unchanged.
    """
    cfg = copy.deepcopy(kv_cache_config)
    if extra_blocks <= 0:
        return cfg
    for t in cfg.kv_cache_tensors:
        if t.host_resident:
            raise UnsupportedDSV4Layout("host-resident KV cache tensors cannot carry tree scratch blocks")
        if t.block_stride <= t.layer_stride and len(t.layers) > 1:
            raise UnsupportedDSV4Layout(
                f"KV cache tensor {t.layers[0]}... is layer-outermost (block stride {t.block_stride} <= layer "
                f"stride {t.layer_stride}); tree scratch blocks need the block-outermost packing")
        expected = t.offset + cfg.num_blocks * t.block_stride
        if t.size < expected - t.block_stride:  # sanity: the allocation spans num_blocks strides
            raise UnsupportedDSV4Layout(f"KV cache tensor of {t.size} bytes does not span {cfg.num_blocks} blocks")
    strides = {t.block_stride for t in cfg.kv_cache_tensors}
    if len(strides) != 1:
        raise UnsupportedDSV4Layout(f"KV cache tensors with different block strides {sorted(strides)}")
    stride = strides.pop()
    for t in cfg.kv_cache_tensors:
        t.size += extra_blocks * stride
    cfg.num_blocks += extra_blocks
    return cfg


class ScratchBlocks:
    """The reserved block ids [first, first + count); handed out afresh every tree step."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def take(self, n: int) -> list[int]:
        if self._next + n > self.count:
            raise RuntimeError(
                f"tree step needs {self._next + n} scratch blocks but {self.count} are reserved; "
                f"lower max_num_seqs or the tree size")
        out = list(range(self.first + self._next, self.first + self._next + n))
        self._next += n
        return out

    @property
    def used(self) -> int:
        return self._next
