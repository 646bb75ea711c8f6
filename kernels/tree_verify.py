"""Triton kernel for batched lossless tree verification (`@triton.jit` code only).

The typed launcher, whose docstring states the contract, is
`vllm_tree_spec.kernels.tree_verify_launch.tree_verify_triton`; the PyTorch
twin is `vllm_tree_spec.verify.verify_batch` (the rules of the four modes are
in `vllm_tree_spec/verify/` and docs/kernels.md). The GPU serving path calls it
through `verify_batch_triton` (`integration/tree_sampler.py::verify_rows`).

One program per request (grid (B,), like vLLM's rejection-sampler kernels)
walks its tree from the root with first_child / next_sibling over rows. At a
visited row it streams the vocabulary in BLOCK_V tiles:

    greedy          y = argmax p                 (first index on ties; or read from target_argmax)
    deterministic   y = argmax p / E[depth]      (exponential race)
    sampled(_wor)   per child x in sibling order: accept if u[depth, j] < p(x) / q(x),
                    else p <- norm(max(0, p - q)) [wor: q[x] <- 0, q <- norm(q)];
                    when every child is rejected, y = argmax p / E[depth]

and accepts the child that matches (greedy / deterministic) or passed the test.

Numerics: every float op is the one PyTorch performs, in the same dtype, so the
integer outputs are bit-identical to `verify_batch` given the same coins:
divisions are IEEE round-to-nearest (`tl.math.div_rn` for fp32: Triton's fp32
`/` is the approximate div.full.f32 on NVIDIA GPUs); argmax keeps the first
index of the maximum across tiles; the ratio is formed in the probability
dtype, then widened to float64 for the strict `u < ratio`. The only reductions
that produce floats -- the residual mass and the without-replacement q mass --
are **exact fixed-point sums** (entries truncated to int64 multiples of 2^-60
and added as integers, then converted with one rounding), which do not depend
on summation order: `verify/rules.py::row_sum`, the sum `verify_batch` uses.

EOS / stop ids and max_tokens cut the emitted tokens, but the walk goes on to
where `verify_batch`'s walk stops (its `walked`: a deterministic walk read
walked + 1 exponential rows), writing nothing past the cut.

Residuals are kept lazily normalised: a workspace row holds r = max(0, p - q)
and a scalar z = sum(r); readers compute p = r / z elementwise, exactly the
values `r / z` PyTorch materialises (one pass over V per rejected child
instead of two). Two buffers alternate for p and for q, so no pass updates in
place and a row whose residual mass rounds to zero keeps its previous p
(verify.py's `where(z > 0, r / z, p)`). Barriers around each pass keep warps
from overwriting a buffer another warp still reads and make the written tiles
visible to the scalar p(x) / q(x) loads of the next child.
"""

import triton
import triton.language as tl

GREEDY = tl.constexpr(0)
DETERMINISTIC = tl.constexpr(1)
SAMPLED = tl.constexpr(2)
SAMPLED_WITHOUT_REPLACEMENT = tl.constexpr(3)
PLACEHOLDER_TOKEN_ID = tl.constexpr(-1)
NO_NODE = tl.constexpr(-1)
FIXED_ONE = tl.constexpr(1152921504606846976.0)  # 2^60: one unit of probability in fixed point
FIXED_ULP = tl.constexpr(8.673617379884035e-19)  # 2^-60
TWO_32 = tl.constexpr(4294967296.0)


@triton.jit
def _div(a, b, IS_F64: tl.constexpr):
    """IEEE round-to-nearest a / b (PyTorch's division)."""
    if IS_F64:
        return a / b  # div.rn.f64
    else:
        return tl.math.div_rn(a, b)  # fp32 `/` would be the approximate div.full.f32


@triton.jit
def _to_fixed(x):
    """x in [0, 8) -> int64 multiple of 2^-60 (truncation; exact scaling by a power of two)."""
    return (x.to(tl.float64) * FIXED_ONE).to(tl.int64)


@triton.jit
def _from_fixed(n, DTYPE: tl.constexpr):
    """int64 n >= 0 -> n * 2^-60 in DTYPE: 32-bit halves are exact in float64, so the add rounds once."""
    hi = n >> 32
    lo = n - (hi << 32)
    z = (hi.to(tl.float64) * TWO_32 + lo.to(tl.float64)) * FIXED_ULP
    return z.to(DTYPE)


@triton.jit
def _tiny(IS_F64: tl.constexpr):
    """torch.finfo(dtype).tiny (smallest normal), built from its bits (float literals are fp32 in Triton)."""
    if IS_F64:
        return tl.full([], 0x0010000000000000, tl.int64).to(tl.float64, bitcast=True)
    else:
        return tl.full([], 0x00800000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _load_state(row_ptr, work_ptr, src, offs, mask):
    """Current distribution tile: the input row (src < 0) or workspace buffer `src` (lazily normalised)."""
    src_v = src + offs * 0  # broadcast first: Triton 3.9's interpreter turns bool-tensor & bool-scalar into int8
    a = tl.load(row_ptr + offs, mask=mask & (src_v < 0), other=0.0)
    b = tl.load(work_ptr + offs, mask=mask & (src_v >= 0), other=0.0)
    return tl.where(src_v < 0, a, b)


@triton.jit
def _draw_pass(
    p_row_ptr,  # [V] target row (input)
    p_work_ptr,  # [2, V] this request's residual buffers
    p_src,  # -1: p is the input row; 0 / 1: residual buffer
    zp,  # scalar: p = buffer / zp
    e_row_ptr,  # [V] exponentials of this depth
    use_e,  # 0: argmax p (greedy); 1: argmax p / E (exponential race)
    vocab_size,
    stride_w,  # elements between the two residual buffers
    DTYPE: tl.constexpr,
    IS_F64: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """argmax over the vocabulary of p (or p / E), first index on ties, streaming BLOCK_V tiles."""
    best_val = tl.full([], float("-inf"), DTYPE)
    best_idx = tl.full([], 0, tl.int64)
    src_ptr = p_work_ptr + tl.maximum(p_src, 0) * stride_w
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        m = offs < vocab_size
        p = _div(_load_state(p_row_ptr, src_ptr, p_src, offs, m), zp, IS_F64)
        e = tl.load(e_row_ptr + offs, mask=m & ((use_e + offs * 0) != 0), other=1.0).to(DTYPE)
        v = tl.where(use_e != 0, _div(p, e, IS_F64), p)
        v = tl.where(m, v, float("-inf"))
        tile_max = tl.max(v, 0)
        tile_idx = tl.min(tl.where(v == tile_max, offs, vocab_size), 0)
        better = tile_max > best_val  # strict: an equal later maximum keeps the earlier index
        best_idx = tl.where(better, tile_idx, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    return best_idx


# Batch-dependent sizes and strides change every step; do not recompile for them.
@triton.jit(do_not_specialize=["max_depth", "stride_out", "stride_acc", "stride_tree", "stride_ub", "stride_ud",
                               "stride_eb", "stride_ed", "stride_xb", "stride_eos", "num_stops"])
def tree_verify_kernel(
    output_token_ids_ptr,  # [B, D + 1] int64, PLACEHOLDER_TOKEN_ID padded
    num_accepted_ptr,  # [B] int64
    accepted_nodes_ptr,  # [B, D] int64 local node indices, NO_NODE padded
    next_token_ptr,  # [B] int64 recovered / bonus token (last emitted)
    walked_ptr,  # [B] int64 accepted nodes before the EOS / max_tokens cut
    cu_num_rows_ptr,  # [B + 1] row offsets; request b owns rows cu[b] .. cu[b+1]-1 (root first)
    node_tokens_ptr,  # [T] draft tokens, request-major (node i of b at cu[b] - b + i)
    first_child_ptr,  # [B, M + 1] local row of the first child, NO_NODE for a leaf
    next_sibling_ptr,  # [B, M + 1] local row of the next sibling, NO_NODE for the last
    modes_ptr,  # [B] verification mode (0 greedy, 1 deterministic, 2 sampled, 3 sampled w/o replacement)
    target_probs_ptr,  # [R, V] p per row (greedy rows unread when HAS_ARGMAX)
    target_argmax_ptr,  # [R] int64 argmax of p per row: greedy requests' draw (HAS_ARGMAX)
    draft_probs_ptr,  # [R, V] q per row (HAS_DRAFT)
    uniform_ptr,  # [B, >= D + 1, >= K] float64 coins (depth, sibling rank)
    exponential_ptr,  # [B, >= D + 1, V] Exp(1) noise for the draw at each depth; HAS_EXP_INDEX: [E, V] rows
    exp_index_ptr,  # [B, >= D + 1] int64 row of exponential read at (request, depth) (HAS_EXP_INDEX)
    eos_ptr,  # [B, S] int64 stop ids (EOS and stop_token_ids), -1 = none (HAS_EOS)
    max_tokens_ptr,  # [B] int64 remaining token budget >= 1 (HAS_MAX_TOKENS)
    p_work_ptr,  # [B, 2, V] residual buffers (HAS_DRAFT)
    q_work_ptr,  # [B, 2, V] renormalised q buffers (HAS_DRAFT)
    vocab_size,
    max_depth,  # D = output width - 1
    stride_out,
    stride_acc,
    stride_tree,
    stride_p,
    stride_q,
    stride_ub,
    stride_ud,
    stride_eb,
    stride_ed,
    stride_xb,
    stride_eos,
    num_stops,  # S
    stride_pw_b,
    stride_pw_buf,
    stride_qw_b,
    stride_qw_buf,
    HAS_DRAFT: tl.constexpr,
    HAS_ARGMAX: tl.constexpr,
    HAS_EXP_INDEX: tl.constexpr,
    HAS_EOS: tl.constexpr,
    HAS_MAX_TOKENS: tl.constexpr,
    DEPTH_P: tl.constexpr,  # next power of two >= D + 1 (padding stores)
    STOPS_P: tl.constexpr,  # next power of two >= S
    BLOCK_V: tl.constexpr,
):
    DTYPE: tl.constexpr = target_probs_ptr.dtype.element_ty
    IS_F64: tl.constexpr = DTYPE == tl.float64
    pid = tl.program_id(0).to(tl.int64)
    row0 = tl.load(cu_num_rows_ptr + pid).to(tl.int64)
    node0 = row0 - pid  # global index of this request's node 0
    mode = tl.load(modes_ptr + pid).to(tl.int32)
    s_offs = tl.arange(0, STOPS_P).to(tl.int64)
    stops = tl.full([STOPS_P], -1, tl.int64)
    if HAS_EOS:
        stops = tl.load(eos_ptr + pid * stride_eos + s_offs, mask=s_offs < num_stops, other=-1).to(tl.int64)
    budget = tl.full([], 1 << 62, tl.int64)
    if HAS_MAX_TOKENS:
        budget = tl.load(max_tokens_ptr + pid).to(tl.int64)
    out_row = output_token_ids_ptr + pid * stride_out
    acc_row_ptr = accepted_nodes_ptr + pid * stride_acc
    tree_row = pid * stride_tree
    one = tl.full([], 1.0, DTYPE)
    tiny = _tiny(IS_F64)
    pw = p_work_ptr + pid * stride_pw_b
    qw = q_work_ptr + pid * stride_qw_b

    row = tl.full([], 0, tl.int64)  # local row being visited (0 = root)
    count = tl.full([], 0, tl.int64)  # accepted nodes so far = depth of `row`
    cut = tl.full([], 0, tl.int64)  # 1 once EOS / max_tokens ended the round at an accepted token
    cut_count = tl.full([], 0, tl.int64)  # tokens emitted at the cut
    last_tok = tl.full([], PLACEHOLDER_TOKEN_ID, tl.int64)
    go = tl.full([], 1, tl.int32)
    while go != 0:
        grow = row0 + row
        p_row = target_probs_ptr + grow * stride_p
        if HAS_EXP_INDEX:
            e_row = exponential_ptr + tl.load(exp_index_ptr + pid * stride_xb + count).to(tl.int64) * stride_ed
        else:
            e_row = exponential_ptr + pid * stride_eb + count * stride_ed
        child = tl.load(first_child_ptr + tree_row + row).to(tl.int64)
        taken = tl.full([], NO_NODE, tl.int64)  # local row of the accepted child
        y = tl.full([], PLACEHOLDER_TOKEN_ID, tl.int64)
        if mode <= DETERMINISTIC:
            # One draw from p (argmax, or the exponential race); accept the first child carrying it.
            use_e = (mode == DETERMINISTIC).to(tl.int32)
            if HAS_ARGMAX:
                if mode == GREEDY:
                    y = tl.load(target_argmax_ptr + grow).to(tl.int64)
                else:
                    y = _draw_pass(p_row, pw, tl.full([], -1, tl.int64), one, e_row, use_e, vocab_size,
                                   stride_pw_buf, DTYPE, IS_F64, BLOCK_V)
            else:
                y = _draw_pass(p_row, pw, tl.full([], -1, tl.int64), one, e_row, use_e, vocab_size, stride_pw_buf,
                               DTYPE, IS_F64, BLOCK_V)
            while (child >= 0) & (taken < 0):
                tok = tl.load(node_tokens_ptr + node0 + child - 1).to(tl.int64)
                if tok == y:
                    taken = child
                else:
                    child = tl.load(next_sibling_ptr + tree_row + child).to(tl.int64)
        else:
            if HAS_DRAFT:
                q_row = draft_probs_ptr + grow * stride_q
                p_src = tl.full([], -1, tl.int64)  # p = input row (scale 1) until the first rejection
                q_src = tl.full([], -1, tl.int64)
                zp = one
                zq = one
                rank = tl.full([], 0, tl.int64)
                while (child >= 0) & (taken < 0):
                    x = tl.load(node_tokens_ptr + node0 + child - 1).to(tl.int64)
                    p_buf = pw + tl.maximum(p_src, 0) * stride_pw_buf
                    q_buf = qw + tl.maximum(q_src, 0) * stride_qw_buf
                    px = _div(_load_state(p_row, p_buf, p_src, x, x >= 0), zp, IS_F64)
                    qx = _div(_load_state(q_row, q_buf, q_src, x, x >= 0), zq, IS_F64)
                    # q(x) = 0 cannot have been drafted: reject rather than divide by zero.
                    ratio = tl.where(qx > 0, _div(px, tl.where(qx > 0, qx, one), IS_F64), 0.0)
                    u = tl.load(uniform_ptr + pid * stride_ub + count * stride_ud + rank)
                    if u < ratio.to(tl.float64):  # strict: p(x) = 0 is never accepted
                        taken = child
                    else:
                        # p <- norm(max(0, p - q)); wor: q[x] <- 0, q <- norm(q). One pass over V,
                        # into the other buffer of each pair (never in place).
                        p_dst = tl.where(p_src == 0, 1, 0).to(tl.int64)
                        q_dst = tl.where(q_src == 0, 1, 0).to(tl.int64)
                        p_out = pw + p_dst * stride_pw_buf
                        q_out = qw + q_dst * stride_qw_buf
                        r_acc = tl.zeros([BLOCK_V], tl.int64)
                        q_acc = tl.zeros([BLOCK_V], tl.int64)
                        # Warps may drift: none may still be reading a buffer this pass overwrites.
                        tl.debug_barrier()
                        for v0 in range(0, vocab_size, BLOCK_V):
                            offs = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
                            m = offs < vocab_size
                            p = _div(_load_state(p_row, p_buf, p_src, offs, m), zp, IS_F64)
                            q = _div(_load_state(q_row, q_buf, q_src, offs, m), zq, IS_F64)
                            r = tl.maximum(p - q, 0.0)
                            tl.store(p_out + offs, r, mask=m)
                            r_acc += tl.where(m, _to_fixed(r), 0)
                            if mode == SAMPLED_WITHOUT_REPLACEMENT:
                                qn = tl.where(offs == x, 0.0, q)
                                tl.store(q_out + offs, qn, mask=m)
                                q_acc += tl.where(m, _to_fixed(qn), 0)
                        # The next child's p(x), q(x) are scalar loads of elements other threads wrote.
                        tl.debug_barrier()
                        z = _from_fixed(tl.sum(r_acc, 0), DTYPE)
                        if z > 0:  # else keep p (an all-zero residual can only come from rounding)
                            p_src = p_dst
                            zp = z
                        if mode == SAMPLED_WITHOUT_REPLACEMENT:
                            q_src = q_dst
                            zq = tl.maximum(_from_fixed(tl.sum(q_acc, 0), DTYPE), tiny)
                        child = tl.load(next_sibling_ptr + tree_row + child).to(tl.int64)
                        rank += 1
                if taken < 0:
                    # Every child rejected (or a leaf): the recovered / bonus token from the residual.
                    y = _draw_pass(p_row, pw, p_src, zp, e_row, tl.full([], 1, tl.int32), vocab_size, stride_pw_buf,
                                   DTYPE, IS_F64, BLOCK_V)
        if taken >= 0:
            tok = tl.load(node_tokens_ptr + node0 + taken - 1).to(tl.int64)
            count += 1
            if cut == 0:
                tl.store(out_row + count - 1, tok)
                is_stop = tl.sum(((stops == tok + s_offs * 0) & (stops >= 0)).to(tl.int32), 0) > 0
                if is_stop | (count >= budget):
                    # EOS / max_tokens: the accepted token is the last emitted one; the walk goes on
                    # (writing nothing) to where verify_batch's walk stops, for `walked`.
                    cut = tl.full([], 1, tl.int64)
                    cut_count = count
                    last_tok = tok
                else:
                    tl.store(acc_row_ptr + count - 1, taken - 1)
            row = taken
        else:
            if cut == 0:
                tl.store(out_row + count, y)
                last_tok = y
            go = tl.full([], 0, tl.int32)
    num_acc = tl.where(cut != 0, cut_count - 1, count)
    tl.store(num_accepted_ptr + pid, num_acc)
    tl.store(walked_ptr + pid, count)
    tl.store(next_token_ptr + pid, last_tok)
    pos = tl.arange(0, DEPTH_P).to(tl.int64)
    tl.store(out_row + pos, tl.full([DEPTH_P], PLACEHOLDER_TOKEN_ID, tl.int64),
             mask=(pos > num_acc) & (pos <= max_depth))
    tl.store(acc_row_ptr + pos, tl.full([DEPTH_P], NO_NODE, tl.int64), mask=(pos >= num_acc) & (pos < max_depth))
