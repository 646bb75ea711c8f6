"""KV-cache blocks the scheduler never hands out: scratch for the CPU decode path of tree rows.

Patch record P11 (what / why / removal):
  what     The tree CPU worker reports `S x bytes per block` less KV-cache memory than vLLM's CPU worker
           measured (`StandardAttentionAdapter.reserve_memory`), and allocates its own copy of the engine's
           KV-cache config with S more blocks (`extend_kv_cache_config`, through vLLM's own
           `get_kv_cache_config_from_groups`, so layout and strides are vLLM's). The scheduler's config, made by
           the engine core before the workers allocate, keeps the original count: block ids N .. N+S-1 exist
           only in the workers, and tree steps read chain sequences through them (`cpu_tree_decode.py`).
  why      Tree rows computed as vLLM's decode of each path need the path's K/V at the positions a decode step
           reads; a branching tree's paths overlap in the request's own slots, and without scratch its chains
           need one vLLM call each (a fixed ~0.1 ms per call and layer on one thread).
  removal  A vLLM API for worker-private KV blocks, or tree masks in vLLM's CPU attention kernel.
"""

from __future__ import annotations

import copy

from vllm_tree_spec.integration import cpu_tree_decode as decode

MAX_SHARE = 16  # scratch takes at most 1/16 of the KV-cache memory; chains that find none run in waves


def bytes_per_block(kv_cache_spec: dict) -> int:
    """Bytes of one block id across every layer with a page (an upper bound for multi-group models)."""
    return sum(getattr(spec, "page_size_bytes", 0) for spec in kv_cache_spec.values())


def scratch_count(max_num_seqs: int, max_nodes: int, block_size: int, per_block: int, available: int) -> int:
    """Blocks for a full batch of the largest trees in one call, at most 1/MAX_SHARE of `available` bytes."""
    want = decode.scratch_blocks_for(max_num_seqs, max_nodes, block_size)
    return min(want, available // MAX_SHARE // max(1, per_block))


def extend_kv_cache_config(vllm_config, kv_cache_config, extra_blocks: int):
    """A copy of the worker's KV-cache config with `extra_blocks` more blocks, laid out by vLLM."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    cfg = copy.deepcopy(kv_cache_config)
    if extra_blocks <= 0 or not cfg.kv_cache_tensors:
        return cfg
    n = cfg.num_blocks
    cache = vllm_config.cache_config
    saved = cache.num_gpu_blocks_override
    cache.num_gpu_blocks_override = n + extra_blocks  # vLLM's own knob for an exact block count
    try:
        per_block = cfg.kv_cache_tensors[0].size // n
        grown = get_kv_cache_config_from_groups(vllm_config, cfg.kv_cache_groups, per_block * (n + extra_blocks))
    finally:
        cache.num_gpu_blocks_override = saved
    if grown.num_blocks != n + extra_blocks:
        raise RuntimeError(f"tree scratch: vLLM laid out {grown.num_blocks} KV-cache blocks for {n} + {extra_blocks}")
    cfg.num_blocks, cfg.kv_cache_tensors = grown.num_blocks, grown.kv_cache_tensors
    return cfg
