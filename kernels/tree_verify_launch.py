"""Typed launcher for the batched tree-verification Triton kernel (kernel in `tree_verify.py`).

Runs natively on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1`
(tests). Triton is imported lazily inside the launchers, so the PyTorch helpers
here (`tree_verify_inputs`, `pick_config`) work without Triton.

Contract: `tree_verify_triton` / `verify_batch_triton` return exactly what
`vllm_tree_spec.verify.verify_batch` returns for the same trees, probabilities,
modes, coins, stop ids and token budgets -- integer outputs bit for bit, `walked`
included. The sampled modes' residual and without-replacement masses are the
order-independent fixed-point `row_sum` of `verify/rules.py` on both sides.

`verify_batch_triton` is the GPU serving path's verifier (`integration/tree_sampler.py::verify_rows`,
`VLLM_TREE_SPEC_VERIFY`). The served path draws its coins lazily (exponential rows only where the walk
goes); the kernel cannot draw, so lazy coins are materialised first (`VerifyCoins.materialise`): the rows
`verify_batch(sync_free=True)` draws, by the same calls in the same order, so a seeded request gives the
same tokens on either path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm_tree_spec.tree import TreeBatch
from vllm_tree_spec.verify import Mode, TreeVerifyOutput, VerifyCoins, _as_modes, upload

_PROB_DTYPES = (torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


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
    target_probs: torch.Tensor | None,  # [R, V] fp32/fp64 p per row; None: every request greedy (target_argmax)
    draft_probs: torch.Tensor | None,  # [R, V] same dtype, q per row (sampled modes)
    modes: torch.Tensor,  # [B] int32/int64 `Mode` values
    uniform: torch.Tensor | None,  # [B, >= D + 1, >= K] float64 (sampled modes)
    exponential: torch.Tensor | None,  # [B, >= D + 1, V], or [E, V] rows with exp_index (deterministic / sampled)
    *,
    max_depth: int,
    exp_index: torch.Tensor | None = None,  # [B, >= D + 1] int64: the row of `exponential` read at (b, depth)
    target_argmax: torch.Tensor | None = None,  # [R] int64 argmax of p: greedy requests read it instead of p
    eos_token_id: torch.Tensor | None = None,  # [B] or [B, S] int64 stop ids, -1 = none
    max_tokens: torch.Tensor | None = None,  # [B] int64 >= 1
    out: tuple[torch.Tensor, ...] | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: TreeVerifyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify B draft trees in one launch (grid (B,)).

    Returns (output_token_ids [B, D + 1], num_accepted [B], accepted_nodes [B, D],
    next_token [B], walked [B]), all int64, in vLLM's layout: output row b holds the
    accepted tokens then the recovered / bonus token, PLACEHOLDER (-1) padded;
    accepted_nodes holds local node indices (row - 1), -1 padded; walked the
    accepted nodes before the EOS / max_tokens cut. Semantics are
    `verify_batch`'s (module docstring): each visited row emits one token
    distributed as p; the first stop id (inclusive) and max_tokens cut the emitted sequence.

    No device-to-host synchronisation: max_depth (D) comes from the host tree
    metadata. Preconditions not checked on the device: coins cover every
    (depth, sibling rank) the trees reach; draft_probs is given if a request
    uses a sampled mode; probability rows sum to ~1 (< 8); max_tokens >= 1;
    exp_index rows lie in exponential.
    `out` = preallocated result tensors (the five above) and `workspace` = (p_work, q_work), two
    [B, 2, V] tensors in the probability dtype (used by sampled modes only),
    keep the launch CUDA-graph capturable.
    """
    from .tree_verify import tree_verify_kernel

    probs_given = target_probs is not None
    if target_probs is None:
        if target_argmax is None:
            raise ValueError("target_probs is required unless every request is greedy and target_argmax is given")
        target_probs = torch.zeros(1, 1, dtype=torch.float32, device=target_argmax.device)  # never read
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
    if target_argmax is not None:
        _check("target_argmax", target_argmax, _INDEX_DTYPES, 1)
        if (probs_given and target_argmax.shape[0] != rows) or target_argmax.stride(0) != 1:
            raise ValueError(f"target_argmax must be a contiguous [R] tensor (R rows of target_probs), got "
                             f"{tuple(target_argmax.shape)}")
    d = int(max_depth)
    if uniform is not None:
        _check("uniform", uniform, (torch.float64,), 3)
        if uniform.shape[0] < batch or uniform.shape[1] < d + 1:
            raise ValueError(f"uniform must be [B, >= D + 1, K] = [{batch}, >= {d + 1}, K], got {tuple(uniform.shape)}")
        if uniform.stride(2) != 1:
            raise ValueError("uniform must be contiguous in its last dim")
    if exponential is not None:
        if exp_index is not None:
            _check("exp_index", exp_index, _INDEX_DTYPES, 2)
            if exp_index.shape[0] < batch or exp_index.shape[1] < d + 1 or exp_index.stride(1) != 1:
                raise ValueError(f"exp_index must be [B, >= D + 1] = [{batch}, >= {d + 1}] with contiguous rows, "
                                 f"got {tuple(exp_index.shape)}")
            if exponential.dim() != 2 or exponential.shape[1] != vocab:
                raise ValueError(f"with exp_index, exponential must be [E, V] = [E, {vocab}] rows, got "
                                 f"{tuple(exponential.shape)}")
        elif exponential.dim() != 3 or exponential.shape[0] < batch or exponential.shape[1] < d + 1 \
                or exponential.shape[2] != vocab:
            raise ValueError(
                f"exponential must be [B, >= D + 1, V] = [{batch}, >= {d + 1}, {vocab}], got {tuple(exponential.shape)}"
            )
        if not exponential.is_floating_point() or exponential.stride(-1) != 1:
            raise ValueError("exponential must be a float tensor contiguous in its last dim")
    if eos_token_id is not None:
        _check("eos_token_id", eos_token_id, _INDEX_DTYPES)
        if eos_token_id.dim() == 1:
            eos_token_id = eos_token_id[:, None]
        if eos_token_id.dim() != 2 or eos_token_id.shape[0] != batch or eos_token_id.stride(1) != 1:
            raise ValueError(f"eos_token_id must be [B] or [B, S] (rows contiguous) with B = {batch}, got "
                             f"{tuple(eos_token_id.shape)}")
    if max_tokens is not None:
        _check("max_tokens", max_tokens, _INDEX_DTYPES, 1)
        if max_tokens.shape[0] != batch:
            raise ValueError(f"max_tokens must be [B] = [{batch}], got {tuple(max_tokens.shape)}")
    tensors = [cu_num_rows, node_tokens, first_child, next_sibling, modes]
    tensors += [t for t in (draft_probs, uniform, exponential, exp_index, target_argmax, eos_token_id, max_tokens)
                if t is not None]
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all inputs must be on {device}; found a tensor on {t.device}")

    if out is None:
        out = (
            torch.empty(batch, d + 1, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, d, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
        )
    if len(out) != 5:
        raise ValueError("out must be five tensors: output_token_ids, num_accepted, accepted_nodes, next_token, walked")
    output_token_ids, num_accepted, accepted_nodes, next_token, walked = out
    if output_token_ids.shape != (batch, d + 1) or accepted_nodes.shape != (batch, d):
        raise ValueError(f"out tensors must be [B, D + 1] / [B] / [B, D] / [B] / [B] with B = {batch}, D = {d}")
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
    if exp_index is not None and exponential is not None:
        exp_ = exp_[None]  # [1, E, V]: row e of (request, depth) at e * stride_ed
        xi = exp_index
    else:
        xi = dummy_i.view(1, 1)
    eos2 = eos_token_id if eos_token_id is not None else dummy_i.view(1, 1)
    acc_arg = accepted_nodes if d > 0 else dummy_i.view(1, 1)
    cfg = config or pick_config(vocab)
    depth_p = 1 << max(0, d).bit_length()  # power of two > D
    tree_verify_kernel[(batch,)](
        output_token_ids, num_accepted, acc_arg, next_token, walked,
        cu_num_rows, node_tokens if node_tokens.numel() else dummy_i, first_child, next_sibling, modes,
        target_probs, target_argmax if target_argmax is not None else dummy_i,
        draft_probs if has_draft else target_probs, uni, exp_, xi, eos2,
        max_tokens if max_tokens is not None else dummy_i,
        p_work, q_work,
        vocab, d,
        output_token_ids.stride(0), acc_arg.stride(0), first_child.stride(0),
        target_probs.stride(0), (draft_probs if has_draft else target_probs).stride(0),
        uni.stride(0), uni.stride(1), exp_.stride(0), exp_.stride(1), xi.stride(0),
        eos2.stride(0), eos2.shape[1],
        p_work.stride(0), p_work.stride(1), q_work.stride(0), q_work.stride(1),
        HAS_DRAFT=has_draft,
        HAS_ARGMAX=target_argmax is not None,
        HAS_EXP_INDEX=exp_index is not None and exponential is not None,
        HAS_EOS=eos_token_id is not None,
        HAS_MAX_TOKENS=max_tokens is not None,
        DEPTH_P=max(2, depth_p),
        STOPS_P=max(2, 1 << max(0, eos2.shape[1] - 1).bit_length()),
        BLOCK_V=cfg.block_v,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def verify_batch_triton(
    batch: TreeBatch,
    target_probs: torch.Tensor | None,  # [R, V]; None when every request is greedy and target_argmax is given
    draft_probs: torch.Tensor | None,  # [R, V] or None
    modes,
    coins: VerifyCoins | None = None,
    *,
    eos_token_id: torch.Tensor | None = None,
    max_tokens: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
    sync_free: bool = False,
    config: TreeVerifyConfig | None = None,
    inputs: TreeVerifyInputs | None = None,
) -> TreeVerifyOutput:
    """Drop-in for `verify_batch` (same arguments and result, `walked` included) running the Triton kernel.

    Host-side checks as in `verify_batch` (modes needing draft_probs, coins drawn when None, max_tokens
    >= 1 where it is on the host). Eager coins are read as they are; lazy coins are materialised
    (`VerifyCoins.materialise`: the rows `verify_batch(sync_free=True)` would draw, drawn the same way;
    with track_streams, `rewind` afterwards as for `verify_batch`). Greedy requests read `target_argmax`
    when given (their p rows are never read). The tree metadata, modes, stop ids, budgets and the
    exponential row index go up in one host-to-device transfer; `sync_free` is accepted for the
    signature's sake: this path never reads a device tensor on the host. `inputs` = precomputed
    `tree_verify_inputs(batch, device)` (saves the tree tensors' upload).
    """
    ref = target_probs if target_probs is not None else target_argmax
    if ref is None:
        raise ValueError("target_probs is required unless every request is greedy and target_argmax is given")
    device = ref.device
    B, D = batch.batch_size, batch.max_depth
    V = target_probs.shape[1] if target_probs is not None else 0
    mode_t = _as_modes(modes, B)  # host
    present = set(mode_t.tolist())
    if target_probs is None and present - {int(Mode.GREEDY)}:
        raise ValueError("target_probs is required unless every request is greedy and target_argmax is given")
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
    if any(t.tokens is None and t.num_nodes for t in batch.trees):
        raise ValueError("every tree of the batch needs tokens for verification")

    # Host tensors, moved in one transfer (device ones are used as they are: no sync).
    host: dict[str, torch.Tensor] = {"modes": mode_t}
    if inputs is None:
        host.update(cu=batch.cu_num_rows, tokens=batch.tokens, first_child=batch.first_child,
                    next_sibling=batch.next_sibling)
    if max_tokens is not None:
        mt = torch.as_tensor(max_tokens, dtype=torch.long)
        if mt.device.type == "cpu":
            mt = mt.expand(B).contiguous()
            if bool((mt < 1).any()):
                raise ValueError("max_tokens must be >= 1 for every request")
            host["max_tokens"] = mt
        else:  # on the device: the caller guarantees >= 1 (as verify_batch with sync_free)
            max_tokens = mt.to(device).expand(B).contiguous()
    if eos_token_id is not None:
        eos = torch.as_tensor(eos_token_id, dtype=torch.long)
        eos = eos.expand(B)[:, None] if eos.dim() < 2 else eos  # [B, S] stop ids, -1 padded
        if eos.device.type == "cpu":
            host["eos"] = eos.contiguous()
        else:
            eos_token_id = eos.to(device).contiguous()
    exp_rows = None
    if coins is not None and coins.exponential is None and present - {int(Mode.GREEDY)}:
        det = (mode_t == Mode.DETERMINISTIC).nonzero().flatten().tolist()
        smp = (mode_t >= Mode.SAMPLED).nonzero().flatten().tolist()
        exp_rows, host["exp_index"] = coins.materialise(det, smp, D)
    dev = dict(zip(host, upload(list(host.values()), device)))
    if "max_tokens" in dev:
        max_tokens = dev["max_tokens"]
    if "eos" in dev:
        eos_token_id = dev["eos"]
    if inputs is None:
        inputs = TreeVerifyInputs(dev["cu"], dev["tokens"], dev["first_child"], dev["next_sibling"], D,
                                  batch.max_children)
    has_draft = draft_probs is not None and bool(present & {int(Mode.SAMPLED), int(Mode.SAMPLED_WITHOUT_REPLACEMENT)})
    exponential = exp_rows if exp_rows is not None else (None if coins is None else coins.exponential)
    if target_argmax is not None:
        target_argmax = target_argmax.to(device=device, dtype=torch.long).contiguous()
    out_ids, num_acc, acc_nodes, nxt, walked = tree_verify_triton(
        inputs.cu_num_rows, inputs.node_tokens, inputs.first_child, inputs.next_sibling,
        target_probs, draft_probs if has_draft else None, dev["modes"],
        None if coins is None else coins.uniform, exponential,
        max_depth=D, exp_index=dev.get("exp_index"), target_argmax=target_argmax,
        eos_token_id=eos_token_id, max_tokens=max_tokens, config=config,
    )  # fmt: skip
    return TreeVerifyOutput(acc_nodes, num_acc, nxt, out_ids, walked)


__all__ = [
    "TreeVerifyConfig",
    "TreeVerifyInputs",
    "pick_config",
    "tree_verify_inputs",
    "tree_verify_triton",
    "verify_batch_triton",
]
