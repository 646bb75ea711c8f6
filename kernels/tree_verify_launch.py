"""Typed launcher for the batched tree-verification Triton kernel (kernel in `tree_verify.py`).

Runs natively on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1`
(tests). Triton is imported lazily inside the launchers, so the PyTorch helpers
here (`exact_row_sum`, `verify_batch_exact_sums`, `tree_verify_inputs`) work
without Triton.

Contract: `tree_verify_triton` / `verify_batch_triton` return exactly what
`vllm_tree_spec.verify.verify_batch` returns for the same trees, probabilities,
modes, coins, EOS ids and token budgets -- integer outputs bit for bit. Greedy
and deterministic requests match the current `verify_batch` unconditionally.
Sampled requests reduce the residual mass with an order-independent
fixed-point sum (`exact_row_sum`); they match `verify_batch` bit for bit when
its row sums are the same (`verify_batch_exact_sums`, or verify/ with the
change proposed in docs/kernels.md), and otherwise agree except when a coin or
a race lands within float rounding of a boundary (probability ~1e-16 per
decision at float64, ~1e-7 at float32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm_tree_spec.tree import TreeBatch
from vllm_tree_spec.verify import Mode, TreeVerifyOutput, VerifyCoins, _as_modes, verify_batch

FIXED_POINT_BITS = 60  # exact sums: entries become int64 multiples of 2^-60
_PROB_DTYPES = (torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------
# PyTorch twins of the kernel's numerics


def exact_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Order-independent sum over the last dim (keepdim), bit-identical on CPU, CUDA and in the kernel.

    Entries (probabilities, 0 <= x < 8 per row total) are truncated to int64
    multiples of 2^-60 and added as integers, so no summation order can change
    the result; the int64 total is converted through two exact 32-bit halves so
    it is rounded once (to float64), then once more to x.dtype. Absolute error
    <= V * 2^-60 (~1.1e-13 at V = 128k) -- below float32 rounding of the
    entries themselves, and it enters the verifier's law only as an absolute
    O(V * 2^-60) perturbation.
    """
    n = (x.to(torch.float64) * float(2**FIXED_POINT_BITS)).to(torch.int64).sum(-1, keepdim=True)
    hi, lo = n >> 32, n & 0xFFFFFFFF
    z = (hi.to(torch.float64) * float(2**32) + lo.to(torch.float64)) * float(2.0**-FIXED_POINT_BITS)
    return z.to(x.dtype)


class _ExactRowSums(torch.Tensor):
    """A tensor whose last-dim sums are `exact_row_sum` (everything else is plain PyTorch).

    Wrapping p and q in it makes the unmodified `verify_batch` compute its
    residual and without-replacement masses the way the kernel does.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.sum, torch.sum) and args and args[0].is_floating_point():
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            x = args[0]
            if dim in (-1, (-1,), [-1], x.dim() - 1) and "dtype" not in kwargs:
                with torch._C.DisableTorchFunctionSubclass():
                    s = exact_row_sum(x.as_subclass(torch.Tensor))
                    s = s if keepdim else s.squeeze(-1)
                return s.as_subclass(cls)
        return super().__torch_function__(func, types, args, kwargs)


def verify_batch_exact_sums(batch, target_probs, draft_probs, modes, coins=None, **kwargs) -> TreeVerifyOutput:
    """`verify_batch` with its two row sums replaced by `exact_row_sum` (the kernel's PyTorch twin).

    Identical to `verify_batch` for greedy / deterministic requests; for the
    sampled modes it is the reference the kernel matches bit for bit.
    """
    p = target_probs.as_subclass(_ExactRowSums)
    q = None if draft_probs is None else draft_probs.as_subclass(_ExactRowSums)
    out = verify_batch(batch, p, q, modes, coins, **kwargs)
    return TreeVerifyOutput(*(t.as_subclass(torch.Tensor) for t in
                              (out.accepted_nodes, out.num_accepted, out.next_token, out.output_token_ids)))


# ---------------------------------------------------------------------------
# Tree tensors


@dataclass(frozen=True)
class TreeVerifyInputs:
    """The tree half of the kernel's inputs (from `tree_verify_inputs`)."""

    cu_num_rows: torch.Tensor  # [B + 1] row offsets (root first)
    node_tokens: torch.Tensor  # [T] draft tokens, request-major
    first_child: torch.Tensor  # [B, M + 1] local row of the first child, -1 = leaf
    next_sibling: torch.Tensor  # [B, M + 1] local row of the next sibling, -1 = last
    max_depth: int  # D
    max_children: int  # K (coins need uniform[:, :, :K])


def tree_verify_inputs(
    batch: TreeBatch, device: torch.device | str, dtype: torch.dtype = torch.int32
) -> TreeVerifyInputs:
    """Device tensors for the kernel from a `TreeBatch` (tokens required)."""
    if any(t.tokens is None and t.num_nodes for t in batch.trees):
        raise ValueError("every tree of the batch needs tokens for verification")
    return TreeVerifyInputs(
        cu_num_rows=batch.cu_num_rows.to(device=device, dtype=dtype),
        node_tokens=batch.tokens.to(device=device, dtype=dtype),
        first_child=batch.first_child.to(device=device, dtype=dtype),
        next_sibling=batch.next_sibling.to(device=device, dtype=dtype),
        max_depth=batch.max_depth,
        max_children=batch.max_children,
    )


# ---------------------------------------------------------------------------
# Launch configuration


@dataclass(frozen=True)
class TreeVerifyConfig:
    block_v: int  # vocabulary tile streamed per step
    num_warps: int


def pick_config(vocab_size: int) -> TreeVerifyConfig:
    """BLOCK_V / warps by vocabulary size.

    vLLM's rejection kernels use num_warps=1; this program streams the whole
    vocabulary several times per visited row (argmax, residual passes, race),
    so large vocabularies get wider tiles and more warps to keep loads in flight.
    """
    v = 1 << max(0, (int(vocab_size) - 1).bit_length())
    if v >= 16384:
        return TreeVerifyConfig(2048, 8)
    block = min(v, 1024)
    return TreeVerifyConfig(max(16, block), max(1, min(4, block // 256)))


def _check(name: str, t: torch.Tensor, dtypes, dim: int | None = None) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")


def tree_verify_triton(
    cu_num_rows: torch.Tensor,  # [B + 1] int32/int64 row offsets (root row first)
    node_tokens: torch.Tensor,  # [T] int32/int64 draft tokens, T = R - B
    first_child: torch.Tensor,  # [B, M + 1] int32/int64 local rows, -1 = none
    next_sibling: torch.Tensor,  # [B, M + 1] int32/int64 local rows, -1 = none
    target_probs: torch.Tensor,  # [R, V] fp32/fp64 p per row
    draft_probs: torch.Tensor | None,  # [R, V] same dtype, q per row (sampled modes)
    modes: torch.Tensor,  # [B] int32/int64 `Mode` values
    uniform: torch.Tensor | None,  # [B, >= D + 1, >= K] float64 (sampled modes)
    exponential: torch.Tensor | None,  # [B, >= D + 1, V] float (deterministic / sampled modes)
    *,
    max_depth: int,
    eos_token_id: torch.Tensor | None = None,  # [B] int64, -1 = none
    max_tokens: torch.Tensor | None = None,  # [B] int64 >= 1
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: TreeVerifyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify B draft trees in one launch (grid (B,)).

    Returns (output_token_ids [B, D + 1], num_accepted [B], accepted_nodes [B, D],
    next_token [B]), all int64, in vLLM's layout: output row b holds the
    accepted tokens then the recovered / bonus token, PLACEHOLDER (-1) padded;
    accepted_nodes holds local node indices (row - 1), -1 padded. Semantics are
    `verify_batch`'s (module docstring): each visited row emits one token
    distributed as p; EOS (inclusive) and max_tokens cut the emitted sequence.

    No device-to-host synchronisation: max_depth (D) comes from the host tree
    metadata. Preconditions not checked on the device: coins cover every
    (depth, sibling rank) the trees reach; draft_probs is given if a request
    uses a sampled mode; probability rows sum to ~1 (< 8); max_tokens >= 1.
    `out` = preallocated result tensors and `workspace` = (p_work, q_work), two
    [B, 2, V] tensors in the probability dtype (used by sampled modes only),
    keep the launch CUDA-graph capturable.
    """
    from .tree_verify import tree_verify_kernel

    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [R, V], got {tuple(target_probs.shape)}")
    _check("target_probs", target_probs, _PROB_DTYPES)
    rows, vocab = target_probs.shape
    batch = cu_num_rows.shape[0] - 1
    device = target_probs.device
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"the Triton tree-verification kernel needs CUDA tensors (got {device}); on CPU set "
            f"TRITON_INTERPRET=1 before importing triton, or call vllm_tree_spec.verify.verify_batch"
        )
    _check("cu_num_rows", cu_num_rows, _INDEX_DTYPES, 1)
    _check("node_tokens", node_tokens, _INDEX_DTYPES, 1)
    _check("first_child", first_child, _INDEX_DTYPES, 2)
    _check("next_sibling", next_sibling, _INDEX_DTYPES, 2)
    _check("modes", modes, _INDEX_DTYPES, 1)
    if first_child.shape != next_sibling.shape or first_child.shape[0] != batch or modes.shape[0] != batch:
        raise ValueError(
            f"{batch} requests need first_child / next_sibling [B, M + 1] and modes [B]; got "
            f"{tuple(first_child.shape)}, {tuple(next_sibling.shape)}, {tuple(modes.shape)}"
        )
    if first_child.stride(1) != 1 or next_sibling.stride(0) != first_child.stride(0):
        raise ValueError("first_child / next_sibling must be row-contiguous with equal strides")
    if target_probs.stride(1) != 1:
        raise ValueError("target_probs rows must be contiguous")
    if draft_probs is not None:
        if draft_probs.shape != target_probs.shape or draft_probs.dtype != target_probs.dtype:
            raise ValueError(
                f"draft_probs {tuple(draft_probs.shape)} {draft_probs.dtype} must match target_probs "
                f"{tuple(target_probs.shape)} {target_probs.dtype}"
            )
        if draft_probs.stride(1) != 1:
            raise ValueError("draft_probs rows must be contiguous")
    d = int(max_depth)
    if uniform is not None:
        _check("uniform", uniform, (torch.float64,), 3)
        if uniform.shape[0] < batch or uniform.shape[1] < d + 1:
            raise ValueError(f"uniform must be [B, >= D + 1, K] = [{batch}, >= {d + 1}, K], got {tuple(uniform.shape)}")
        if uniform.stride(2) != 1:
            raise ValueError("uniform must be contiguous in its last dim")
    if exponential is not None:
        if exponential.dim() != 3 or exponential.shape[0] < batch or exponential.shape[1] < d + 1 \
                or exponential.shape[2] != vocab:
            raise ValueError(
                f"exponential must be [B, >= D + 1, V] = [{batch}, >= {d + 1}, {vocab}], got {tuple(exponential.shape)}"
            )
        if not exponential.is_floating_point() or exponential.stride(2) != 1:
            raise ValueError("exponential must be a float tensor contiguous in its last dim")
    for name, t in (("eos_token_id", eos_token_id), ("max_tokens", max_tokens)):
        if t is not None:
            _check(name, t, _INDEX_DTYPES, 1)
            if t.shape[0] != batch:
                raise ValueError(f"{name} must be [B] = [{batch}], got {tuple(t.shape)}")
    tensors = [cu_num_rows, node_tokens, first_child, next_sibling, modes]
    tensors += [t for t in (draft_probs, uniform, exponential, eos_token_id, max_tokens) if t is not None]
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all inputs must be on {device}; found a tensor on {t.device}")

    if out is None:
        out = (
            torch.empty(batch, d + 1, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, d, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
        )
    output_token_ids, num_accepted, accepted_nodes, next_token = out
    if output_token_ids.shape != (batch, d + 1) or accepted_nodes.shape != (batch, d):
        raise ValueError(f"out tensors must be [B, D + 1] / [B] / [B, D] / [B] with B = {batch}, D = {d}")
    if batch == 0:
        return out
    has_draft = draft_probs is not None
    if has_draft and workspace is None:
        workspace = (
            torch.empty(batch, 2, vocab, dtype=target_probs.dtype, device=device),
            torch.empty(batch, 2, vocab, dtype=target_probs.dtype, device=device),
        )
    dummy_f = torch.zeros(1, 1, 1, dtype=target_probs.dtype, device=device)
    dummy_i = torch.zeros(1, dtype=torch.int64, device=device)
    p_work, q_work = workspace if has_draft else (dummy_f, dummy_f)
    if has_draft and any(w.shape != (batch, 2, vocab) or w.stride(2) != 1 for w in (p_work, q_work)):
        raise ValueError(f"workspace must be two [B, 2, V] tensors (B = {batch}, V = {vocab}), rows contiguous")
    uni = uniform if uniform is not None else torch.zeros(1, 1, 1, dtype=torch.float64, device=device)
    exp_ = exponential if exponential is not None else torch.ones(1, 1, vocab, dtype=target_probs.dtype, device=device)
    acc_arg = accepted_nodes if d > 0 else dummy_i.view(1, 1)
    cfg = config or pick_config(vocab)
    depth_p = 1 << max(0, d).bit_length()  # power of two > D
    tree_verify_kernel[(batch,)](
        output_token_ids, num_accepted, acc_arg, next_token,
        cu_num_rows, node_tokens if node_tokens.numel() else dummy_i, first_child, next_sibling, modes,
        target_probs, draft_probs if has_draft else target_probs, uni, exp_,
        eos_token_id if eos_token_id is not None else dummy_i,
        max_tokens if max_tokens is not None else dummy_i,
        p_work, q_work,
        vocab, d,
        output_token_ids.stride(0), acc_arg.stride(0), first_child.stride(0),
        target_probs.stride(0), (draft_probs if has_draft else target_probs).stride(0),
        uni.stride(0), uni.stride(1), exp_.stride(0), exp_.stride(1),
        p_work.stride(0), p_work.stride(1), q_work.stride(0), q_work.stride(1),
        HAS_DRAFT=has_draft,
        HAS_EOS=eos_token_id is not None,
        HAS_MAX_TOKENS=max_tokens is not None,
        DEPTH_P=max(2, depth_p),
        BLOCK_V=cfg.block_v,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def verify_batch_triton(
    batch: TreeBatch,
    target_probs: torch.Tensor,  # [R, V]
    draft_probs: torch.Tensor | None,  # [R, V] or None
    modes,
    coins: VerifyCoins | None = None,
    *,
    eos_token_id: torch.Tensor | None = None,
    max_tokens: torch.Tensor | None = None,
    config: TreeVerifyConfig | None = None,
    inputs: TreeVerifyInputs | None = None,
) -> TreeVerifyOutput:
    """Drop-in for `verify_batch` (same arguments and result) running the Triton kernel.

    Host-side checks as in `verify_batch` (modes needing draft_probs, coins
    drawn when None, max_tokens >= 1). `inputs` = precomputed
    `tree_verify_inputs(batch, device)` (saves the host-to-device copies).
    """
    device = target_probs.device
    B, V, D = batch.batch_size, target_probs.shape[1], batch.max_depth
    mode_t = _as_modes(modes, B)
    present = set(mode_t.tolist())
    if any(Mode(m).needs_draft_probs for m in present) and draft_probs is None:
        raise ValueError("draft_probs is required when a request uses a sampled mode")
    if coins is None and present - {int(Mode.GREEDY)}:
        coins = VerifyCoins.draw(B, D, batch.max_children, V, dtype=target_probs.dtype, device=device)
    if coins is not None:
        k = max(1, batch.max_children)
        if coins.uniform.shape[1] < D + 1 or coins.uniform.shape[2] < k:
            raise ValueError(
                f"coins.uniform {tuple(coins.uniform.shape)} does not cover [B, D + 1, K] = [{B}, {D + 1}, {k}]"
            )
    if max_tokens is not None:
        max_tokens = torch.as_tensor(max_tokens, dtype=torch.long, device=device).expand(B).contiguous()
        if bool((max_tokens < 1).any()):
            raise ValueError("max_tokens must be >= 1 for every request")
    if eos_token_id is not None:
        eos_token_id = torch.as_tensor(eos_token_id, dtype=torch.long, device=device).expand(B).contiguous()
    tin = inputs or tree_verify_inputs(batch, device)
    has_draft = draft_probs is not None and bool(present & {int(Mode.SAMPLED), int(Mode.SAMPLED_WITHOUT_REPLACEMENT)})
    out_ids, num_acc, acc_nodes, nxt = tree_verify_triton(
        tin.cu_num_rows, tin.node_tokens, tin.first_child, tin.next_sibling,
        target_probs, draft_probs if has_draft else None, mode_t.to(device=device, dtype=torch.int32),
        None if coins is None else coins.uniform, None if coins is None else coins.exponential,
        max_depth=D, eos_token_id=eos_token_id, max_tokens=max_tokens, config=config,
    )  # fmt: skip
    return TreeVerifyOutput(acc_nodes, num_acc, nxt, out_ids)


__all__ = [
    "FIXED_POINT_BITS",
    "TreeVerifyConfig",
    "TreeVerifyInputs",
    "exact_row_sum",
    "pick_config",
    "tree_verify_inputs",
    "tree_verify_triton",
    "verify_batch_exact_sums",
    "verify_batch_triton",
]
