"""Byte layouts of the DeepSeek-V4 paged caches on vLLM 0.32's NVIDIA path, and their UE8M0 FP8 codecs.

fp8_ds_mla page (SWA window cache, C4 / C128 compressed caches; FlashMLA's "V4, 584 bytes per token"):

    [0, bs * 576)               bs data rows: 448 e4m3 NoPE values, then 64 bf16 RoPE values (128 bytes)
    [bs * 576, bs * 584)        bs scale rows of 8 bytes: 7 UE8M0 exponents (one per 64 NoPE values), 1 pad (0)
    [bs * 584, page_bytes)      padding: vLLM rounds every fp8_ds_mla page up to a multiple of 576 bytes
                                (`_apply_alignment_padding`, alignment=576), e.g. 64 rows: 37376 -> 37440

A UE8M0 exponent byte e encodes the scale 2^(e - 127). A value x is stored as e4m3(x / scale).

Indexer key page (DeepGEMM's paged layout, 132 bytes per compressed entry):

    [0, bs * 128)               bs rows of 128 e4m3 values
    [bs * 128, bs * 132)        bs float32 scales (a power of two, UE8M0-rounded)
    [bs * 132, page_bytes)      padding to the page stride (also 576-aligned under fp8_ds_mla)

Every reader and writer here addresses pages through `cache.stride(0)`, never through
`block_size * bytes_per_row`: the page stride includes the 576-byte padding and, in vLLM's allocation, the
pages of the other layers that share the block (so a layer's rows are `stride(0)` apart, not `page_bytes`).
"""

from __future__ import annotations

import torch

HEAD_DIM = 512
ROPE_DIM = 64
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448
QUANT_BLOCK = 64
NUM_SCALES = NOPE_DIM // QUANT_BLOCK  # 7
SCALE_BYTES = 8  # 7 exponents + 1 pad
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
ROW_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGNMENT = 576
FP8_MAX = 448.0
MIN_AMAX = 1e-4  # every V4 quantizer clamps the block absmax to at least this

INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4  # 132


def page_bytes(block_size: int, row_bytes: int = ROW_BYTES, alignment: int = PAGE_ALIGNMENT) -> int:
    """Bytes per page as vLLM allocates it: block_size * row_bytes rounded up to the alignment."""
    raw = block_size * row_bytes
    return -(-raw // alignment) * alignment


def ue8m0_exponent(absmax: torch.Tensor, *, reciprocal: bool) -> torch.Tensor:
    """ceil(log2(max(absmax, 1e-4) / 448)) in float32, as the kernels compute it.

    reciprocal=False: absmax / 448 (the CUDA SWA insert, `fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert`);
    reciprocal=True: absmax * (1 / 448) (the Triton and CuTeDSL compressors). The two can differ in the last
    bit, which moves the exponent only when absmax / 448 is within one ulp of a power of two.
    """
    a = torch.clamp(absmax.to(torch.float32), min=MIN_AMAX)
    raw = a * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32) if reciprocal else a / FP8_MAX
    return torch.ceil(torch.log2(raw))


def quantize_e4m3(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """x [..., n] float32, exponent broadcastable -> e4m3 bytes (uint8): clamp(x * 2^-e, +-448), RNE."""
    scaled = torch.clamp(x * torch.exp2(-exponent), -FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def encode_exponent(exponent: torch.Tensor, max_code: float = 255.0) -> torch.Tensor:
    return torch.clamp(exponent + 127.0, 0.0, max_code).to(torch.uint8)


def quantize_rows(rows: torch.Tensor, *, reciprocal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [N, 512] float32 (already RoPE-rotated, already bf16-rounded where the kernel rounds)
    -> (data [N, 576] uint8, scale [N, 8] uint8) in the fp8_ds_mla row format."""
    n = rows.shape[0]
    nope = rows[:, :NOPE_DIM].reshape(n, NUM_SCALES, QUANT_BLOCK)  # [N, 7, 64]
    exp = ue8m0_exponent(nope.abs().amax(dim=-1), reciprocal=reciprocal)  # [N, 7]
    data = torch.empty(n, DATA_BYTES, dtype=torch.uint8, device=rows.device)
    data[:, :NOPE_DIM] = quantize_e4m3(nope, exp.unsqueeze(-1)).reshape(n, NOPE_DIM)
    data[:, NOPE_DIM:] = rows[:, NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scale = torch.zeros(n, SCALE_BYTES, dtype=torch.uint8, device=rows.device)
    scale[:, :NUM_SCALES] = encode_exponent(exp)
    return data, scale


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(data [N, 576] uint8, scale [N, 8] uint8) -> [N, 512] float32 (exact: e4m3 * 2^k fits float32)."""
    n = data.shape[0]
    nope = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    exp = scale[:, :NUM_SCALES].to(torch.float32) - 127.0  # [N, 7]
    nope = (nope.view(n, NUM_SCALES, QUANT_BLOCK) * torch.exp2(exp).unsqueeze(-1)).view(n, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat((nope, rope), dim=-1)


def _flat_pages(cache: torch.Tensor, region_bytes: int) -> torch.Tensor:
    """A paged cache view (dim 0 = page, page stride = stride(0)) -> [num_pages, region_bytes] uint8 over the
    first region_bytes of each page. vLLM interleaves the pages of all layers block by block, so stride(0)
    can be far larger than one layer's page; only the layer's own rows + scales are addressed."""
    if cache.dtype != torch.uint8:
        raise TypeError(f"paged fp8 caches are uint8, got {cache.dtype}")
    return torch.as_strided(cache, (cache.shape[0], region_bytes), (cache.stride(0), 1), cache.storage_offset())


def _row_offsets(slots: torch.Tensor, block_size: int, row_bytes: int, cache: torch.Tensor):
    flat = _flat_pages(cache, block_size * row_bytes)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= flat.shape[0] * block_size):
        raise IndexError(f"slot out of range [0, {flat.shape[0] * block_size}) for a cache of {flat.shape[0]} pages")
    block = slots.to(torch.int64) // block_size
    off = slots.to(torch.int64) % block_size
    return flat, block, off


def read_rows(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_ds_mla rows at slots (block * block_size + offset) -> (data [N, 576], scale [N, 8]) uint8."""
    flat, block, off = _row_offsets(slots, block_size, ROW_BYTES, cache)
    data_idx = (off * DATA_BYTES).unsqueeze(-1) + torch.arange(DATA_BYTES, device=cache.device)
    scale_idx = (block_size * DATA_BYTES + off * SCALE_BYTES).unsqueeze(-1) + torch.arange(SCALE_BYTES,
                                                                                            device=cache.device)
    return flat[block.unsqueeze(-1), data_idx], flat[block.unsqueeze(-1), scale_idx]


def write_rows(cache: torch.Tensor, slots: torch.Tensor, block_size: int, data: torch.Tensor,
               scale: torch.Tensor) -> None:
    """In-place: store fp8_ds_mla rows at slots (no -1 entries; filter them first)."""
    flat, block, off = _row_offsets(slots, block_size, ROW_BYTES, cache)
    data_idx = (off * DATA_BYTES).unsqueeze(-1) + torch.arange(DATA_BYTES, device=cache.device)
    scale_idx = (block_size * DATA_BYTES + off * SCALE_BYTES).unsqueeze(-1) + torch.arange(SCALE_BYTES,
                                                                                            device=cache.device)
    flat[block.unsqueeze(-1), data_idx] = data
    flat[block.unsqueeze(-1), scale_idx] = scale


def gather_dequant(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dequantized rows [N, 512] float32 at slots (valid slots only)."""
    data, scale = read_rows(cache, slots, block_size)
    return dequantize_rows(data, scale)


def read_index_keys(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys at slots -> (e4m3 values [N, 128] float32, scale [N] float32)."""
    flat, block, off = _row_offsets(slots, block_size, INDEX_ROW_BYTES, cache)
    idx = (off * INDEX_DIM).unsqueeze(-1) + torch.arange(INDEX_DIM, device=cache.device)
    vals = flat[block.unsqueeze(-1), idx].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    sidx = (block_size * INDEX_DIM + off * 4).unsqueeze(-1) + torch.arange(4, device=cache.device)
    scale = flat[block.unsqueeze(-1), sidx].contiguous().view(torch.float32).squeeze(-1)
    return vals, scale


def write_index_keys(cache: torch.Tensor, slots: torch.Tensor, block_size: int, vals: torch.Tensor,
                     scale: torch.Tensor) -> None:
    """In-place: store indexer keys (e4m3 bytes [N, 128] uint8, scale [N] float32) at slots."""
    flat, block, off = _row_offsets(slots, block_size, INDEX_ROW_BYTES, cache)
    idx = (off * INDEX_DIM).unsqueeze(-1) + torch.arange(INDEX_DIM, device=cache.device)
    flat[block.unsqueeze(-1), idx] = vals
    sidx = (block_size * INDEX_DIM + off * 4).unsqueeze(-1) + torch.arange(4, device=cache.device)
    flat[block.unsqueeze(-1), sidx] = scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4)


def dequantize_and_gather_k_cache(out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor,
                                  gather_lens: torch.Tensor | None, block_table: torch.Tensor, block_size: int,
                                  offset: int, use_fnuz: bool = False) -> None:
    """vLLM's `common/ops/cache_utils.dequantize_and_gather_k_cache` (CuTeDSL / Triton; caller
    `DeepseekV4FlashMLAAttention._forward_prefill`): for request b, the last gather_len of its seq_len positions
    (all of them when gather_lens is None), read through block_table[b], dequantized to bf16 into
    out[b, offset + i] (out [num_reqs, width, 512])."""
    if use_fnuz:
        raise NotImplementedError("FNUZ fp8 caches are ROCm-only")
    lens = seq_lens.tolist()
    gl = gather_lens.tolist() if gather_lens is not None else lens
    for b, (n, g) in enumerate(zip(lens, gl)):
        if g <= 0:
            continue
        pos = torch.arange(n - g, n, device=out.device)
        slots = block_table[b][pos // block_size].to(torch.int64) * block_size + pos % block_size
        out[b, offset:offset + g] = gather_dequant(k_cache, slots, block_size).to(out.dtype)
