"""Where vLLM 0.32's NVIDIA DeepSeek-V4 model keeps its decode state, found by role once the caches exist.

vLLM groups the caches into KV cache groups (one block table and one metadata object each); for V4:

    SWA groups      `DeepseekV4SWACache` layers, 64-row fp8_ds_mla pages (one group per set of layers
                    vLLM chose to share a block table: e.g. SWA-only + HCA layers, CSA layers)
    state groups    `CompressorStateCache` layers, float32 rows: ratio 4 (CSA main and indexer
                    compressors, 4 rows per block, window 8), ratio 128 (HCA, 8 rows per block, window 128)
    entry group     compressed entries (C4 and C128 attention layers, fp8_ds_mla, 64 / 2 entries per
                    256-token block) and FP8 indexer keys (64 per block), one block table

Every cache is a view into one pooled allocation (block-outermost: block b of every layer is one pooled
block), so `tensor.stride(0)` is the pooled block, and fp8_ds_mla / key pages are padded to 576 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CSA = 4
HCA = 128


@dataclass
class CacheGroup:
    gid: int
    block_size: int  # slots per block (tokens, state rows, or entries)
    layers: list[str] = field(default_factory=list)  # metadata keys (layer names) of the group's layers
    caches: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Dsv4NvidiaCaches:
    swa: list[CacheGroup] = field(default_factory=list)
    state: dict[int, CacheGroup] = field(default_factory=dict)  # ratio -> group
    entry_gid: int | None = None
    entries_per_block: dict[int, int] = field(default_factory=dict)  # ratio -> entries per entry-group block
    entry_caches: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # ratio -> fp8_ds_mla views
    key_caches: list[torch.Tensor] = field(default_factory=list)  # FP8 indexer keys [nb, 64, 132]
    attention: dict[str, object] = field(default_factory=dict)  # prefix -> DeepseekV4FlashMLAAttention
    compressors: list[object] = field(default_factory=list)  # DeepseekCompressor (main and indexer)
    metadata_keys: dict[str, str] = field(default_factory=dict)  # role -> one layer name to read metadata under

    @property
    def ratios(self) -> list[int]:
        return sorted(self.entry_caches)


def find_caches(forward_context: dict, kv_cache_config, model) -> Dsv4NvidiaCaches:
    """Classify every cache layer of the engine by role (raises on a layer with no tree role)."""
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache, DeepseekCompressor
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    out = Dsv4NvidiaCaches()
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        bs = group.kv_cache_spec.block_size
        roles = set()
        g = CacheGroup(gid, bs)
        for name in group.layer_names:
            layer = forward_context.get(name)
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0]
            if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                continue
            if isinstance(layer, DeepseekV4SWACache):
                roles.add("swa")
                g.layers.append(name)
                g.caches.append(kv)
            elif isinstance(layer, CompressorStateCache):
                roles.add("state")
                g.layers.append(name)
                g.caches.append(kv)
                ratio = CSA if layer.sliding_window == 2 * CSA else HCA
                prev = out.state.get(ratio)
                if prev is not None and prev is not g:
                    raise RuntimeError(f"DeepSeek-V4 tree adapter: ratio-{ratio} compressor states live in two cache "
                                       f"groups ({prev.gid}, {gid})")
                out.state[ratio] = g
            elif isinstance(layer, DeepseekV4Attention) and layer.compress_ratio > 1:
                roles.add("entry")
                out.entry_caches.setdefault(layer.compress_ratio, []).append(kv)
                out.entries_per_block[layer.compress_ratio] = bs // layer.compress_ratio
                out.metadata_keys.setdefault(f"entries{layer.compress_ratio}", name)
            elif isinstance(layer, DeepseekV4IndexerCache):
                roles.add("entry")
                if kv.dtype != torch.uint8 or kv.shape[-1] != 132:
                    raise RuntimeError(f"{name}: indexer cache rows of {kv.shape[-1]} bytes ({kv.dtype}); the tree "
                                       f"adapter supports the FP8 indexer cache (132-byte rows) only")
                out.key_caches.append(kv)
                out.metadata_keys.setdefault("indexer", name)
            else:
                raise RuntimeError(f"DeepSeek-V4 tree adapter: cache layer {name} ({type(layer).__name__}) has no "
                                   f"tree role")
        if len(roles) > 1:
            raise RuntimeError(f"DeepSeek-V4 tree adapter: KV cache group {gid} mixes roles {sorted(roles)}")
        if "swa" in roles:
            out.swa.append(g)
        if "entry" in roles:
            if out.entry_gid not in (None, gid):
                raise RuntimeError("DeepSeek-V4 tree adapter: compressed entries live in more than one cache group")
            out.entry_gid = gid
    for name, layer in forward_context.items():
        if isinstance(layer, DeepseekV4Attention):
            out.attention[name] = layer
    for mod in model.modules():
        if isinstance(mod, DeepseekCompressor):
            out.compressors.append(mod)
    if not out.swa or out.entry_gid is None:
        raise RuntimeError("DeepSeek-V4 tree adapter: no SWA or compressed-entry caches found")
    for ratio in out.entry_caches:
        if ratio not in (CSA, HCA) or ratio not in out.state:
            raise RuntimeError(f"DeepSeek-V4 tree adapter: compress ratio {ratio} has no compressor state group "
                               f"(supported ratios: {CSA}, {HCA})")
    return out
