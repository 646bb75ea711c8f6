"""The verification rules: the modes, their arithmetic, what a legal input is, and where a round ends.

p is the target's distribution at a tree row, q the draft's (package docstring). A `Mode` names how
a row's children were drafted, which decides the exact rule that verifies them:

    greedy                        y = argmax p; accept the child whose token is y
    deterministic                 draw y ~ p, accept the child equal to y (q := 1)
    sampled                       for each child x in order, accept if u < p(x) / q(x),
                                  else p <- norm(max(0, p - q)); q unchanged
    sampled_without_replacement   as sampled, and after rejecting x also q[x] <- 0, q <- norm(q)

`row_sum` and `residual` are the arithmetic the sampled rules share between the reference walk,
the batch verifier and the Triton kernel: the residual's normaliser is summed in fixed point, so
every implementation gets the same bits whatever its reduction order, and so the same answer to
`u < ratio` at ulp boundaries. Comparisons are strict (`u < ratio`, u in [0, 1)), so a token with
p(x) = 0 is never accepted.

`_validate` checks one request's inputs against its mode (shapes, normalised rows, distinct
siblings where the rule needs them, draft tokens of positive q) with errors that name the field
and the fix. `_truncate` applies the round's end: an EOS / stop id or the request's remaining
token budget cuts the emitted sequence, which does not change the law of the tokens emitted.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Sequence

import torch

from vllm_tree_spec.tree import Tree


class Mode(IntEnum):
    GREEDY = 0
    DETERMINISTIC = 1
    SAMPLED = 2
    SAMPLED_WITHOUT_REPLACEMENT = 3

    @staticmethod
    def parse(mode: "str | int | Mode") -> "Mode":
        if isinstance(mode, Mode):
            return mode
        if isinstance(mode, int):
            return Mode(mode)
        try:
            return Mode[str(mode).upper()]
        except KeyError:
            raise ValueError(
                f"mode {mode!r} is not one of {[m.name.lower() for m in Mode]}; choose the rule that matches "
                f"how the children were drafted"
            ) from None

    @property
    def needs_draft_probs(self) -> bool:
        return self in (Mode.SAMPLED, Mode.SAMPLED_WITHOUT_REPLACEMENT)


# ---------------------------------------------------------------------------
# Fixed-point sums and the residual


FIXED_POINT_BITS = 60


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Order-independent sum over the last dim (keepdim).

    Entries (probabilities; a row total < 8) are truncated to int64 multiples of
    2^-60 and added as integers, so CPU, CUDA and the Triton kernel get the same
    bits whatever their reduction order -- which decides `u < ratio` at ulp
    boundaries. Absolute error <= V * 2^-60 (1e-13 at V = 128k).
    """
    n = (x.to(torch.float64) * float(2**FIXED_POINT_BITS)).to(torch.int64).sum(-1, keepdim=True)
    hi, lo = n >> 32, n & 0xFFFFFFFF  # both halves exact in float64: one rounding
    return ((hi.to(torch.float64) * float(2**32) + lo.to(torch.float64)) * 2.0**-FIXED_POINT_BITS).to(x.dtype)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; rows whose residual is all zero keep p.

    An all-zero residual needs p <= q everywhere, i.e. p == q, where the child
    is accepted with probability 1; it can only appear through rounding.
    """
    r = (p - q).clamp_(min=0)
    z = row_sum(r)
    return torch.where(z > 0, r / torch.where(z > 0, z, torch.ones_like(z)), p)


# ---------------------------------------------------------------------------
# Validation and truncation


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 1e-4


def _check_distributions(name: str, probs: torch.Tensor, rows: list[int]) -> None:
    if not rows:
        return
    sub = probs[rows]
    if bool((sub < 0).any()) or not bool(torch.isfinite(sub).all()):
        raise ValueError(f"{name} has negative or non-finite entries; pass probabilities, not logits")
    err = (sub.sum(-1) - 1).abs()
    bad = err > _tolerance(probs.dtype)
    if bool(bad.any()):
        r = rows[int(bad.nonzero()[0])]
        raise ValueError(
            f"{name}[{r}] sums to {float(sub.sum(-1)[bad][0]):.6g}, not 1: probabilities not normalised; "
            f"apply softmax (and the sampling transforms) first"
        )


def _validate(tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None, mode: Mode) -> None:
    n = tree.num_nodes
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(
            f"target_probs has shape {tuple(target_probs.shape)}; expected [N + 1, V] = [{n + 1}, V] "
            f"(row 0 at the root, row i + 1 after node i)"
        )
    vocab = target_probs.shape[1]
    if n and (bool((tree.tokens < 0).any()) or bool((tree.tokens >= vocab).any())):
        raise ValueError(f"tokens must lie in [0, {vocab}) (the vocabulary of target_probs)")
    _check_distributions("target_probs", target_probs, list(range(n + 1)))
    if mode == Mode.DETERMINISTIC and tree.duplicate_siblings():
        i, j = tree.duplicate_siblings()[0]
        raise ValueError(
            f"duplicate sibling tokens (nodes {i} and {j}, token {int(tree.tokens[i])}) in deterministic mode; "
            f"deterministic drafters must propose distinct children"
        )
    if not mode.needs_draft_probs:
        return
    if draft_probs is None:
        raise ValueError(f"mode {mode.name.lower()!r} needs draft_probs [N + 1, V] (the q children were drawn from)")
    if tuple(draft_probs.shape) != tuple(target_probs.shape):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}; expected {tuple(target_probs.shape)} like target_probs"
        )
    parent_rows = [r for r, ch in enumerate(tree.children) if ch]
    _check_distributions("draft_probs", draft_probs, parent_rows)
    if mode == Mode.SAMPLED_WITHOUT_REPLACEMENT and tree.duplicate_siblings():
        i, j = tree.duplicate_siblings()[0]
        raise ValueError(
            f"duplicate sibling tokens (nodes {i} and {j}) cannot come from sampling without replacement; "
            f"use mode 'sampled' for i.i.d. children"
        )
    for i, p in enumerate(tree.parents.tolist()):
        x = int(tree.tokens[i])
        if float(draft_probs[p + 1, x]) <= 0:
            raise ValueError(
                f"node {i}'s token {x} has zero probability under draft_probs[{p + 1}]: it cannot have been "
                f"sampled from that row; pass the distribution the children were drawn from"
            )


def _truncate(
    accepted: list[int], next_token: int, tokens: list[int], eos_token_id: "int | Sequence[int] | None",
    max_tokens: int | None,
) -> tuple[list[int], int]:
    """Cut the emitted sequence at the first EOS / stop id (inclusive) and at max_tokens."""
    emitted = [tokens[i] for i in accepted] + [next_token]
    cut = len(emitted)
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    hits = [k for k, t in enumerate(emitted) if t in stops]
    if hits:
        cut = hits[0] + 1
    if max_tokens is not None:
        cut = min(cut, max_tokens)
    return accepted[: cut - 1], emitted[cut - 1]
