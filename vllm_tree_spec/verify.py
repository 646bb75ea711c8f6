"""Lossless tree verification: walk the draft tree with the target's distributions.

Vocabulary (Leviathan et al., arXiv 2211.17192; vLLM's `RejectionSampler`):
p is the target's distribution at a tree row (after the request's sampling
transforms, see `sampling.py`), q the draft's. Rows are numbered as in
`tree.py`: row 0 is the root (the last committed token), row i + 1 follows
draft node i. A round walks from the root; at each visited row it either
**accepts** one child and descends, or stops and emits a **recovered**
(correction) token; if the walk ends at a leaf the last token is a **bonus**
token drawn from the full p. Output tokens = accepted + one recovered-or-bonus
token (`next_token`).

Every node-level step emits one token distributed exactly as p_row; the chain
rule then makes the whole round lossless (SpecInfer/Sequoia argument). Which
step is exact depends on how the children were drafted, hence four modes:

    greedy                        y = argmax p; accept the child whose token is y
    deterministic                 children chosen without randomness (top-k, n-gram,
                                  suffix trees): draw y ~ p, accept the child equal to y
                                  (sample-and-match; q := 1, the real q would be lossy)
    sampled                       children drawn i.i.d. from q: for each child x in order,
                                  accept if u < p(x) / q(x), else p <- norm(max(0, p - q));
                                  q unchanged, duplicate siblings processed in turn
    sampled_without_replacement   children drawn without replacement (in draw order): as
                                  above, and after rejecting x also q[x] <- 0, q <- norm(q)

Comparisons are strict (`u < ratio`, u in [0, 1)), so a token with p(x) = 0 is
never accepted (SGLang #35771). An EOS token or the request's remaining token
budget ends the round early: the emitted sequence is cut there, which does not
change the law of the tokens that are emitted.

Randomness. The walk visits at most one row per depth, so coins are indexed by
(request, depth): `uniform[b, d, j]` for the j-th child test at depth d and
`exponential[b, d, :]` for the draw at depth d (y = argmax(p / E), the
exponential race, as vLLM's recovered-token kernel). Passing the same
`VerifyCoins` makes the reference walk (`verify_tree_with_coins`), the
vectorised `verify_batch` and a kernel agree token for token. Lazy coins
(`VerifyCoins.draw(..., lazy=True)`, the engine's) draw an exponential row
only when the walk reaches its depth: same law, (accepted + 1) rows of V per
request instead of D + 1.

Two implementations:
* `verify_tree` -- the simple reference, one request, a Python walk; the entry
  point outside checks call.
* `verify_batch` -- B requests with different trees, vectorised over nodes and
  requests (Python loops run over sibling rank in the sampled modes and over
  depth in the deterministic mode, whose draws are made only where the walk goes).
  On CPU an all-greedy batch is walked on host lists instead (`verify_greedy_host`,
  same outputs): there a handful of small tensor ops per step is the whole cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol, Sequence

import torch

from vllm_tree_spec.tree import NO_NODE, NO_PARENT, PAD_TOKEN_ID, Tree, TreeBatch


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
# Coins


@dataclass
class VerifyCoins:
    """All randomness of one verification call.

    Attributes:
        uniform: [B, D + 1, K] float64 in [0, 1): child tests at depth d, sibling rank j.
        exponential: [B, D + 1, V] Exp(1) noise (clamped > 0) for the draw at depth d; None for lazy
            coins, whose rows are drawn when the walk first reads them (`exponential_at`).

    A walk reads at most one exponential row per (request, depth), and only at the depths it reaches,
    so lazy coins draw (accepted + 1) rows of V per request instead of D + 1. Each row is fresh noise
    from the request's own stream, whatever the walk did before: the law is the same as eager coins.
    """

    uniform: torch.Tensor  # [B, D + 1, K]
    exponential: torch.Tensor | None  # [B, D + 1, V], or None (lazy)
    generators: Sequence[torch.Generator | None] | None = None  # lazy coins: each request's stream
    vocab_size: int = 0
    dtype: torch.dtype = torch.float32
    tracked: dict | None = None  # lazy coins, track_streams: req -> stream state before each row drawn

    @staticmethod
    def draw(
        batch_size: int,
        max_depth: int,
        max_children: int,
        vocab_size: int,
        generators: Sequence[torch.Generator | None] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        lazy: bool = False,
        needs_uniform: Sequence[bool] | None = None,
        track_streams: bool = False,
    ) -> "VerifyCoins":
        """Draw coins; request b uses generators[b] when given (seeded requests), else the default RNG.

        Each request's coins are drawn once, from its own generator or (all unseeded requests together)
        from the default RNG. lazy=True draws the uniforms now and the exponential rows on first use.
        needs_uniform[b] = False (greedy and deterministic requests, which never read child tests) leaves
        request b's uniforms at 0 and its stream untouched, so with lazy coins such a request consumes
        exactly one exponential row per depth its walk reaches, whatever the batch's tree sizes.
        track_streams (lazy only) records the seeded streams for `rewind`.
        """
        shape_u = (max_depth + 1, max(1, max_children))
        gens = list(generators) if generators is not None else [None] * batch_size
        u = torch.zeros((batch_size, *shape_u), dtype=torch.float64, device=device)
        need = [True] * batch_size if needs_uniform is None else list(needs_uniform)
        idx = [b for b in range(batch_size) if need[b]]
        if idx:
            # float64 uniforms: an exact 0 is (nearly) impossible, as in vLLM's generate_uniform_probs.
            sub = torch.empty((len(idx), *shape_u), dtype=torch.float64, device=device)
            _fill_per_stream(sub, [gens[b] for b in idx],
                             lambda shape, g: torch.rand(shape, dtype=torch.float64, device=device, generator=g))
            u[torch.tensor(idx, device=device) if len(idx) < batch_size else slice(None)] = sub
        if lazy:
            return VerifyCoins(u, None, gens, vocab_size, dtype, {} if track_streams else None)
        e = _exponential_rows(gens, max_depth + 1, vocab_size, dtype, u.device)
        return VerifyCoins(u, e.view(batch_size, max_depth + 1, vocab_size), None, vocab_size, dtype)

    def exponential_at(self, req: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """[n, V] exponential rows of the (req[i], depth[i]) pairs; read at most once per pair.

        Lazy coins draw the rows now; `req` should then live on the host (its ids pick the streams:
        a device tensor costs a sync). With `track_streams`, the state of every seeded stream is
        recorded before each row, so `rewind` can give back the rows a walk drew but did not read.
        """
        if self.exponential is not None:
            return self.exponential[req.to(self.uniform.device), depth]
        gens = self.generators or [None] * self.uniform.shape[0]
        ids = req.tolist()
        if self.tracked is not None:
            for b in ids:
                if gens[b] is not None:
                    self.tracked.setdefault(b, []).append(gens[b].get_state())
        return _exponential_rows([gens[b] for b in ids], 1, self.vocab_size, self.dtype, self.uniform.device)

    def rewind(self, rows_read: Sequence[int]) -> None:
        """Seeded streams of tracked lazy coins: keep the first rows_read[b] exponential rows, give back
        the rest (a walk that draws at every depth without knowing where it stops, `verify_batch(...,
        sync_free=True)`). The stream then stands where a walk drawing only where it goes leaves it."""
        for b, states in (self.tracked or {}).items():
            if rows_read[b] < len(states):
                self.generators[b].set_state(states[rows_read[b]])
        self.tracked = {} if self.tracked is not None else None

    def for_request(self, b: int) -> "VerifyCoins":
        if self.exponential is None:
            raise ValueError("for_request needs eager coins (VerifyCoins.draw(..., lazy=False))")
        return VerifyCoins(self.uniform[b : b + 1], self.exponential[b : b + 1])


def _fill_per_stream(out: torch.Tensor, gens: Sequence[torch.Generator | None], draw) -> torch.Tensor:
    """out[i] = draw(row shape, gens[i]) for seeded rows; all unseeded rows in one default-RNG call.

    With both kinds, the default RNG fills every row and the seeded rows are then overwritten (no
    index list to move to the device: the unseeded rows only need fresh noise, not a given stream)."""
    if any(g is None for g in gens):
        out[:] = draw(tuple(out.shape), None)
    for i, g in enumerate(gens):
        if g is not None:
            out[i] = draw(tuple(out.shape[1:]), g)
    return out


def _exponential_rows(gens: Sequence[torch.Generator | None], rows_per_stream: int, vocab_size: int,
                      dtype: torch.dtype, device) -> torch.Tensor:
    """[len(gens) * rows_per_stream, V] Exp(1) rows, clamped > 0 (E = 0 would turn p = 0 into nan)."""
    out = torch.empty((len(gens), rows_per_stream, vocab_size), dtype=dtype, device=device)
    _fill_per_stream(out, gens, lambda shape, g: exponential(shape, dtype=dtype, device=device, generator=g))
    return out.view(-1, vocab_size).clamp_(min=torch.finfo(dtype).tiny)


def exponential(shape, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) noise as -log(1 - U) from float64 uniforms U in [0, 1), cast to dtype.

    53-bit uniforms keep E = 0 (a win for any token, whatever its p) at probability ~2^-53 per entry;
    float32 uniforms would give it 2^-24 per entry, about 0.3% per row at V = 49k. On CPU this is
    ~2.5x faster than Tensor.exponential_.
    """
    u = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    return u.neg_().log1p_().neg_().to(dtype)


def race(p: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E) is a draw from p / sum(p) (index of first max on ties)."""
    return (p / exponential.to(p.dtype)).argmax(dim=-1)


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


class CoinSource(Protocol):
    """Where the reference walk gets its randomness (a generator, tensors, or an enumerator)."""

    def accept(self, ratio: float, depth: int, rank: int) -> bool:
        """u < ratio for a fresh u ~ U[0, 1)."""

    def draw(self, p: torch.Tensor, depth: int) -> int:
        """One token from p (p need not be normalised)."""


class GeneratorCoins:
    def __init__(self, generator: torch.Generator | None):
        self.g = generator

    def accept(self, ratio: float, depth: int, rank: int) -> bool:
        u = float(torch.rand((), dtype=torch.float64, generator=self.g))
        return u < ratio

    def draw(self, p: torch.Tensor, depth: int) -> int:
        e = torch.empty_like(p).exponential_(generator=self.g).clamp_(min=torch.finfo(p.dtype).tiny)
        return int(race(p, e))


class TensorCoins:
    """Reads one request's slice of `VerifyCoins` (the layout `verify_batch` uses)."""

    def __init__(self, coins: VerifyCoins, b: int = 0):
        self.u = coins.uniform[b]
        self.e = coins.exponential[b]

    def accept(self, ratio: float, depth: int, rank: int) -> bool:
        return float(self.u[depth, rank]) < ratio

    def draw(self, p: torch.Tensor, depth: int) -> int:
        return int(race(p, self.e[depth]))


# ---------------------------------------------------------------------------
# Validation


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


# ---------------------------------------------------------------------------
# Reference walk


def node_step(
    p: torch.Tensor,
    q: torch.Tensor | None,
    child_tokens: Sequence[int],
    mode: Mode,
    coins: CoinSource,
    depth: int,
) -> tuple[int | None, int]:
    """One visited row: returns (rank of the accepted child or None, token emitted here).

    p [V] is the target at the row, q [V] the draft the children were drawn from
    (sampled modes only). The emitted token is distributed exactly as p.
    """
    if mode in (Mode.GREEDY, Mode.DETERMINISTIC):
        y = int(p.argmax()) if mode == Mode.GREEDY else coins.draw(p, depth)
        rank = next((j for j, x in enumerate(child_tokens) if x == y), None)
        return rank, y
    for rank, x in enumerate(child_tokens):
        ratio = float(p[x] / q[x]) if float(q[x]) > 0 else 0.0  # q(x) = 0: reject; in p's dtype, as the batch
        if coins.accept(ratio, depth, rank):
            return rank, x
        p = residual(p, q)
        if mode == Mode.SAMPLED_WITHOUT_REPLACEMENT:
            q = q.clone()
            q[x] = 0  # the next child was drawn from q without x
            q = q / row_sum(q)
    return None, coins.draw(p, depth)


def walk(
    tree: Tree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    mode: Mode,
    coins: CoinSource,
) -> tuple[list[int], int]:
    """The reference walk (no validation, no truncation). Returns (accepted nodes, next token)."""
    tokens = tree.tokens.tolist() if tree.num_nodes else []
    row, depth, accepted = 0, 0, []
    while True:
        children = tree.children[row]
        q = None if draft_probs is None else draft_probs[row]
        rank, y = node_step(target_probs[row], q, [tokens[c] for c in children], mode, coins, depth)
        if rank is None:
            return accepted, y
        accepted.append(children[rank])
        row, depth = children[rank] + 1, depth + 1


def verify_tree(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    mode: str,
    generator: torch.Generator | None,
    *,
    eos_token_id: "int | Sequence[int] | None" = None,
    max_tokens: int | None = None,
) -> tuple[list[int], int]:
    """Verify one request's draft tree (reference implementation).

    Args:
        parents: [N] int64 parent indices in topological order (-1 = child of the root).
        tokens: [N] int64 draft tokens.
        target_probs: [N + 1, V] p per row (row 0 at the root, row i + 1 after node i's
            path), already transformed by the request's sampling parameters.
        draft_probs: [N + 1, V] or None; row r = the q node r's children were drawn from
            (required by the two sampled modes).
        mode: "greedy" | "deterministic" | "sampled" | "sampled_without_replacement".
        generator: torch.Generator supplying the coins (None: the default RNG).
        eos_token_id: if given (an id or a collection of stop ids), the round ends at the first
            emitted one.
        max_tokens: if given (>= 1), at most this many tokens are emitted.

    Returns:
        (accepted, next_token): accepted node indices from the first level down
        (root excluded) and the token emitted after them -- the recovered token,
        or the bonus token if the walk ended at a leaf. Emitted tokens are
        [tokens[a] for a in accepted] + [next_token]. If EOS or max_tokens cut
        the round, next_token is the last emitted token and accepted the nodes
        before it.
    """
    return _verify_tree(parents, tokens, target_probs, draft_probs, mode, GeneratorCoins(generator),
                        eos_token_id=eos_token_id, max_tokens=max_tokens)


def verify_tree_with_coins(
    parents, tokens, target_probs, draft_probs, mode, coins: VerifyCoins | CoinSource, *, b: int = 0,
    eos_token_id: "int | Sequence[int] | None" = None, max_tokens: int | None = None,
) -> tuple[list[int], int]:
    """`verify_tree` reading explicit coins (request b of a `VerifyCoins`, or any `CoinSource`)."""
    source = TensorCoins(coins, b) if isinstance(coins, VerifyCoins) else coins
    return _verify_tree(parents, tokens, target_probs, draft_probs, mode, source,
                        eos_token_id=eos_token_id, max_tokens=max_tokens)


def _verify_tree(parents, tokens, target_probs, draft_probs, mode, coins, *, eos_token_id, max_tokens):
    mode = Mode.parse(mode)
    parents = torch.as_tensor(parents, dtype=torch.long)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if parents.dim() != 1 or tokens.dim() != 1:
        raise ValueError("parents and tokens must be 1-D tensors over the N draft nodes")
    tree = Tree(parents, tokens)
    _validate(tree, target_probs, draft_probs, mode)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens} must be >= 1 (a round always emits a token)")
    accepted, nxt = walk(tree, target_probs, draft_probs, mode, coins)
    return _truncate(accepted, nxt, tokens.tolist(), eos_token_id, max_tokens)


# ---------------------------------------------------------------------------
# Batched, vectorised verification


@dataclass
class TreeVerifyOutput:
    """Result of `verify_batch`, in vLLM's chain contract where it applies.

    Attributes:
        accepted_nodes: [B, D] int64 local node indices of the accepted path, NO_NODE-padded.
        num_accepted: [B] int64 accepted draft nodes (after EOS / max_tokens cuts).
        next_token: [B] int64 recovered or bonus token (the last emitted token).
        output_token_ids: [B, D + 1] int64 accepted tokens then next_token, -1 padded
            (the layout of vLLM's `sampled_token_ids`).
        walked: [B] int64 accepted nodes before the EOS / max_tokens cuts (the depth the walk
            stopped at: a deterministic walk read walked + 1 exponential rows), or None.
    """

    accepted_nodes: torch.Tensor  # [B, D]
    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B]
    output_token_ids: torch.Tensor  # [B, D + 1]
    walked: torch.Tensor | None = None  # [B]

    def accepted(self, b: int) -> list[int]:
        return self.accepted_nodes[b, : int(self.num_accepted[b])].tolist()


def _as_modes(modes, batch_size: int) -> torch.Tensor:
    if isinstance(modes, (str, Mode, int)):
        modes = [modes] * batch_size
    if isinstance(modes, torch.Tensor):
        return modes.to(torch.long).cpu()
    return torch.tensor([int(Mode.parse(m)) for m in modes], dtype=torch.long)


def sync_free(device) -> bool:
    """Whether the serving path avoids data-dependent host syncs on this device: on accelerators,
    where a sync stalls the queue. On CPU a sync costs nothing and compacting saves work."""
    return torch.device(device).type != "cpu"


def upload(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Host int64 tensors -> the device in one transfer (views of one packed buffer; CPU: no copy)."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]) if tensors else torch.zeros(0)
    dev = flat.to(device, non_blocking=True)
    out, o = [], 0
    for t in tensors:
        out.append(dev[o: o + t.numel()].view(t.shape).to(t.dtype))
        o += t.numel()
    return out


def verify_batch(
    batch: TreeBatch,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    modes,
    coins: VerifyCoins | None = None,
    *,
    eos_token_id: torch.Tensor | None = None,
    max_tokens: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
    sync_free: bool = False,
    host_greedy: bool = True,
) -> TreeVerifyOutput:
    """Verify B trees at once.

    Args:
        batch: the B trees (with tokens).
        target_probs: [R, V] p per row, R = sum(N_b + 1), request-major, root row
            first (`batch.cu_num_rows`).
        draft_probs: [R, V] or None; required if any request uses a sampled mode.
        modes: one mode for all, or [B] modes (names, `Mode`s or an int tensor).
        coins: `VerifyCoins` with at least [B, D + 1, K] / [B, D + 1, V]; drawn
            from the default RNG when None (not needed if all requests are greedy).
        eos_token_id: [B] int64, -1 = none; or [B, S] stop ids per request (EOS and stop_token_ids),
            -1 padded: the round ends at the first emitted one.
        max_tokens: [B] int64 remaining token budget (>= 1), or None; checked where it is on the host.
        target_argmax: [R] int64 argmax of p per row; when every request is greedy it may stand
            in for target_probs (pass None there): greedy verification reads nothing else.
        sync_free: no data-dependent host synchronisation (device tensors): the deterministic walk
            draws at every depth for every deterministic request (lazy coins: pass host-side
            streams and `rewind` them afterwards with `walked + 1`), and the sampled modes update
            every row with `torch.where` instead of compacting the rejecting rows. Same outputs
            bit for bit given the same coins; more work on the device, no round trips.
        host_greedy: on CPU, when every request is greedy and sync_free is off, walk the trees on
            host lists (`verify_greedy_host`: the same outputs, a few microseconds per request instead
            of ~60 tensor ops per step). False: the tensor walk (the tests compare the two).
    """
    modes = _as_modes(modes, batch.batch_size)  # host
    present = set(modes.tolist())
    if target_probs is None and (target_argmax is None or present - {int(Mode.GREEDY)}):
        raise ValueError("target_probs is required unless every request is greedy and target_argmax is given")
    device = (target_probs if target_probs is not None else target_argmax).device
    if host_greedy and present <= {int(Mode.GREEDY)} and device.type == "cpu" and not sync_free:
        y = target_argmax if target_argmax is not None else target_probs.argmax(-1)
        return verify_greedy_host(batch, y, eos_token_id=eos_token_id, max_tokens=max_tokens)
    B, M = batch.batch_size, batch.max_nodes
    V = target_probs.shape[1] if target_probs is not None else 0
    D = batch.max_depth
    if any(Mode(m).needs_draft_probs for m in present) and draft_probs is None:
        raise ValueError("draft_probs is required when a request uses a sampled mode")
    if coins is None and present != {int(Mode.GREEDY)}:
        coins = VerifyCoins.draw(B, D, batch.max_children, V, dtype=target_probs.dtype, device=device, lazy=True)
    if max_tokens is not None and isinstance(max_tokens, torch.Tensor) and max_tokens.device.type != "cpu":
        mt_host = None if sync_free else max_tokens.cpu()  # sync_free: the caller guarantees >= 1
    else:
        mt_host = None if max_tokens is None else torch.as_tensor(max_tokens, dtype=torch.long).expand(B)
    if mt_host is not None and bool((mt_host < 1).any()):
        raise ValueError("max_tokens must be >= 1 for every request")

    # Per-node metadata, flattened over requests ([T] = all draft nodes), built on the host and
    # moved in one transfer.
    T, R = int(batch.cu_num_nodes[-1]), int(batch.cu_num_rows[-1])
    node_req = torch.repeat_interleave(torch.arange(B), batch.num_nodes)  # [T]
    node_local = torch.arange(T) - batch.cu_num_nodes[:-1].repeat_interleave(batch.num_nodes)  # [T]
    row_base_h = batch.cu_num_rows[:-1]  # [B] global row of each root
    node_row_h = row_base_h[node_req] + node_local + 1  # [T]
    row_depth_h = torch.zeros(R, dtype=torch.long)
    row_depth_h[node_row_h] = batch.depth  # [R], root rows 0
    sib_rank_h = torch.cat([t.sibling_rank for t in batch.trees]) if batch.trees else torch.zeros(0, dtype=torch.long)
    host = [node_req, node_local, row_base_h, node_row_h, row_base_h[node_req] + batch.parents + 1, batch.tokens,
            row_depth_h, torch.repeat_interleave(torch.arange(B), batch.num_nodes + 1), sib_rank_h, modes,
            batch.padded_tokens, batch.padded_depth, batch.valid, batch.dense_mask]
    (node_req, node_local, row_base, node_row, parent_row, tokens, row_depth, row_req, sib_rank, modes_d,
     padded_tokens, depth_pad, valid, mask) = upload(host, device)
    node_mode = modes_d[node_req]  # [T]

    # taken[t]: node t is the child that its parent row's step picks (entry T: a sink for "no child").
    taken = torch.zeros(T + 1, dtype=torch.bool, device=device)  # [T + 1]
    y_row = torch.zeros(R, dtype=torch.long, device=device)  # [R] greedy / deterministic draw per row
    p_final = None
    # child_node[r, j]: global node index of the j-th child of row r (-1 = none).
    K = max(1, batch.max_children)
    child_node = torch.full((R, K), NO_NODE, dtype=torch.long, device=device)
    child_node[parent_row, sib_rank] = torch.arange(T, device=device)

    if int(Mode.GREEDY) in present:
        y_row = (target_argmax.to(device) if target_argmax is not None else target_probs.argmax(-1)).clone()  # [R]
        match = tokens == y_row[parent_row]  # [T]
        # Among matching siblings only the first counts (duplicates are legal in greedy mode).
        big = torch.full_like(sib_rank, 1 << 30)
        first = torch.full((R,), 1 << 30, dtype=torch.long, device=device)
        first = first.scatter_reduce(0, parent_row, torch.where(match, sib_rank, big), reduce="amin")
        taken[:T] = match & (sib_rank == first[parent_row]) & (node_mode == Mode.GREEDY)

    if int(Mode.DETERMINISTIC) in present:
        # Sample-and-match, one depth at a time. Default: over the requests still walking, so a draw is
        # made only at rows the walk reaches (lazy coins then draw only those exponential rows).
        # sync_free: over every deterministic request at every depth, finished walks masked.
        tokens_or_none = torch.cat([tokens, tokens.new_full((1,), -1)])  # [T + 1]: index -1 (no child) -> -1
        det = (modes == Mode.DETERMINISTIC).nonzero().flatten()  # [n] request ids (host)
        walking = det.to(device) if not sync_free else upload([det], device)[0]
        row = row_base[walking]  # [n] the row each walking request is at
        active = torch.ones_like(walking, dtype=torch.bool)  # sync_free: the walk has not stopped
        for d in range(D + 1):
            if not sync_free and walking.numel() == 0:
                break
            ids = det if sync_free else walking
            y = race(target_probs[row], coins.exponential_at(ids, torch.full_like(walking, d)))  # [n]
            children = child_node[row]  # [n, K]
            hit = tokens_or_none[children] == y[:, None]  # [n, K]
            on = hit.any(-1)
            nxt = children.gather(1, hit.to(torch.int8).argmax(-1, keepdim=True)).squeeze(1)  # first match
            if sync_free:
                y_row[row] = torch.where(active, y, y_row[row])
                on &= active
                taken[torch.where(on, nxt, T)] = on  # the sink takes the misses
                row, active = torch.where(on, node_row[nxt.clamp(min=0)], row), on
            else:
                y_row[row] = y
                taken[nxt[on]] = True
                det, walking, row = None, walking[on], node_row[nxt[on]]

    if present & {int(Mode.SAMPLED), int(Mode.SAMPLED_WITHOUT_REPLACEMENT)}:
        row_mode = modes_d[row_req]  # [R]
        sampled_row = row_mode >= Mode.SAMPLED
        wor_row = row_mode == Mode.SAMPLED_WITHOUT_REPLACEMENT
        p_cur = target_probs.clone()  # [R, V] residual target per row
        q_cur = draft_probs.clone()  # [R, V] (renormalised q for without-replacement rows)
        done = torch.zeros(R, dtype=torch.bool, device=device)  # a child of the row was accepted
        for j in range(K if T else 0):  # sibling rank; everything else is vectorised
            c = child_node[:, j]  # [R]
            has = (c >= 0) & sampled_row
            cc = c.clamp(min=0)
            x = torch.where(has, tokens[cc], torch.zeros_like(cc))  # [R]
            px = p_cur.gather(1, x[:, None]).squeeze(1)
            qx = q_cur.gather(1, x[:, None]).squeeze(1)
            # q(x) = 0 cannot be drafted; reject rather than divide by zero.
            ratio = torch.where(qx > 0, px / torch.where(qx > 0, qx, torch.ones_like(qx)), torch.zeros_like(px))
            u = coins.uniform[row_req, row_depth, j]  # [R]
            acc = has & ~done & (u < ratio.to(u.dtype))
            taken[torch.where(acc, cc, T)] = acc
            step = has & ~done & ~acc  # rows that reject child j and move on
            wor = step & wor_row
            if sync_free:  # every row computed, the rejecting rows kept (row-wise ops: same bits)
                p_cur = torch.where(step[:, None], residual(p_cur, q_cur), p_cur)
                q_new = q_cur.scatter(1, x[:, None], 0.0)
                q_new = q_new / row_sum(q_new).clamp(min=torch.finfo(q_new.dtype).tiny)
                q_cur = torch.where(wor[:, None], q_new, q_cur)
            else:  # row-wise updates of the rejecting rows only
                si = step.nonzero().flatten()
                if si.numel():
                    p_cur[si] = residual(p_cur[si], q_cur[si])
                wi = wor.nonzero().flatten()
                if wi.numel():
                    q_new = q_cur[wi].scatter(1, x[wi, None], 0.0)
                    q_cur[wi] = q_new / row_sum(q_new).clamp(min=torch.finfo(q_new.dtype).tiny)
            done |= acc
        p_final = p_cur

    # A node is accepted iff every node on its path (itself included) was taken.
    taken_pad = torch.zeros(B, M, dtype=torch.bool, device=device)
    taken_pad[node_req, node_local] = taken[:T]
    accepted_pad = ~(mask & ~taken_pad[:, None, :]).any(-1) & valid  # [B, M]
    num_accepted = (depth_pad * accepted_pad).amax(-1) if M else torch.zeros(B, dtype=torch.long, device=device)

    # At most one accepted node per depth: scatter node ni to column depth - 1 (the others to column D).
    accepted_nodes = torch.full((B, max(D, 0) + 1), NO_NODE, dtype=torch.long, device=device)
    if M:
        col = torch.where(accepted_pad, depth_pad - 1, torch.full_like(depth_pad, D))
        local = torch.arange(M, device=device).expand(B, M)
        accepted_nodes.scatter_(1, col, torch.where(accepted_pad, local, torch.full_like(local, NO_NODE)))
        accepted_nodes[:, D] = NO_NODE
    accepted_nodes = accepted_nodes[:, :D]
    deepest = torch.zeros_like(num_accepted)  # [B] local row where the walk stopped (0 = root)
    if D:
        last = accepted_nodes.gather(1, (num_accepted - 1).clamp(min=0)[:, None]).squeeze(1)
        deepest = torch.where(num_accepted > 0, last + 1, deepest)
    last_row = row_base + deepest  # [B] global row where the walk stopped

    next_token = y_row[last_row]
    if p_final is not None:
        sampled_h = (modes >= Mode.SAMPLED).nonzero().flatten()  # [s] request ids (host)
        sampled = upload([sampled_h], device)[0] if sync_free else sampled_h.to(device)
        e_last = coins.exponential_at(sampled_h if coins.exponential is None else sampled,
                                      num_accepted[sampled])  # [s, V]
        next_token = next_token.clone()
        next_token[sampled] = race(p_final[last_row[sampled]], e_last)
    walked = num_accepted

    # Emitted tokens: accepted tokens, then next_token; cut at EOS / max_tokens.
    acc_tok = torch.where(accepted_nodes >= 0, padded_tokens.gather(1, accepted_nodes.clamp(min=0)),
                          torch.full_like(accepted_nodes, PAD_TOKEN_ID)) if D else accepted_nodes
    emitted = torch.cat([acc_tok, torch.full((B, 1), PAD_TOKEN_ID, dtype=torch.long, device=device)], 1)
    emitted.scatter_(1, num_accepted[:, None], next_token[:, None])  # [B, D + 1]
    length = num_accepted + 1
    pos = torch.arange(D + 1, device=device)[None, :]
    if eos_token_id is not None:
        eos = eos_token_id if isinstance(eos_token_id, torch.Tensor) else torch.as_tensor(eos_token_id)
        eos = upload([eos.to(torch.long)], device)[0] if eos.device.type == "cpu" else eos.to(device)
        eos = eos.expand(B)[:, None] if eos.dim() < 2 else eos  # [B, S] stop ids, -1 padded
        hit = ((emitted[:, :, None] == eos[:, None, :]) & (eos[:, None, :] >= 0)).any(-1)  # [B, D + 1]
        is_eos = hit & (pos < length[:, None])
        first_eos = torch.where(is_eos, pos, torch.full_like(pos, D + 1)).amin(-1)
        length = torch.minimum(length, first_eos + 1)
    if max_tokens is not None:
        mt = upload([mt_host], device)[0] if mt_host is not None else max_tokens.to(device=device, dtype=torch.long)
        length = torch.minimum(length, mt.expand(B))
    output = torch.where(pos < length[:, None], emitted, torch.full_like(emitted, PAD_TOKEN_ID))
    num_accepted = length - 1
    next_token = output.gather(1, num_accepted[:, None]).squeeze(1)
    if D:
        accepted_nodes = torch.where(pos[:, :D] < num_accepted[:, None], accepted_nodes,
                                     torch.full_like(accepted_nodes, NO_NODE))
    return TreeVerifyOutput(accepted_nodes, num_accepted, next_token, output, walked)


def verify_greedy_host(batch: TreeBatch, target_argmax: torch.Tensor, *, eos_token_id: torch.Tensor | None = None,
                       max_tokens: torch.Tensor | None = None) -> TreeVerifyOutput:
    """`verify_batch` for a batch whose every request is greedy, walked on host lists (CPU serving).

    target_argmax: [R] int64 argmax of p per row (request-major, `batch.cu_num_rows`); eos_token_id and
    max_tokens as in `verify_batch`. At each row the first child (in sibling order) whose token is the
    row's argmax is accepted; the walk stops at a row with none, whose argmax is the next token. Then
    the emitted tokens are cut at the first stop id and at max_tokens by the reference walk's `_truncate`.
    """
    B, D = batch.batch_size, batch.max_depth
    y = target_argmax.tolist()  # [R] (CPU: no device round trip)
    base = batch.cu_num_rows.tolist()
    stops: list[set[int]] = [set() for _ in range(B)]
    if eos_token_id is not None:
        eos = torch.as_tensor(eos_token_id).to(torch.long)
        eos = eos.expand(B)[:, None] if eos.dim() < 2 else eos  # [B, S] stop ids, -1 padded
        stops = [{t for t in row if t >= 0} for row in eos.tolist()]
    budget = None if max_tokens is None else torch.as_tensor(max_tokens, dtype=torch.long).expand(B).tolist()
    if budget is not None and min(budget, default=1) < 1:
        raise ValueError("max_tokens must be >= 1 for every request")
    accepted = [[NO_NODE] * D for _ in range(B)]
    output = [[PAD_TOKEN_ID] * (D + 1) for _ in range(B)]
    num, nxt, walked = [0] * B, [0] * B, [0] * B
    for b, tree in enumerate(batch.trees):
        if tree.tokens is None and tree.num_nodes:
            raise ValueError(f"tree {b} has {tree.num_nodes} nodes but no tokens; verification needs them")
        toks, children, r0 = [] if tree.tokens is None else tree.tokens.tolist(), tree.children, base[b]
        path, row = [], 0
        while True:  # descend while a child carries the row's argmax (the first such sibling)
            want = y[r0 + row]
            hit = next((c for c in children[row] if toks[c] == want), None)
            if hit is None:
                break
            path.append(hit)
            row = hit + 1
        kept, nxt[b] = _truncate(path, y[r0 + row], toks, stops[b], None if budget is None else budget[b])
        walked[b], num[b] = len(path), len(kept)
        accepted[b][: len(kept)] = kept
        output[b][: len(kept) + 1] = [toks[c] for c in kept] + [nxt[b]]
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return TreeVerifyOutput(t(accepted).view(B, D), t(num), t(nxt), t(output).view(B, D + 1), t(walked))
