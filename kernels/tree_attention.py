"""Triton kernels for tree attention over vLLM's paged KV cache (`@triton.jit` code only).

The typed launcher, whose docstring states the math, is
`vllm_tree_spec.kernels.tree_attention_launch.tree_attention_triton`; the
PyTorch twin is `vllm_tree_spec.tree_attention.tree_attention_reference`.

Layout recap (per request b; all slots are linear KV-cache slots):

    q_len   = query_start_loc[b + 1] - query_start_loc[b]   query rows of b
    N       = cu_num_nodes[b + 1] - cu_num_nodes[b]         draft nodes of b
    S       = seq_lens[b]                                   tokens in the cache
    first   = S - q_len          slot of query row 0
    start   = S - N              slot of draft node 0 (the root is at start - 1)

The last N query rows are draft nodes; every other query row (the root, and
any prefill rows before it) is an ordinary causal row. Row r at slot
first + r may attend to key slot k iff

    k <= first + r  and  (k < start  or  bit (k - start) of node row r's packed mask)

and, with a sliding window W, key position > query position - W, where slot
k < start has position k and draft node j has position (start - 1) + depth[j].

Program grid: (split * num_tiles + query tile, kv head, request). One
program holds a tile of BLOCK_M (query row, query head) pairs that share one
KV head (GQA packing: m -> row m // G, head hk * G + m % G), so each K/V tile
is read once for the G query heads. Keys are streamed in BLOCK_N-token tiles:
first the prefix tiles every row of the tile sees (no mask), then the tail
tiles (diagonal of the causal rows and the tree) with the full mask.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_P] fp32 running numerator
    l_i,  # [BLOCK_M] fp32 running denominator (scaled by 2^-m_i)
    m_i,  # [BLOCK_M] fp32 running max, log2 domain
    q,  # [BLOCK_M, HEAD_DIM_P] query tile
    kv_start,  # first key slot of this tile (multiple of BLOCK_N from the range start)
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, H_kv, D]
    v_cache_ptr,  # [num_blocks, PAGE_SIZE, H_kv, D]
    block_table_row_ptr,  # [max_blocks] block ids of this request
    kv_head,  # int64 kv head index
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    qk_scale,  # scale * log2(e) (or scale when HAS_SOFTCAP; log2(e) applied after the cap)
    softcap,
    # mask inputs (used when MASKED or HAS_WINDOW)
    seq_len,
    tree_start,
    q_slot,  # [BLOCK_M] slot of each row's query token
    q_pos,  # [BLOCK_M] position of each row (HAS_WINDOW only)
    is_node,  # [BLOCK_M] bool, row is a draft node
    mask_row_ptr,  # [BLOCK_M] pointers to the row's packed mask words (node rows only)
    node_depth_ptr,  # pointer to depth[node_off] (HAS_WINDOW only)
    row_valid,  # [BLOCK_M] bool
    sliding_window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # False: every (row, key) of the tile is visible (prefix tiles)
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # run both dots on fp32 copies (interpreter: its bf16 tl.dot is wrong)
):
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_P
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_P)
    k_slot = kv_start + offs_n  # [BLOCK_N]
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        k_ok = k_slot < seq_len
        blk = tl.load(block_table_row_ptr + k_slot // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(block_table_row_ptr + k_slot // PAGE_SIZE).to(tl.int64)
    in_page = (k_slot % PAGE_SIZE).to(tl.int64)

    # K^T tile [HEAD_DIM_P, BLOCK_N] and V tile [BLOCK_N, HEAD_DIM_P]; unmasked
    # loads on prefix tiles keep them fully vectorised.
    k_ptrs = (
        k_cache_ptr
        + blk[None, :] * stride_kb
        + in_page[None, :] * stride_ks
        + kv_head * stride_kh
        + offs_d[:, None]
    )
    v_ptrs = (
        v_cache_ptr
        + blk[:, None] * stride_vb
        + in_page[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :]
    )
    if MASKED:
        k = tl.load(k_ptrs, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    elif PAD_D:
        k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if HAS_SOFTCAP:
        # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1) (saturates cleanly at +-1)
        y = s * (qk_scale / softcap)
        s = softcap * (1.0 - 2.0 / (tl.exp2(y * (2.0 * LOG2E)) + 1.0)) * LOG2E
    else:
        s = s * qk_scale

    if MASKED:
        visible = row_valid[:, None] & k_ok[None, :] & (k_slot[None, :] <= q_slot[:, None])
        key_is_node = k_slot >= tree_start
        j = tl.where(key_is_node, k_slot - tree_start, 0)  # local node index of the key
        want_bit = is_node[:, None] & key_is_node[None, :] & visible
        word = tl.load(mask_row_ptr[:, None] + (j >> 5)[None, :], mask=want_bit, other=0)
        bit = ((word >> (j & 31)[None, :]) & 1) != 0
        visible = visible & ((~key_is_node)[None, :] | bit)
    if HAS_WINDOW:
        if MASKED:
            k_depth = tl.load(node_depth_ptr + j, mask=key_is_node & k_ok, other=0)
            k_pos = tl.where(key_is_node, tree_start - 1 + k_depth, k_slot)
        else:
            k_pos = k_slot  # prefix tiles hold no draft nodes
        in_window = k_pos[None, :] > (q_pos[:, None] - sliding_window)
        if MASKED:
            visible = visible & in_window
        else:
            visible = in_window
    if MASKED or HAS_WINDOW:
        s = tl.where(visible, s, float("-inf"))

    # online softmax (log2 domain); rows that have seen nothing keep m = -inf
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Runtime sizes that change from step to step must not trigger recompiles
# (Triton specialises ints equal to 1 or divisible by 16).
@triton.jit(
    do_not_specialize=["sliding_window", "num_tiles", "num_splits", "stride_bt", "stride_mask", "stride_os", "stride_ls"]
)
def tree_attention_kernel(
    out_ptr,  # [T_q, H_q, D] q.dtype (SPLIT_KV: [num_splits, T_q, H_q, D] fp32 partial outputs)
    lse_ptr,  # [num_splits, T_q, H_q] fp32 log2-sum-exp of each split (SPLIT_KV only)
    q_ptr,  # [T_q, H_q, D] queries (pre-roped)
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, H_kv, D]
    v_cache_ptr,  # [num_blocks, PAGE_SIZE, H_kv, D]
    block_table_ptr,  # [B, max_blocks] int32 physical block ids
    seq_lens_ptr,  # [B] tokens in the cache per request (incl. this step's query tokens)
    query_start_loc_ptr,  # [B + 1] query row offsets
    cu_num_nodes_ptr,  # [B + 1] draft node offsets
    packed_mask_ptr,  # [T_nodes, W] int32 ancestor-or-self bits (local columns)
    depth_ptr,  # [T_nodes] depth of each draft node (1 = child of the root); HAS_WINDOW only
    sinks_ptr,  # [H_q] fp32 sink logits; HAS_SINKS only
    scale,  # float softmax scale
    softcap,  # float logit cap; HAS_SOFTCAP only
    sliding_window,  # int window in positions; HAS_WINDOW only
    num_tiles,  # int query tiles per request (cdiv(max_query_len, BLOCK_M // G))
    num_splits,  # int KV splits per query tile
    stride_ot,
    stride_oh,
    stride_os,  # SPLIT_KV only: split stride of the partial outputs
    stride_ls,  # SPLIT_KV only: split stride of lse
    stride_lt,  # SPLIT_KV only: token stride of lse (heads are contiguous)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_mask,
    G: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_M: tl.constexpr,  # (row, head) pairs per program; ROWS = BLOCK_M // G query rows
    BLOCK_N: tl.constexpr,  # keys per inner step
    PAGE_SIZE: tl.constexpr,  # KV-cache block size
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), else "tf32" (ignored for 16-bit)
    UPCAST: tl.constexpr,  # dots on fp32 copies; set by the launcher under TRITON_INTERPRET for bf16
):
    ROWS: tl.constexpr = BLOCK_M // G
    # Query tiles vary fastest so that the tiles of one (request, kv head),
    # which stream the same prefix K/V, run side by side and share L2.
    pid0 = tl.program_id(0)
    tile = pid0 % num_tiles
    split = pid0 // num_tiles
    kv_head = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)

    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int64) - q_start
    row0 = tile.to(tl.int64) * ROWS
    if row0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    node_off = tl.load(cu_num_nodes_ptr + b).to(tl.int64)
    n_nodes = tl.load(cu_num_nodes_ptr + b + 1).to(tl.int64) - node_off
    tree_start = seq_len - n_nodes  # slot of draft node 0; the root sits at tree_start - 1
    first_slot = seq_len - q_len  # slot of query row 0
    first_node_row = q_len - n_nodes

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    row = row0 + offs_m // G  # [BLOCK_M] local query row
    head = kv_head * G + offs_m % G  # [BLOCK_M] query head
    row_valid = (offs_m < ROWS * G) & (row < q_len)
    q_slot = first_slot + row
    is_node = row_valid & (row >= first_node_row)
    node_row = node_off + tl.where(is_node, row - first_node_row, 0)  # global node index
    mask_row_ptr = packed_mask_ptr + node_row * stride_mask
    node_depth_ptr = depth_ptr + node_off

    q_ptrs = q_ptr + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_WINDOW:
        q_depth = tl.load(depth_ptr + node_row, mask=is_node, other=0).to(tl.int64)
        q_pos = tl.where(is_node, tree_start - 1 + q_depth, q_slot)
    else:
        q_pos = q_slot

    if HAS_SOFTCAP:
        qk_scale = scale
    else:
        qk_scale = scale * LOG2E

    # Key range of the tile. All rows see slots < um_end (the first row's causal
    # prefix, capped at the tree); the last row sees the most.
    last_row = tl.minimum(row0 + ROWS, q_len) - 1
    kv_hi = first_slot + last_row + 1
    um_end = tl.minimum(first_slot + row0 + 1, tree_start)
    kv_lo = 0
    if HAS_WINDOW:
        min_pos = tl.minimum(first_slot + row0, tree_start)
        kv_lo = tl.maximum(min_pos - sliding_window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    um_full = kv_lo + ((um_end - kv_lo) // BLOCK_N) * BLOCK_N  # end of the full unmasked tiles
    um_full = tl.maximum(um_full, kv_lo)

    # This split's share of [kv_lo, kv_hi), in whole BLOCK_N tiles.
    n_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    s_lo = kv_lo + split * tiles_per_split * BLOCK_N
    s_hi = tl.minimum(s_lo + tiles_per_split * BLOCK_N, kv_hi)

    if HAS_SINKS and not SPLIT_KV:
        # The sink is one extra logit in the denominator: start the running
        # softmax from it (m = sink, l = 1, acc = 0).
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
        m_i = sink * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)

    block_table_row_ptr = block_table_ptr + b * stride_bt

    # 1) prefix tiles: visible to every row of the tile (only the window can mask)
    for start in range(s_lo, tl.minimum(s_hi, um_full), BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, start,
            k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            qk_scale, softcap,
            seq_len, tree_start, q_slot, q_pos, is_node, mask_row_ptr, node_depth_ptr, row_valid,
            sliding_window,
            HEAD_DIM, HEAD_DIM_P, BLOCK_N, PAGE_SIZE,
            False, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, UPCAST,
        )  # fmt: skip
    # 2) tail tiles: causal diagonal and the tree, full mask
    for start in range(tl.maximum(s_lo, um_full), s_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, start,
            k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            qk_scale, softcap,
            seq_len, tree_start, q_slot, q_pos, is_node, mask_row_ptr, node_depth_ptr, row_valid,
            sliding_window,
            HEAD_DIM, HEAD_DIM_P, BLOCK_N, PAGE_SIZE,
            True, HAS_WINDOW, HAS_SOFTCAP, DOT_PRECISION, UPCAST,
        )  # fmt: skip

    out_rows = (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    out_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    if SPLIT_KV:
        # Partial result of this split: normalised output and its log2-sum-exp
        # (-inf when the split saw no key of the row).
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        split64 = split.to(tl.int64)
        tl.store(out_ptr + split64 * stride_os + out_rows, acc / l_safe[:, None], mask=out_mask)
        lse_off = split64 * stride_ls + (q_start + row) * stride_lt + head
        tl.store(lse_ptr + lse_off, lse, mask=row_valid)
    else:
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]  # padding lanes have l = 0
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ls"])
def tree_attention_combine_kernel(
    out_ptr,  # [T_q, H_q, D] q.dtype
    part_ptr,  # [num_splits, T_q, H_q, D] fp32 normalised partial outputs (contiguous)
    lse_ptr,  # [num_splits, T_q, H_q] fp32 log2-sum-exp per split (contiguous)
    sinks_ptr,  # [H_q] fp32; HAS_SINKS only
    num_splits,
    stride_ot,
    stride_oh,
    stride_ps,  # split stride of part (T_q * H_q * D)
    stride_ls,  # split stride of lse (T_q * H_q)
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,  # next power of two >= num_splits
    HAS_SINKS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_P)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_ptr + offs_s * stride_ls + t * NUM_HEADS + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)  # [SPLITS_P], 0 for empty splits
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_use)
    part_ptrs = part_ptr + offs_s[:, None] * stride_ps + (t * NUM_HEADS + h) * HEAD_DIM + offs_d[None, :]
    part = tl.load(part_ptrs, mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :] & (w > 0.0)[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / denom
    out_ptrs = out_ptr + t * stride_ot + h * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
