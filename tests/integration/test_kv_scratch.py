"""Scratch blocks for the CPU decode path: sizing and the worker's extended KV-cache config (kv_scratch.py)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_tree_spec.integration import cpu_tree_decode, kv_scratch

pytestmark = pytest.mark.vllm


def _vllm_config(layout):
    cache = SimpleNamespace(num_gpu_blocks_override=None, prefix_cache_retention_interval=None,
                            get_resolved_kv_cache_layout=lambda: layout)
    return SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))


def test_extended_config_adds_blocks_the_scheduler_never_sees():
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVCacheLayout

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(3)], spec)]
    cfg = _vllm_config(KVCacheLayout.LBHNC)
    per_block = 3 * spec.page_size_bytes
    base = get_kv_cache_config_from_groups(cfg, groups, 100 * per_block)
    grown = kv_scratch.extend_kv_cache_config(cfg, base, 7)
    assert (base.num_blocks, grown.num_blocks) == (100, 107)
    assert grown.kv_cache_tensors[0].size == 107 * per_block
    assert base.kv_cache_tensors[0].size == 100 * per_block  # the scheduler's copy is untouched
    assert cfg.cache_config.num_gpu_blocks_override is None  # vLLM's knob is restored


def test_scratch_count_fills_a_batch_and_respects_the_cap():
    want = cpu_tree_decode.scratch_blocks_for(8, 10, 128)
    assert want == 8 * 9 * 2
    assert kv_scratch.scratch_count(8, 10, 128, per_block=1000, available=10**9) == want
    assert kv_scratch.scratch_count(8, 10, 128, per_block=1000, available=16 * 1000 * 5) == 5  # 1/16 of memory
    assert cpu_tree_decode.chain_blocks(6, 128) == 2 and cpu_tree_decode.chain_blocks(1, 128) == 1
