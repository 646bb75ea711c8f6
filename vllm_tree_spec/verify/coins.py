"""The randomness of one verification: coins indexed by (request, depth), and the exponential race.

The walk visits at most one row per depth, so coins are indexed by (request, depth):
`uniform[b, d, j]` for the j-th child test at depth d and `exponential[b, d, :]` for the draw at
depth d, y = argmax(p / E) (the exponential race, as vLLM's recovered-token kernel). Passing the
same `VerifyCoins` makes the reference walk (`verify_tree_with_coins`), the vectorised
`verify_batch` and a kernel agree token for token.

Lazy coins (`VerifyCoins.draw(..., lazy=True)`, the engine's) draw an exponential row only when
the walk reaches its depth: the same law, (accepted + 1) rows of V per request instead of D + 1.
Seeded requests draw from their own generator, so a request's tokens do not depend on the rest of
the batch. A verifier that cannot draw (the Triton kernel) gets them materialised
(`VerifyCoins.materialise`), drawn as the sync-free walk draws them.

The reference walk reads its randomness through `CoinSource`: `GeneratorCoins` (fresh draws from a
generator), `TensorCoins` (one request's slice of `VerifyCoins`), or an exact enumerator
(`reference/exact.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


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

    def materialise(self, deterministic: Sequence[int], sampled: Sequence[int],
                    max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lazy coins -> every exponential row a walk may read, for a verifier that cannot draw (the Triton
        kernel): (rows [E, V] on the coins' device, index [B, D + 1] int64 on the host: the row read at
        (request, depth)).

        Drawn by the calls `verify_batch(sync_free=True)` makes, in its order: at each depth 0..D one row
        per deterministic request (`deterministic`: request ids, ascending), then one row per sampled
        request (`sampled`), its recovered / bonus draw, read at whatever depth its walk stops. So a
        seeded request gets the same rows on either path, and with track_streams `rewind` afterwards
        leaves its stream where the other path leaves it. Greedy requests read no row (index 0).
        E = (D + 1) * len(deterministic) + len(sampled); the rows cost E * V * itemsize bytes.
        """
        n_det, n_smp = len(deterministic), len(sampled)
        device = self.uniform.device
        rows = torch.empty(((max_depth + 1) * n_det + n_smp, self.vocab_size), dtype=self.dtype, device=device)
        index = torch.zeros(self.uniform.shape[0], max_depth + 1, dtype=torch.long)  # [B, D + 1]
        det = torch.tensor(list(deterministic), dtype=torch.long)
        if n_det:
            for d in range(max_depth + 1):
                rows[d * n_det: (d + 1) * n_det] = self.exponential_at(det, torch.full((n_det,), d))
            index[det] = torch.arange(max_depth + 1)[None, :] * n_det + torch.arange(n_det)[:, None]
        if n_smp:
            smp = torch.tensor(list(sampled), dtype=torch.long)
            rows[(max_depth + 1) * n_det:] = self.exponential_at(smp, torch.zeros(n_smp, dtype=torch.long))
            index[smp] = (max_depth + 1) * n_det + torch.arange(n_smp)[:, None]
        return rows, index

    def rewind(self, rows_read: Sequence[int]) -> None:
        """Seeded streams of tracked lazy coins: keep the first rows_read[b] exponential rows, give back
        the rest (a walk that draws at every depth without knowing where it stops, `verify_batch(...,
        sync_free=True)`). The stream then stands where a walk drawing only where it goes leaves it."""
        for b, states in (self.tracked or {}).items():
            if rows_read[b] < len(states):
                self.generators[b].set_state(states[rows_read[b]])
        self.tracked = {} if self.tracked is not None else None


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
