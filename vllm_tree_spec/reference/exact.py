"""Exact output laws of tree speculation, by enumeration (the losslessness checker).

Lossless means: the tokens a round emits are distributed exactly as sequential
sampling from the target. Over a small vocabulary that can be *computed*, not
estimated:

* `enumerate_law(fn)` runs `fn(coins)` under every sequence of coin outcomes.
  The coins are the verifier's own `CoinSource` interface (`accept(ratio)` =
  "u < ratio", `draw(p)`), so the code under test is the real verification code;
  each branch carries its exact probability (min(1, ratio), p_y / sum p).
* `round_law(...)` composes a drafting scheme (how children are proposed at
  every row of a fixed tree shape) with a node rule (`verify.node_step` or a
  deliberately lossy variant) recursively over the tree, giving the exact law of
  the emitted sequence. Subtrees are drafted independently given their context,
  so the recursion never enumerates whole token assignments.
* `extend_law` / `sequential_law` continue every emitted sequence with plain
  target sampling to a common length; `total_variation` compares the two. A
  lossless rule gives TV at float64 rounding level (< 1e-12); the known-lossy
  rules give TV of order 1e-2..1e-1, so the checker itself can fail.

Target and draft are `ToyLM`s: a distribution for every context, derived from
a seed and the context, with the request's sampling transforms applied.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from vllm_tree_spec.sampling import target_probs as transform
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode, node_step

Seq = tuple[int, ...]
Law = dict[Seq, float]


# ---------------------------------------------------------------------------
# Enumerating the coins of the real verifier


class _Branch(Exception):
    def __init__(self, outcomes: list[tuple[Hashable, float]]):
        self.outcomes = outcomes


class _ScriptedCoins:
    """Replays a fixed prefix of outcomes; the first unscripted coin raises `_Branch`."""

    def __init__(self, script: Sequence[Hashable]):
        self.script, self.i = script, 0

    def _next(self, outcomes):
        if self.i < len(self.script):
            out = self.script[self.i]
            self.i += 1
            return out
        raise _Branch(outcomes)

    def accept(self, ratio: float, depth: int, rank: int) -> bool:
        a = min(1.0, max(0.0, ratio))  # P(u < ratio) for u ~ U[0, 1)
        return self._next([(True, a), (False, 1.0 - a)])

    def draw(self, p: torch.Tensor, depth: int) -> int:
        p = p.to(torch.float64)
        z = float(p.sum())
        return self._next([(y, float(p[y]) / z) for y in range(p.numel()) if float(p[y]) > 0])


def enumerate_law(fn: Callable[[_ScriptedCoins], Hashable]) -> dict[Hashable, float]:
    """Exact law of fn's result over all coin outcomes (depth-first replay)."""
    law: dict[Hashable, float] = defaultdict(float)
    stack: list[tuple[tuple, float]] = [((), 1.0)]
    while stack:
        script, w = stack.pop()
        try:
            result = fn(_ScriptedCoins(script))
        except _Branch as br:
            stack.extend((script + (o,), w * pr) for o, pr in br.outcomes if pr > 0)
            continue
        law[result] += w
    return dict(law)


# ---------------------------------------------------------------------------
# Toy language models over a small vocabulary


@dataclass
class ToyLM:
    """p(. | context) for every context: seeded random logits, then sampling transforms.

    `mix_with` blends in another model's logits, so a draft can be made close to
    the target (q ~ p) or far from it.
    """

    vocab: int
    seed: int
    scale: float = 2.0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    mix_with: "ToyLM | None" = None
    mix: float = 0.0
    _cache: dict = field(default_factory=dict, repr=False)

    def logits(self, ctx: Seq) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + tuple(ctx)) & 0x7FFFFFFF)
        x = torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.scale
        if self.mix_with is not None:
            x = (1 - self.mix) * x + self.mix * self.mix_with.logits(ctx)
        return x

    def __call__(self, ctx: Seq) -> torch.Tensor:
        ctx = tuple(ctx)
        if ctx not in self._cache:
            self._cache[ctx] = transform(self.logits(ctx)[None], self.temperature, self.top_k, self.top_p,
                                         self.min_p)[0]
        return self._cache[ctx]


# ---------------------------------------------------------------------------
# Drafting schemes: the law of the children tokens of one row


def children_law(scheme: str, q: torch.Tensor, k: int) -> list[tuple[Seq, float]]:
    """All ordered child-token tuples a scheme can propose from q, with their probabilities.

    topk      the k most likely tokens (ties to the lower id), probability 1
    iid       k independent draws from q (duplicates possible)
    wor       k draws without replacement, in draw order
    """
    vocab = q.numel()
    if scheme == "topk":
        order = sorted(range(vocab), key=lambda t: (-float(q[t]), t))
        return [(tuple(order[:k]), 1.0)]
    out = []
    for xs in itertools.product(range(vocab), repeat=k):
        if scheme == "iid":
            pr = 1.0
            for x in xs:
                pr *= float(q[x])
        elif scheme == "wor":
            if len(set(xs)) < k:
                continue
            pr, left = 1.0, 1.0
            for x in xs:
                if left <= 0:
                    pr = 0.0
                    break
                pr *= float(q[x]) / left
                left -= float(q[x])
        else:
            raise ValueError(f"unknown drafting scheme {scheme!r}")
        if pr > 0:
            out.append((xs, pr))
    return out


NodeRule = Callable[..., tuple]  # same signature as verify.node_step


def round_law(
    tree: Tree,
    context: Seq,
    p_model: Callable[[Seq], torch.Tensor],
    q_model: Callable[[Seq], torch.Tensor],
    scheme: str,
    mode: Mode | str,
    rule: NodeRule = node_step,
) -> Law:
    """Exact law of the tokens one round emits for a tree *shape*, drafting included."""
    mode = Mode.parse(mode)
    memo: dict[tuple[int, Seq], Law] = {}

    def from_row(row: int, depth: int, ctx: Seq) -> Law:
        key = (row, ctx)
        if key in memo:
            return memo[key]
        children = tree.children[row]
        p, q = p_model(ctx), q_model(ctx)
        law: Law = defaultdict(float)
        for xs, pr in children_law(scheme, q, len(children)) if children else [((), 1.0)]:
            step = enumerate_law(lambda coins: rule(p, q, list(xs), mode, coins, depth))
            for (rank, y), w in step.items():
                if rank is None:
                    law[(y,)] += pr * w
                else:
                    for rest, w2 in from_row(children[rank] + 1, depth + 1, ctx + (y,)).items():
                        law[(y,) + rest] += pr * w * w2
        memo[key] = dict(law)
        return memo[key]

    return from_row(0, 0, tuple(context))


def extend_law(law: Law, context: Seq, p_model, length: int) -> Law:
    """Continue every emitted sequence with sequential target sampling up to `length` tokens."""
    out: Law = defaultdict(float)
    frontier = list(law.items())
    while frontier:
        seq, w = frontier.pop()
        if len(seq) >= length:
            out[seq[:length]] += w
            continue
        p = p_model(tuple(context) + seq)
        frontier.extend((seq + (y,), w * float(p[y])) for y in range(p.numel()) if float(p[y]) > 0)
    return dict(out)


def sequential_law(context: Seq, p_model, length: int) -> Law:
    """The target's own law of the next `length` tokens."""
    return extend_law({(): 1.0}, context, p_model, length)


def total_variation(a: Law, b: Law) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


def round_tv(tree: Tree, context: Seq, p_model, q_model, scheme: str, mode, rule: NodeRule = node_step) -> float:
    """TV between (one round, then sequential target sampling) and pure target sampling."""
    length = tree.max_depth + 1
    law = round_law(tree, context, p_model, q_model, scheme, mode, rule)
    total = sum(law.values())
    if abs(total - 1) > 1e-9:
        return abs(total - 1)  # a rule that loses or invents mass is not lossless
    return total_variation(extend_law(law, context, p_model, length), sequential_law(context, p_model, length))


# ---------------------------------------------------------------------------
# Deliberately lossy node rules (engines shipped these); the tests assert the checker flags them.


def residual_rule_skip_duplicates(p, q, child_tokens, mode, coins, depth):
    """LOSSY: i.i.d. children verified by RRS, but duplicate siblings merged (their residual update skipped)."""
    from vllm_tree_spec.verify import residual

    seen: set[int] = set()
    for rank, x in enumerate(child_tokens):
        if x in seen:
            continue
        seen.add(x)
        ratio = float(p[x]) / float(q[x]) if float(q[x]) > 0 else 0.0
        if coins.accept(ratio, depth, rank):
            return rank, x
        p = residual(p, q)
    return None, coins.draw(p, depth)
