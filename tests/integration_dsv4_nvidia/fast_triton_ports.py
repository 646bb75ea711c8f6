"""Speed-only stand-ins for vLLM Triton kernels whose interpretation dominates an emulated step.

Under TRITON_INTERPRET=1 every Triton program runs as Python; on the tiny model a step spent ~90 % of its time
in two per-(token, head) kernels and in two grid-stride kernels launched with 128 / 256 workers per request.
These kernels run as Triton on a GPU, unchanged by this project; here:

  * `fused_inv_rope_fp8_quant` (o_proj input) -> dsv4_gpu_ops.o_proj.fused_inv_rope_fp8_quant
  * `fused_q_kv_rmsnorm` (q-lora / kv RMSNorm pair) -> `fused_q_kv_rmsnorm` below
  * `dequantize_and_gather_k_cache` (prefill workspace) -> dsv4_gpu_ops.layout.dequantize_and_gather_k_cache
  * `_SAVE_PARTIAL_STATES_KERNEL` (compressor state rows) -> dsv4_gpu_ops.compressor.save_partial_states
  * `compress_norm_rope_store_triton` (the indexer compressor, head 128; per-token programs) ->
    dsv4_gpu_ops.compressor.compress_norm_rope_store
  * `_fill_short_context_topk_indices` (short-context C4 lists 0 .. (pos + 1) // 4 - 1, -1 after) -> port below
  * `_COMBINE_TOPK_SWA_INDICES_KERNEL` (prefill lists: top-k / C128 ids + window, into the gathered workspace)
    and `_BUILD_C128A_TOPK_METADATA_KERNEL` (C128 dense lists) -> the vectorised ports below
  * the metadata kernels the CPU DeepSeek-V4 path already ports (token -> request map, slot mappings, SWA
    index lists; `vllm_tree_spec.integration.dsv4.cpu_kernels`, checked by
    tests/integration_dsv4/test_dsv4_cpu_kernels.py)

`test_fast_triton_ports.py` checks each port here against the interpreted kernel on random batches.
`install(fast=False)` of nvidia_emulation leaves all of them as interpreted Triton (slow; for cross-checks).
"""

from __future__ import annotations

import sys

import torch


def fused_q_kv_rmsnorm(qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`vllm.models.common.ops.fused_qk_rmsnorm.fused_q_kv_rmsnorm`: two weighted RMSNorms, fp32, one cast."""
    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    return norm(qr, q_weight), norm(kv, kv_weight)


class _Port:
    """Stands in for a vLLM JIT kernel object: callable, with a no-op warmup registration."""

    def __init__(self, fn):
        self._fn = fn

    def register_warmup(self, *args, **kwargs) -> None:
        return None

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


def save_partial_states(*, kv, score, ape, positions, state_cache, slot_mapping, block_size, state_width,
                        compress_ratio, pdl_kwargs=None) -> None:
    """`_SAVE_PARTIAL_STATES_KERNEL(...)` keyword call of `DeepseekCompressor.forward`."""
    from vllm_tree_spec.reference.dsv4_gpu_ops import compressor

    assert kv.shape[-1] == state_width and ape.shape[0] == compress_ratio
    compressor.save_partial_states(kv, score, ape, positions, state_cache, slot_mapping, block_size)


def combine_topk_swa_indices(combined_indices, combined_lens, topk_indices, query_start_loc, seq_lens, gather_lens,
                             M, N, *, TOP_K, COMPRESS_RATIO, WINDOW_SIZE, left_visible=None, right_visible=None,
                             max_image_tokens=0) -> None:
    """`CombineTopkSwaIndicesKernel` (text-only): per prefill token at pos, its first min((pos + 1) // ratio,
    TOP_K) top-k ids + M * req, then its window [max(pos - W + 1, 0), pos] as M * req + N + (p - gather_start)."""
    if left_visible is not None:
        raise NotImplementedError("image spans are not emulated")
    qsl = query_start_loc.to(torch.int64)
    base = int(qsl[0])
    for b in range(seq_lens.shape[0]):
        qs, qe = int(qsl[b]) - base, int(qsl[b + 1]) - base
        if qe <= qs:
            continue
        seq_len, gather_len = int(seq_lens[b]), int(gather_lens[b])
        pos = torch.arange(seq_len - (qe - qs), seq_len, device=topk_indices.device)
        topk_len = torch.clamp((pos + 1) // COMPRESS_RATIO, max=TOP_K)
        swa_start = (pos - (WINDOW_SIZE - 1)).clamp(min=0)
        swa_len = pos - swa_start + 1
        width = combined_indices.shape[1]
        col = torch.arange(width, device=pos.device).unsqueeze(0)
        rows = combined_indices[qs:qe]
        if TOP_K > 0:
            k = min(TOP_K, topk_indices.shape[1])
            tk = topk_indices[qs:qe, :k].to(torch.int64) + M * b
            keep = col[:, :k] < topk_len.unsqueeze(1)
            rows[:, :k] = torch.where(keep, tk, rows[:, :k].to(torch.int64)).to(rows.dtype)
        rel = col - topk_len.unsqueeze(1)
        in_win = (rel >= 0) & (rel < swa_len.unsqueeze(1)) & (rel < WINDOW_SIZE)
        win = M * b + N + swa_start.unsqueeze(1) + rel - (seq_len - gather_len)
        rows.copy_(torch.where(in_win, win, rows.to(torch.int64)).to(rows.dtype))
        combined_lens[qs:qe] = (topk_len + swa_len).to(combined_lens.dtype)


def build_c128a_topk_metadata(global_decode_buffer, decode_lens_buffer, prefill_buffer, positions, compress_ratio,
                              max_compressed_tokens, num_decode_tokens, token_to_req_indices, block_table,
                              block_size, slot_mapping) -> None:
    """`BuildC128ATopkMetadataKernel`: decode rows get the global slots of entries 0 .. (pos + 1) // ratio - 1
    and their count (0 for padding rows), prefill rows the local ids; the rest of the width is -1."""
    n = positions.shape[0]
    if n == 0:
        return
    pos = positions.to(torch.int64)
    num = torch.clamp((pos + 1) // compress_ratio, max=max_compressed_tokens)
    off = torch.arange(max_compressed_tokens, device=pos.device).unsqueeze(0)
    valid = off < num.unsqueeze(1)
    d = num_decode_tokens
    if d > 0:
        req = token_to_req_indices[:d].to(torch.int64).unsqueeze(1)
        blk = block_table[req, (off // block_size).clamp(max=block_table.shape[1] - 1)].to(torch.int64)
        slots = torch.where(valid[:d], blk * block_size + off % block_size, torch.full_like(blk, -1))
        global_decode_buffer[:d, :max_compressed_tokens] = slots.to(global_decode_buffer.dtype)
        ok = slot_mapping[:d] >= 0
        decode_lens_buffer[:d] = torch.where(ok, valid[:d].sum(1), torch.zeros_like(num[:d])).to(
            decode_lens_buffer.dtype)
    if n > d:
        local = torch.where(valid[d:], off.expand(n - d, -1), torch.full_like(valid[d:], -1, dtype=torch.int64))
        prefill_buffer[:n - d, :max_compressed_tokens] = local.to(prefill_buffer.dtype)


class _ShortContextTopk:
    """`_fill_short_context_topk_indices[(rows,)](out, positions, TOP_K=, COMPRESS_RATIO=, PADDED_TOP_K=)`."""

    def __getitem__(self, grid):
        def launch(output, positions, TOP_K, COMPRESS_RATIO, PADDED_TOP_K, **launch_kwargs):
            rows = grid[0]
            n = (positions[:rows].to(torch.int64) + 1) // COMPRESS_RATIO
            off = torch.arange(TOP_K, device=positions.device).unsqueeze(0)
            output[:rows, :TOP_K] = torch.where(off < n.unsqueeze(1), off, -1).to(output.dtype)
        return launch


ORIGINALS: dict = {}  # (module, name) -> vLLM's object, for the port-vs-kernel tests


def _swap(module_name: str, name: str, new) -> None:
    mod = sys.modules[module_name]
    ORIGINALS.setdefault((module_name, name), getattr(mod, name))
    setattr(mod, name, new)


def install() -> None:
    if ORIGINALS:
        return
    from vllm_tree_spec.reference.dsv4_gpu_ops import compressor, layout, o_proj

    import vllm.models.deepseek_v4.common.ops.cache_utils  # noqa: F401
    import vllm.models.deepseek_v4.sparse_mla  # noqa: F401

    from vllm_tree_spec.integration.dsv4 import cpu_kernels

    _swap("vllm.models.deepseek_v4.nvidia.ops.o_proj", "fused_inv_rope_fp8_quant", o_proj.fused_inv_rope_fp8_quant)
    _swap("vllm.models.deepseek_v4.attention", "fused_q_kv_rmsnorm", fused_q_kv_rmsnorm)
    _swap("vllm.models.deepseek_v4.nvidia.flashmla", "dequantize_and_gather_k_cache",
          layout.dequantize_and_gather_k_cache)
    _swap("vllm.models.deepseek_v4.common.ops.cache_utils", "_COMBINE_TOPK_SWA_INDICES_KERNEL",
          _Port(combine_topk_swa_indices))
    _swap("vllm.models.deepseek_v4.sparse_mla", "_BUILD_C128A_TOPK_METADATA_KERNEL", _Port(build_c128a_topk_metadata))
    _swap("vllm.models.deepseek_v4.compressor", "_SAVE_PARTIAL_STATES_KERNEL", _Port(save_partial_states))
    _swap("vllm.models.deepseek_v4.compressor", "compress_norm_rope_store_triton", compressor.compress_norm_rope_store)
    _swap("vllm.models.deepseek_v4.attention", "_fill_short_context_topk_indices", _ShortContextTopk())
    cpu_kernels.install()
