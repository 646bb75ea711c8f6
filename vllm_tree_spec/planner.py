"""Speculation budgets: how many draft tokens pay off, and in what shape, per batch size.

A speculative step drafts, verifies and commits; it costs

    step_ms = draft_ms + verify_ms + state_ms

and emits E tokens per request on average (accepted drafts plus the bonus /
correction token). Without speculation a step emits one token per request at
`verify_ms(B, 1)`. Every request in the batch advances together, so the
per-request token rate, and the batch's tokens/s, improve by

    gain = (E / step_ms) / (1 / baseline_ms) = E * baseline_ms / step_ms

Chains (Leviathan et al., arXiv 2211.17192) with i.i.d. acceptance
alpha and gamma drafts emit E[N] = 1 + alpha + ... + alpha^gamma per step;
`plan_chain` evaluates that formula with fixed stage costs.

Trees spend the budget on width. With a measured acceptance table a[d][r]
(the probability that the rank-r child of an accepted depth d - 1 node is
the accepted one) the expected tokens of any tree are
`sequoia.expected_accepted_length` and the best n-node tree of depth <= L is
Sequoia's DP (`sequoia.optimal_static_trees`). Extra nodes are nearly free
while the verify forward is memory-bound and cost ~linearly once B * tokens
passes the GEMM knee, so the best budget shrinks as the batch grows and
speculation stops paying at some batch size. `plan_trees` searches every
(budget, depth) at every batch size against a `CostModel`; `plan_budgets` is
the short form the vLLM integration calls (batch size -> Tree or None).

Costs come from measurements: a roofline verify model (a memory-bound floor
up to a knee, linear after it) or a measured table verify_ms[B][tokens],
plus per-level draft cost and per-node commit/state cost. See docs/planner.md
for the JSON schema and the CLI.

Nothing here imports vLLM.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_tree_spec.sequoia import (
    _sequoia_paths,
    _solve_sequoia,
    acceptance_table,
    expected_accepted_length,
    optimal_static_trees,
)
from vllm_tree_spec.tree import Tree, TreeShape

DEFAULT_MAX_DEPTH = 10  # deeper levels rarely pay: acceptance decays geometrically with depth

# ---------------------------------------------------------------------------
# Chains


@dataclass(frozen=True)
class ChainPlan:
    """Leviathan et al.'s chain budget with fixed stage costs (all times in ms)."""

    alpha: float
    gamma: int
    expected_tokens: float  # E[N] = 1 + alpha + ... + alpha^gamma, bonus included
    cycle_ms: float  # gamma * draft_ms + verify_ms + state_ms
    ms_per_token: float  # cycle_ms / E[N]
    speedup: float  # baseline_ms / ms_per_token


def chain_expected_tokens(alpha: float, gamma: int) -> float:
    """1 + alpha + ... + alpha^gamma (tokens per verify step, bonus included)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha = {alpha}: the per-token acceptance rate must lie in [0, 1]")
    if gamma < 0:
        raise ValueError(f"gamma = {gamma}: the number of draft tokens must be >= 0")
    return math.fsum(alpha**i for i in range(gamma + 1))


def plan_chain(
    alpha: float, gamma: int, draft_ms: float, verify_ms: float, state_ms: float, baseline_ms: float
) -> ChainPlan:
    """Expected tokens, ms/token and speedup of a gamma-token chain."""
    for name, v in (("draft_ms", draft_ms), ("verify_ms", verify_ms), ("state_ms", state_ms)):
        if v < 0 or not math.isfinite(v):
            raise ValueError(f"{name} = {v}: stage costs must be finite and >= 0")
    if not baseline_ms > 0:
        raise ValueError(f"baseline_ms = {baseline_ms}: the no-speculation step time must be > 0")
    e = chain_expected_tokens(alpha, gamma)
    cycle = gamma * draft_ms + verify_ms + state_ms
    if not cycle > 0:
        raise ValueError("gamma * draft_ms + verify_ms + state_ms is 0; give the measured stage costs")
    per_token = cycle / e
    return ChainPlan(alpha, gamma, e, cycle, per_token, baseline_ms / per_token)


def format_chain(plan: ChainPlan) -> str:
    return "\n".join(
        [
            f"chain: gamma = {plan.gamma}, alpha = {plan.alpha:g}",
            f"expected tokens/step: {plan.expected_tokens:.4f}",
            f"cycle: {plan.cycle_ms:.3f} ms",
            f"ms/token: {plan.ms_per_token:.3f}",
            f"speedup: {plan.speedup:.3f}x",
        ]
    )


# ---------------------------------------------------------------------------
# Cost model


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RooflineVerify(_Frozen):
    """verify_ms(B, t) = weights_ms * max(1, B * t / knee_tokens) + token_ms * B * t.

    t = tokens per request (draft nodes + the root). Below the knee a forward
    is bound by reading the weights; above it, GEMM compute grows with the
    batch's tokens. token_ms covers per-token work that is never free
    (attention over the context, sampling, MoE experts touched).
    """

    kind: Literal["roofline"] = "roofline"
    weights_ms: float = Field(gt=0)
    """Forward time while memory-bound (one token per request at small batch)."""
    knee_tokens: float = Field(gt=0)
    """Batch tokens (B * t) at which compute time reaches weights_ms."""
    token_ms: float = Field(default=0.0, ge=0)
    """Extra linear cost per batch token."""

    def forward_ms(self, batch: int, tokens: int) -> float:
        bt = batch * tokens
        return self.weights_ms * max(1.0, bt / self.knee_tokens) + self.token_ms * bt

    def max_tokens(self, batch: int) -> float:
        return math.inf


class TableVerify(_Frozen):
    """Measured verify_ms[B][t], interpolated piecewise-linearly in t, then in B.

    Never extrapolates: asking outside the measured batch range raises, and the
    planner only considers trees up to the largest measured t.
    """

    kind: Literal["table"] = "table"
    ms: dict[int, dict[int, float]]
    """batch size -> {tokens per request (nodes + 1): forward ms}; include t = 1 (no speculation)."""

    @model_validator(mode="after")
    def _check(self) -> "TableVerify":
        if not self.ms:
            raise ValueError("verify table ms is empty; add {batch: {tokens: ms}} measurements")
        for b, row in self.ms.items():
            if b < 1 or not row or min(row) < 1 or any(v <= 0 for v in row.values()):
                raise ValueError(
                    f"verify table row for batch {b}: need batch >= 1 and a non-empty {{tokens >= 1: ms > 0}} map"
                )
        return self

    def _row(self, batch: int, tokens: float) -> float:
        row = self.ms[batch]
        ts = sorted(row)
        if not ts[0] <= tokens <= ts[-1]:
            raise ValueError(
                f"verify table for batch {batch} covers {ts[0]}..{ts[-1]} tokens, not {tokens}; "
                f"measure that size or lower max_nodes"
            )
        return _interp(ts, [row[t] for t in ts], tokens)

    def forward_ms(self, batch: int, tokens: int) -> float:
        bs = sorted(self.ms)
        if not bs[0] <= batch <= bs[-1]:
            raise ValueError(
                f"verify table covers batch sizes {bs[0]}..{bs[-1]}, not {batch}; measure that batch size"
            )
        if batch in self.ms:
            return self._row(batch, tokens)
        i = bisect.bisect_left(bs, batch)
        lo, hi = bs[i - 1], bs[i]
        return _interp([lo, hi], [self._row(lo, tokens), self._row(hi, tokens)], batch)

    def max_tokens(self, batch: int) -> float:
        bs = sorted(self.ms)
        near = [b for b in bs if b >= batch][:1] + [b for b in bs if b <= batch][-1:]
        return min(max(self.ms[b]) for b in near) if near else 0


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostModel(_Frozen):
    """Stage costs of one speculative step, in ms, as functions of batch size B and tree size.

        draft_ms  = depth * draft_level_ms + B * nodes * draft_node_ms
        verify_ms = verify.forward_ms(B, nodes + 1)
        state_ms  = state_ms + B * nodes * state_node_ms
        baseline  = verify.forward_ms(B, 1)    (no speculation)
    """

    verify: Annotated[RooflineVerify | TableVerify, Field(discriminator="kind")]
    """The target forward over B requests of t tokens each."""
    draft_level_ms: float = Field(default=0.0, ge=0)
    """One draft forward (one tree level); a depth-D tree drafts D levels."""
    draft_node_ms: float = Field(default=0.0, ge=0)
    """Draft cost per drafted node per request (width-dependent part)."""
    state_ms: float = Field(default=0.0, ge=0)
    """Fixed per-step cost of commit / state bookkeeping."""
    state_node_ms: float = Field(default=0.0, ge=0)
    """Commit / scratch-state cost per node per request."""

    def baseline_ms(self, batch: int) -> float:
        return self.verify.forward_ms(batch, 1)

    def step_ms(self, batch: int, num_nodes: int, depth: int) -> float:
        if num_nodes == 0:
            return self.baseline_ms(batch)
        return (
            depth * self.draft_level_ms
            + batch * num_nodes * self.draft_node_ms
            + self.verify.forward_ms(batch, num_nodes + 1)
            + self.state_ms
            + batch * num_nodes * self.state_node_ms
        )

    def max_nodes(self, batch: int) -> float:
        return self.verify.max_tokens(batch) - 1


# ---------------------------------------------------------------------------
# Tree planning


@dataclass(frozen=True)
class TreePlan:
    """The best tree at one batch size (tree None = do not speculate)."""

    batch_size: int
    tree: Tree | None
    expected_tokens: float  # E[tokens per step per request], bonus included (1 without speculation)
    step_ms: float
    baseline_ms: float  # no-speculation step
    chain_expected_tokens: float  # chain with the same node count (nan without speculation)
    chain_step_ms: float
    best_chain_nodes: int  # the best chain of <= max_nodes drafts at this batch size (0 = none fits)
    best_chain_rate: float  # its tokens per ms per request
    candidates: int = field(default=0, compare=False)  # trees searched

    @property
    def gain(self) -> float:
        """Tokens/s relative to no speculation."""
        return self.expected_tokens * self.baseline_ms / self.step_ms

    @property
    def vs_chain(self) -> float:
        """Tokens/s relative to a chain of the same node count."""
        if self.tree is None:
            return math.nan
        return (self.expected_tokens / self.step_ms) / (self.chain_expected_tokens / self.chain_step_ms)

    @property
    def vs_best_chain(self) -> float:
        """Tokens/s relative to the best chain (any length up to the budget) at this batch size."""
        return (self.expected_tokens / self.step_ms) / self.best_chain_rate if self.best_chain_nodes else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Batch throughput: B * E / step."""
        return 1000.0 * self.batch_size * self.expected_tokens / self.step_ms


def shape_hint(tree: Tree) -> str:
    """The SGLang/EAGLE-2 dynamic shape with the same depth and budget: s{depth}_k{k}_d{nodes + 1}.

    k is the tree's widest fan-out, raised until the shape's candidate pool holds the budget.
    """
    if tree.num_nodes == 0:
        return "none"
    s, n = tree.max_depth, tree.num_nodes
    k = max(1, tree.max_children)
    while k + (s - 1) * k * k < n:
        k += 1
    return str(TreeShape(s, k, n + 1))


def describe_tree(tree: Tree | None) -> str:
    """'n=12 d=4 w=4/5/2/1' (nodes, depth, nodes per level), 'chain n=4' or 'none'."""
    if tree is None or tree.num_nodes == 0:
        return "none"
    if tree.is_chain():
        return f"chain n={tree.num_nodes}"
    widths = [int((tree.depth == d).sum()) for d in range(1, tree.max_depth + 1)]
    return f"n={tree.num_nodes} d={tree.max_depth} w={'/'.join(map(str, widths))}"


@dataclass(frozen=True)
class _Candidate:
    tree: Tree
    expected: float
    depth: int


def _candidates(acceptance, max_nodes: int, max_depth: int) -> dict[int, list[_Candidate]]:
    """Sequoia-optimal trees for every (budget n <= max_nodes, depth limit <= max_depth), by n."""
    by_n: dict[int, list[_Candidate]] = {}
    seen: set[tuple[int, ...]] = set()
    for limit in range(1, max_depth + 1):
        for n, tree in enumerate(optimal_static_trees(acceptance, max_nodes, limit)):
            if tree is None or n == 0:
                continue
            key = tuple(tree.parents.tolist())
            if key in seen:  # a deeper limit often gives back the same tree
                continue
            seen.add(key)
            by_n.setdefault(n, []).append(
                _Candidate(tree, expected_accepted_length(tree, acceptance), tree.max_depth)
            )
    return by_n


def candidate_trees(
    acceptance, max_nodes: int, max_depth: int, every_depth: bool = True
) -> list[tuple[Tree, float]]:
    """Every distinct Sequoia-optimal tree (budget <= max_nodes, depth limit <= max_depth) with its E[tokens].

    Ordered by node count, then depth limit: the search space of `plan_trees`, for callers that score
    candidates with their own costs (the online shape policy, `online_policy/`). Ranks whose
    acceptance is 0 at every depth are left out, and a tree is built once per distinct shape, so a
    re-plan stays cheap. every_depth=False solves the deepest limit only (one tree per budget): enough
    when the cost of a tree does not depend on its depth.
    """
    a = acceptance_table(acceptance, max(1, max_depth))
    used = np.nonzero(a.max(0) > 0)[0]
    a = a[:, : int(used[-1]) + 1 if used.size else 1]
    found: dict[tuple, tuple[int, int, float]] = {}  # rank paths -> (nodes, depth limit, E)
    deepest = max(1, min(max_depth, max_nodes))
    for limit in range(1, deepest + 1) if every_depth else [deepest]:
        tables = _solve_sequoia(a[:limit], max_nodes)
        for n in range(1, max_nodes + 1):
            if np.isfinite(tables.value[1, n]):
                key = tuple(sorted(_sequoia_paths(tables, n), key=lambda p: (len(p), p)))
                found.setdefault(key, (n, limit, 1.0 + float(tables.value[1, n])))
    order = sorted(found.items(), key=lambda kv: kv[1][:2])
    return [(Tree.from_paths(list(paths)), e) for paths, (_, _, e) in order]


def plan_trees(
    acceptance,
    cost: CostModel,
    batch_sizes: Sequence[int],
    max_nodes: int,
    max_depth: int | None = None,
    min_gain: float = 1.0,
) -> list[TreePlan]:
    """The tree maximising tokens per ms at each batch size.

    Args:
        acceptance: a[r] or a[d][r] (see `sequoia.acceptance_table`).
        cost: measured stage costs.
        batch_sizes: batch sizes to plan for.
        max_nodes: largest budget considered (draft nodes, root excluded).
        max_depth: deepest tree considered (default: rows of a per-depth
            table, else DEFAULT_MAX_DEPTH, never above max_nodes).
        min_gain: speculate only when tokens/s beats no speculation by more
            than this factor (1.0 = any gain).

    Returns one TreePlan per batch size, in the given order.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes = {max_nodes}: allow at least one draft node")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes = {list(batch_sizes)}: give one or more batch sizes >= 1")
    if max_depth is None:
        acceptance_table(acceptance, 1)  # validate before searching
        per_depth = torch.as_tensor(acceptance).dim() == 2
        max_depth = len(acceptance) if per_depth else DEFAULT_MAX_DEPTH
    max_depth = max(1, min(max_depth, max_nodes))
    by_n = _candidates(acceptance, max_nodes, max_depth)
    chain_e = {n: expected_accepted_length(Tree.chain(n), acceptance) for n in range(1, max_nodes + 1)}
    plans = []
    for b in batch_sizes:
        base = cost.baseline_ms(b)
        cap = cost.max_nodes(b)
        best: tuple[float, _Candidate] | None = None
        searched = 0
        for n, cands in by_n.items():
            if n > cap:
                continue
            for c in cands:
                searched += 1
                rate = c.expected / cost.step_ms(b, n, c.depth)  # tokens per ms per request
                if best is None or rate > best[0] + 1e-12:  # ties keep the smaller, earlier budget
                    best = (rate, c)
        chains = [(e / cost.step_ms(b, n, n), n) for n, e in chain_e.items() if n <= cap]
        chain_rate, chain_n = max(chains, key=lambda x: x[0]) if chains else (math.nan, 0)
        if best is None or best[0] * base <= min_gain:
            plans.append(TreePlan(b, None, 1.0, base, base, math.nan, math.nan, chain_n, chain_rate, searched))
            continue
        c = best[1]
        n = c.tree.num_nodes
        plans.append(
            TreePlan(
                b,
                c.tree,
                c.expected,
                cost.step_ms(b, n, c.depth),
                base,
                chain_e[n],
                cost.step_ms(b, n, n),
                chain_n,
                chain_rate,
                searched,
            )
        )
    return plans


def plan_budgets(
    acceptance,
    cost_model: CostModel,
    batch_sizes: Sequence[int],
    max_nodes: int,
    max_depth: int | None = None,
) -> dict[int, Tree | None]:
    """Batch size -> shape-only tree to draft (None = do not speculate at that batch size)."""
    return {p.batch_size: p.tree for p in plan_trees(acceptance, cost_model, batch_sizes, max_nodes, max_depth)}


def format_plan_table(plans: Sequence[TreePlan]) -> str:
    """A fixed-width table, one row per batch size."""
    head = ["batch", "best tree", "shape", "E[tokens]", "ms/step", "tok/s", "vs no-spec", "vs chain(n)",
            "vs best chain"]
    rows = []
    for p in plans:
        rows.append(
            [
                str(p.batch_size),
                describe_tree(p.tree),
                "-" if p.tree is None else shape_hint(p.tree),
                f"{p.expected_tokens:.3f}",
                f"{p.step_ms:.3f}",
                f"{p.tokens_per_s:.0f}",
                f"{p.gain:.3f}x",
                "-" if p.tree is None else f"{p.vs_chain:.3f}x",
                "-" if p.tree is None or not p.best_chain_nodes else f"{p.vs_best_chain:.3f}x (n={p.best_chain_nodes})",
            ]
        )
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:  # the tree column is left-aligned, numbers right-aligned
        return " | ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), sep, *map(line, rows)])


def depth_decay_table(rank_acceptance: Sequence[float], decay: float, depth: int) -> list[list[float]]:
    """a[d][r] = rank_acceptance[r] * decay^d for d = 0..depth-1 (drafts get worse deeper)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"depth decay = {decay}: must lie in [0, 1] (1 = same acceptance at every depth)")
    return [[a * decay**d for a in rank_acceptance] for d in range(depth)]
