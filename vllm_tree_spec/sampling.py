"""Target-side sampling transforms, applied to every tree row before verification.

Lossless verification needs p_u, the distribution the target would *sample*
from at node u, i.e. after the request's sampling parameters, exactly as the
non-speculative sampler computes it (vLLM PR #10198 applied them to the draft
but not the target: both sides of a ratio must use the same processed
distribution). The order and tie rules follow vLLM 0.32's V1 `Sampler`:

    logits / temperature -> min-p -> top-k -> top-p -> softmax

* temperature <= 0 (vLLM's GREEDY_TEMPERATURE = 0) marks a greedy row: its
  distribution is one-hot on argmax (first index on ties, like torch.argmax);
* min-p masks tokens whose probability is below min_p * max probability;
* top-k keeps every token whose logit is >= the k-th largest (ties at the
  boundary are kept, as in vLLM's sort-based path); k <= 0 or k >= V disables it;
* top-p sorts ascending, masks the prefix whose cumulative probability is
  <= 1 - top_p, and always keeps the most likely token.

All parameters are per row ([R] tensors), so a batch of trees whose rows were
expanded from per-request parameters is handled in one call.
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 0.0


def _per_row(x: torch.Tensor | float | int | None, rows: int, dtype, device) -> torch.Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.expand(rows) if t.dim() == 0 else t


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V], min_p [R] -> logits with tokens below min_p * max(p) masked to -inf."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """logits [R, V]; top_k [R] int (<= 0 or >= V: off); top_p [R] float (>= 1: off)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [R, V] ascending
    if top_k is not None:
        k = top_k.to(torch.long)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        kth = logits_sort.gather(1, (vocab - k).unsqueeze(1))  # [R, 1] k-th largest logit
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(logits_sort, dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - top_p.to(cum.dtype).unsqueeze(1)
        mask[:, -1] = False  # keep at least the most likely token
        logits_sort = logits_sort.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, logits_idx, logits_sort)


def target_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float | None = None,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    *,
    has_greedy: bool | None = None,
) -> torch.Tensor:
    """Processed logits [R, V]: the logits each row is sampled from (vLLM's `processed_logits`).

    Sampled rows: logits / temperature, then min-p, top-k, top-p (masked entries -inf); softmax of
    this is p. Greedy rows (temperature <= 0) are returned unchanged (vLLM's all-greedy batches: no
    temperature, no truncation). Parameters as in `target_probs`.
    """
    rows, vocab = logits.shape
    dt, dev = logits.dtype, logits.device
    temp = _per_row(temperature, rows, dt, dev)
    x = logits
    greedy = None
    if temp is not None:
        if has_greedy is False:  # the caller knows (device tensors: no sync to find out)
            x = x / temp.unsqueeze(1)
        else:
            greedy = temp <= GREEDY_TEMPERATURE
            if bool(greedy.all()):
                return logits
            x = x / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
    mp = _per_row(min_p, rows, dt, dev)
    if mp is not None:
        x = apply_min_p(x, mp)
    tk = _per_row(top_k, rows, torch.long, dev)
    tp = _per_row(top_p, rows, dt, dev)
    x = apply_top_k_top_p(x, tk, tp)
    if greedy is not None and bool(greedy.any()):
        x = torch.where(greedy.unsqueeze(1), logits, x)
    return x


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | float | None = None,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    *,
    has_greedy: bool | None = None,
) -> torch.Tensor:
    """Per-row target distributions p [R, V] from raw logits [R, V].

    Each parameter is a scalar or an [R] tensor; None disables it. Rows with
    temperature <= 0 become one-hot on their argmax (greedy). The result keeps
    the dtype of `logits` (use float64 for exact tests). has_greedy=False: the
    caller guarantees temperature > 0 on every row (skips a check that syncs
    with the device).
    """
    temp = _per_row(temperature, logits.shape[0], logits.dtype, logits.device)
    greedy = None if temp is None or has_greedy is False else temp <= GREEDY_TEMPERATURE
    if greedy is not None and bool(greedy.all()):  # all rows greedy: skip the transforms and the softmax
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(target_logits(logits, temperature, top_k, top_p, min_p, has_greedy=has_greedy), dim=-1)
    if greedy is not None and bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs
