"""The online shape policy: which tree to draft, re-planned from what serving measures (`"budgets": "auto"`).

A tree only pays where its extra rows are accepted often enough to beat their
verify cost; where they are not, a chain (or no speculation at all) is faster.
Both sides of that trade are measured while serving, per drafter:

    acceptance profile   a[d][r]: P(the rank-r child of a reached depth d - 1 node
                         is drafted *and* accepted), and f[d][r]: P(it is drafted),
                         counted over the ranks the step asked the drafter for
    step costs           per batch-size bucket (1, 2, 4, ...): step ms against rows
                         verified (a decayed line: its slope from consecutive steps
                         whose rows differ), and the draft ms of steps that
                         drafted / did not draft

Every `replan_every` steps the policy re-plans each bucket, and early, when a bucket reaches its 8th, 32nd and
128th clean step (EARLY_STEPS): a load that lasts less than `replan_every` steps is still planned, and a first
plan, made on few steps, is revised soon after. Until its first plan a bucket drafts the plan of the nearest
planned bucket (the drafter's full tree when there is none). At a re-plan Sequoia's DP
(`planner.candidate_trees`) on a[d][r] gives the best tree of every size; each
is scored as expected tokens per step over predicted step ms,

    E(S)     = 1 + sum over nodes v of S of  prod_{u on root->v} a[depth u][rank u]
    rows(S)  = B * (1 + sum over v of prod f[..])          (drafters fill a shape partly)
    ms(S)    = fit(rows(S)) + draft ms
    no speculation: the measured draftless steps' ms (fit(B) until there are MIN_NONE_STEPS) + draft ms of an
             empty step; a bucket whose plan speculates makes a few of its steps draftless to measure it
             (`none_probe_due`: the line's slope between speculating steps, extrapolated down to the root rows,
             mispriced `none` by 60 %)

next to `full` (the drafter's own tree at the configured budget, scored on its
measured tokens per step and nodes), `linear` (the drafter's linear draft, `TreeProposal.linear_len` or the
rank-0 path: what the same drafter's linear method verifies; a path of every tree drafted under `full` or
`linear`, so each of those rounds also measures what it alone would have yielded) and `none`. The best replaces the
current plan only when it is predicted at least `hysteresis` faster than the
current plan under the same, new measurements (no flapping between near-equal
plans). Given the measurements the result is deterministic: fixed iteration
order, ties to the smaller tree, no randomness.

How a plan is applied: the drafter always proposes at the engine's budget, and
the proposal is *pruned* to the plan's child-rank paths (`prune_to_shape`): a
node is kept iff its rank path is in the plan. Any subtree of a proposal is
verified by the same lossless rule (a topological, ancestor-closed subset of
distinct / in-order drawn children), so a plan changes which rows are verified
and never the output's law. A `none` plan passes budget 0 (the drafter is
skipped).

The score gate (`score_gate`, on by default): a plan fixes which child ranks are drafted, the same for
every request; a drafter also says how sure it is of each node (`TreeProposal.scores`: a path
frequency for suffix / n-gram drafters, log q of the path for model drafters). The policy calibrates
that confidence against outcomes, pi(c) = P(a drafted node of confidence c is accepted) (decayed counts in
0.5-nat bins, made non-decreasing in c by isotonic regression; a bin is judged by the 95 % upper bound
of its rate, so that a few unlucky rounds do not cut it), and at each re-plan sets per bucket the
marginal row's break-even

    tau = slope * B * E / ms        (ms per row, batch size, tokens per round, step ms of the chosen plan)

a node adds pi(c) tokens to the step and one row (slope ms) to its cost, so keeping it raises the
batch's tokens per ms iff pi(c) > tau. Nodes below the gate (and their subtrees) are dropped from the
plan's trees, request by request. Where rows are nearly free (small batches) tau is near 0 and nothing
is dropped; where the step is compute-bound tau approaches the tokens per verified row.

Exploration: a policy that settled on a chain would never see a rank-1 child
again and could never return to a tree. Every `explore period`-th step drafts
the unpruned, ungated tree (ranks up to MAX_RANK are counted as asked, every confidence is calibrated) for the
requests whose rounds the next step reads back (at most OBSERVE_PER_STEP, the same rotation) and the plan for the
others, which costs at most the gap between the full tree and the plan for those requests on that one step;
while the plan is `full` they draft a half-budget chain instead (the cost of fewer rows).
The period starts at `explore_every`, doubles at every re-plan that keeps the
plan (up to 8x), and resets when the plan changes or the cost drifts (its
measured step time 50 % off the prediction): a settled policy pays little.

Observations are read from the committed tokens themselves: the next call's
context extends the previous one by the accepted path plus one bonus token,
and the path is found by matching those tokens against the tree that was
verified (at most OBSERVE_PER_STEP requests a step, rotating). Only clean steps
(no request arrived since the step before, each grown by 1..1 + nodes tokens;
requests may have finished) time the step; a request whose growth does not match its tree (preempted,
truncated) is skipped.

Nothing here imports vLLM; `integration/shape_policy.py` adds the log line and
the `/metrics` gauges. docs/planner.md section 4 is the user-facing account.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from vllm_tree_spec.drafters.base import DraftRequest, TreeProposal
from vllm_tree_spec.planner import candidate_trees, describe_tree
from vllm_tree_spec.tree import NO_PARENT, Tree, long_tensor
from vllm_tree_spec.verify import Mode

GATED_MODES = (Mode.GREEDY, Mode.DETERMINISTIC)  # children chosen, not drawn: any draft-side subset is lossless

MAX_RANK = 8  # sibling ranks measured (and planned) per node
MAX_DEPTH = 10  # deepest level planned (planner.DEFAULT_MAX_DEPTH)
PROFILE_PRIOR = 1.0  # pseudo-rounds of "asked, not accepted" per cell: unmeasured ranks plan as ~0
DECAY = 0.5  # at every re-plan old measurements weigh half: the plan follows the workload
MIN_ROUNDS = 64  # request-rounds in the profile before the first plan
MIN_FULL_ROUNDS = 16  # unpruned rounds before `full` is scored on its measured yield
OBSERVE_PER_STEP = 8  # request-rounds a step learns from (rotating): bounds the policy's per-step Python
MIN_PAIRS = 32  # consecutive step pairs kept for the slope (exploration makes them sparse)
MIN_STEPS = 8  # clean steps in a bucket before it is planned
SLOPE_PRIOR = 32.0  # the slope is shrunk toward 0 ms per row as if 32 squared row differences had shown no cost
OUTLIER = 4.0  # a step slower than 4x the fitted line is not a cost sample (GC, swap, a stall)
DRIFT = 0.5  # a plan's measured step ms 50 % off its prediction: the cost has moved
DRIFT_FORGET = 0.1  # then old cost samples keep a tenth of their weight
EXPLORE_BACKOFF = 8  # the exploration period grows to at most 8 x explore_every
GATE_EDGES = np.linspace(-12.0, 0.0, 25)  # score-gate bins: log confidence in 0.5-nat steps (below -12: bin 0)
_EDGES = GATE_EDGES.tolist()
EARLY_STEPS = (MIN_STEPS, 4 * MIN_STEPS, 16 * MIN_STEPS)  # a bucket's clean steps at which it re-plans early
MIN_GATE_NODES = 256  # drafted nodes calibrated before a bucket gets a gate
MIN_BIN_NODES = 64  # a bin's counts are not decayed below this
NONE_PROBES = 4  # draftless steps a bucket measures (decayed count) while its plan speculates
MIN_NONE_STEPS = 2.0  # measured draftless steps (decayed weight) before `none` is priced from them
GATE_QUANTILE = 0.95  # a bin is dropped when even its 95 % upper bound of acceptance is below the break-even
NO_GATE = -math.inf


def bucket_of(batch_size: int) -> int:
    """The batch-size bucket a batch is planned in: the next power of two (1, 2, 4, ...)."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


# ---------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class Plan:
    """What a bucket drafts: `full` (the drafter's own tree), `linear` (its linear draft: what the linear
    method of the same drafter verifies), `tree` (pruned to `shape`) or `none`."""

    kind: str  # "full" | "linear" | "tree" | "none"
    shape: Tree | None = None  # shape-only tree (kind "tree")

    def __post_init__(self) -> None:
        if (self.kind == "tree") != (self.shape is not None):
            raise ValueError("a 'tree' plan needs its shape; 'full' and 'none' have none")

    @staticmethod
    def of(shape: Tree | None) -> "Plan":
        return Plan("none") if shape is None or shape.num_nodes == 0 else Plan("tree", shape)

    def __str__(self) -> str:
        return self.kind if self.kind in ("full", "linear") else describe_tree(self.shape)

    @property
    def key(self) -> tuple:
        return (self.kind, () if self.shape is None else tuple(self.shape.parents.tolist()))

    @property
    def num_nodes(self) -> int:
        return 0 if self.shape is None else self.shape.num_nodes

    @property
    def depth(self) -> int:
        return 0 if self.shape is None else self.shape.max_depth

    @cached_property
    def path_set(self) -> frozenset:
        """The shape's child-rank paths (what pruning keeps)."""
        return frozenset(structure(self.shape.parents.tolist())[2]) if self.shape is not None else frozenset()

    @cached_property
    def fanout(self) -> dict[tuple[int, ...], int]:
        """Children per node of the shape, keyed by the node's child-rank path (the root is ())."""
        out: dict[tuple[int, ...], int] = {}
        for p in self.path_set:
            out[p[:-1]] = out.get(p[:-1], 0) + 1
        return out

    @property
    def width(self) -> int:
        """Most nodes on one level."""
        if self.shape is None or self.shape.num_nodes == 0:
            return 0
        return int(torch.bincount(self.shape.depth).max())


FULL = Plan("full")
LINEAR = Plan("linear")
NONE = Plan("none")


def structure(parents: Sequence[int]) -> tuple[list[int], list[int], list[tuple[int, ...]], list[list[int]]]:
    """One pass over a parent array: sibling ranks [N], depths [N], child-rank paths [N], children by row [N + 1].

    (Tree's cached properties give the same; a fresh proposal per request per step would compute each
    with its own loop and tensor ops, this is the policy's hot path.)
    """
    ranks, depths, paths, children = [], [], [], [[]]
    for i, p in enumerate(parents):
        kids = children[p + 1]
        ranks.append(len(kids))
        kids.append(i)
        children.append([])
        depths.append(1 if p < 0 else depths[p] + 1)
        paths.append((() if p < 0 else paths[p]) + (ranks[i],))
    return ranks, depths, paths, children


def path_sum(shape: Tree, table: np.ndarray) -> float:
    """sum over nodes v of prod over u on root->v of table[depth(u) - 1, rank(u)] (0 beyond the table)."""
    reach = [1.0] * (shape.num_nodes + 1)  # by row, root = 1
    rows, cols = table.shape
    for i, (p, d, r) in enumerate(zip(shape.parents.tolist(), shape.depth.tolist(), shape.sibling_rank.tolist())):
        reach[i + 1] = reach[p + 1] * (float(table[d - 1, r]) if d <= rows and r < cols else 0.0)
    return math.fsum(reach[1:])


def prune_to_shape(proposal: TreeProposal, plan: "Plan") -> TreeProposal:
    """The nodes of `proposal` whose child-rank path is in the plan (an ancestor-closed subset, same order).

    Ranks are contiguous, so a kept node keeps its rank and draw order; q rows (sampled trees) follow
    their nodes. Verification of the result is as lossless as of the whole tree.
    """
    tree = proposal.tree
    if tree.num_nodes == 0:
        return proposal
    allowed = plan.path_set
    parents = tree.parents.tolist()
    _, _, paths, _ = structure(parents)
    return _keep_nodes(proposal, [i for i, p in enumerate(paths) if p in allowed])


def linear_nodes(proposal: TreeProposal, children: list[list[int]] | None = None) -> list[int]:
    """The nodes of the drafter's linear draft: its first `linear_len` nodes, else the rank-0 path
    (`children`: by row, from `structure`, if the caller has it)."""
    if proposal.linear_len is not None:
        return list(range(proposal.linear_len))
    children = children if children is not None else structure(proposal.tree.parents.tolist())[3]
    out, row = [], 0
    while children[row]:
        out.append(children[row][0])
        row = out[-1] + 1
    return out


def prune_to_linear(proposal: TreeProposal) -> TreeProposal:
    """The proposal's linear draft (a chain from the root; the same lossless rule verifies it)."""
    if proposal.tree.num_nodes == 0:
        return proposal
    return _keep_nodes(proposal, linear_nodes(proposal))


def confidence(scores: torch.Tensor, scores_are_probs: bool) -> list[float]:
    """[N] log confidence of a proposal's nodes: log of a path frequency, or the log q it already is (a list: a
    few nodes per request per step, where tensor or array ops cost more than the arithmetic)."""
    s = scores.tolist()
    return [math.log(max(x, 1e-300)) for x in s] if scores_are_probs else s


def gate_by_confidence(proposal: TreeProposal, conf: Sequence[float], min_conf: float) -> TreeProposal:
    """The nodes of `proposal` whose log confidence is >= min_conf and whose parent is kept (ancestor-closed,
    same order; verification of the result is as lossless as of the whole tree)."""
    if all(c >= min_conf for c in conf):  # the common case where rows are cheap: nothing to cut
        return proposal
    parents = proposal.tree.parents.tolist()
    kept = [False] * len(parents)
    for i, p in enumerate(parents):  # topological order: a parent is decided before its children
        kept[i] = conf[i] >= min_conf and (p < 0 or kept[p])
    return _keep_nodes(proposal, [i for i, k in enumerate(kept) if k])


def _keep_nodes(proposal: TreeProposal, keep: list[int]) -> TreeProposal:
    """The proposal restricted to the ancestor-closed node list `keep` (ascending)."""
    tree = proposal.tree
    k = len(keep)
    if k == tree.num_nodes:
        return proposal
    if k == 0 or keep[-1] == k - 1:  # a prefix (chains, score-ordered trees, nothing): slices, no re-indexing
        q, scores = proposal.draft_probs, proposal.scores
        return TreeProposal(Tree(tree.parents[:k], tree.tokens[:k]), proposal.mode, None if q is None else q[: k + 1],
                            None if scores is None else scores[:k])
    parents = tree.parents.tolist()
    new_index = {j: i for i, j in enumerate(keep)}
    kept_parents = [NO_PARENT if parents[j] < 0 else new_index[parents[j]] for j in keep]  # parents are kept too
    idx = long_tensor(keep)
    q = proposal.draft_probs
    if q is not None:
        q = q[torch.tensor([0] + [j + 1 for j in keep], device=q.device)]  # [n' + 1, V] root row + kept rows
    scores = None if proposal.scores is None else proposal.scores[idx]
    return TreeProposal(Tree(long_tensor(kept_parents), tree.tokens[idx]), proposal.mode, q, scores)


# ---------------------------------------------------------------------------
# Measurements


@dataclass
class Yield:
    """Decayed rounds, tokens (bonus included) and nodes of one plan drafted as a whole (`full`, `linear`)."""

    rounds: float = 0.0
    tokens: float = 0.0
    nodes: float = 0.0

    def add(self, tokens: int, nodes: int) -> None:
        self.rounds += 1
        self.tokens += tokens
        self.nodes += nodes

    def decay(self, factor: float) -> None:
        self.rounds *= factor
        self.tokens *= factor
        self.nodes *= factor

    def mean(self, min_rounds: float = MIN_FULL_ROUNDS) -> tuple[float, float]:
        """(tokens per round, nodes per round); (nan, nan) under min_rounds (a few rounds are too noisy to
        switch on) or with no rounds."""
        if self.rounds < min_rounds or self.rounds <= 0:
            return math.nan, math.nan
        return self.tokens / self.rounds, self.nodes / self.rounds


@dataclass
class AcceptanceProfile:
    """Decayed counts by (depth, sibling rank): asked, drafted, accepted; and the yields of `full` and `linear`.

    `asked[d, r]` counts rank-r child slots below a depth-d node that the step asked the drafter for
    (the plan's fan-out there, MAX_RANK when unpruned): at reached nodes for `accepted`, at drafted
    nodes for `drafted`.

    A round adds 1 to a prefix of ranks (ranks 0 .. k - 1 of a level) for every node it visits, so what a round
    records is one count per node: the prefix length k, in a histogram `*_upto[d][k]` (Python lists: a few
    scalar adds per round, the policy's hot path); `reached`, `present` and `drafted` are their suffix sums.
    """

    max_depth: int
    reached_upto: list = None  # [D][R + 1] reached (accepted) nodes by the number of ranks asked below them
    accepted_at: list = None  # [D][R] accepted nodes by depth and rank
    present_upto: list = None  # [D][R + 1] drafted nodes by the number of ranks asked below them
    drafted_upto: list = None  # [D][R + 1] drafted nodes by the number of their children that were asked for
    rounds: float = 0.0
    full: Yield = field(default_factory=Yield)  # unpruned rounds
    linear: Yield = field(default_factory=Yield)  # rounds whose verified tree held the linear draft: its yield

    _COUNTS = ("reached_upto", "accepted_at", "present_upto", "drafted_upto")

    def __post_init__(self) -> None:
        for name in self._COUNTS:
            if getattr(self, name) is None:
                width = MAX_RANK if name == "accepted_at" else MAX_RANK + 1
                setattr(self, name, [[0.0] * width for _ in range(self.max_depth)])

    def observe(self, tree: Tree, path: Sequence[int], asked: dict[tuple[int, ...], int] | None,
                struct=None) -> None:
        """One verified round: `tree` as verified, `path` the accepted nodes, `asked` the plan's fan-out
        (None = unpruned); `struct`: `structure(tree.parents)` if the caller has it."""
        ranks, depths, paths, children = struct or structure(tree.parents.tolist())

        def ask(row: int) -> int:
            if asked is None:
                return MAX_RANK
            return min(MAX_RANK, asked.get(() if row == 0 else paths[row - 1], 0))

        present, drafted = self.present_upto, self.drafted_upto
        for row, kids in enumerate(children):  # every drafted node (and the root): asked vs drafted
            d = 0 if row == 0 else depths[row - 1]
            if d >= self.max_depth:
                continue
            k = ask(row)
            present[d][k] += 1
            drafted[d][min(k, len(kids))] += 1  # ranks are 0..len(kids) - 1
        row = 0
        for d in range(min(len(path), self.max_depth - 1) + 1):  # reached nodes: asked vs accepted
            self.reached_upto[d][ask(row)] += 1
            if d < len(path):
                r = ranks[path[d]]
                if r < MAX_RANK:
                    self.accepted_at[d][r] += 1
                row = path[d] + 1
        self.rounds += 1
        if asked is None:
            self.full.add(1 + len(path), tree.num_nodes)

    @staticmethod
    def _ranks(upto: list) -> np.ndarray:
        """[D, R] per rank r: the counts of prefixes longer than r."""
        h = np.asarray(upto, dtype=np.float64)  # [D, R + 1]
        return np.cumsum(h[:, ::-1], axis=1)[:, ::-1][:, 1:]

    @property
    def reached(self) -> np.ndarray:
        """[D, R] asked rank-r slots below reached depth-d nodes."""
        return self._ranks(self.reached_upto)

    @property
    def present(self) -> np.ndarray:
        """[D, R] asked rank-r slots below drafted depth-d nodes."""
        return self._ranks(self.present_upto)

    @property
    def drafted(self) -> np.ndarray:
        """[D, R] drafted rank-r children (of those asked for) of depth-d nodes."""
        return self._ranks(self.drafted_upto)

    @property
    def accepted(self) -> np.ndarray:
        """[D, R] accepted rank-r children of reached depth-d nodes."""
        return np.asarray(self.accepted_at, dtype=np.float64)

    def decay(self, factor: float) -> None:
        for name in self._COUNTS:
            setattr(self, name, [[c * factor for c in counts] for counts in getattr(self, name)])
        self.rounds *= factor
        self.full.decay(factor)
        self.linear.decay(factor)

    def acceptance(self) -> np.ndarray:
        """[D, R] a[d][r] (rows rescaled to sum <= 1: ranks asked different numbers of times)."""
        a = self.accepted / (self.reached + PROFILE_PRIOR)
        s = a.sum(1, keepdims=True)
        return np.where(s > 1, a / np.maximum(s, 1e-12), a)

    def fill(self) -> np.ndarray:
        """[D, R] f[d][r]: P(the drafter offers the rank-r child of a drafted depth-d node)."""
        return np.minimum(1.0, self.drafted / (self.present + PROFILE_PRIOR))


@dataclass
class ScoreCalibration:
    """P(a drafted node is accepted) by the drafter's log confidence in it: decayed counts per GATE_EDGES bin."""

    drafted: np.ndarray = field(default_factory=lambda: np.zeros(len(GATE_EDGES)))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(len(GATE_EDGES)))

    @staticmethod
    def bins(conf: np.ndarray) -> np.ndarray:
        """[N] bin of each log confidence: bin i holds [GATE_EDGES[i], GATE_EDGES[i + 1]) (the last: >= 0)."""
        return np.clip(np.searchsorted(GATE_EDGES, conf, side="right") - 1, 0, len(GATE_EDGES) - 1)

    def observe(self, conf: Sequence[float], path: Sequence[int]) -> None:
        """One verified round: conf [N] of its nodes, `path` the accepted ones (scalar adds: a few nodes a round)."""
        b = [min(max(bisect.bisect_right(_EDGES, c) - 1, 0), len(_EDGES) - 1) for c in conf]  # = bins(conf)
        for i in b:
            self.drafted[i] += 1.0
        for i in path:
            self.accepted[b[i]] += 1.0

    def decay(self, factor: float) -> None:
        """Forget old rounds, except in bins left with fewer than MIN_BIN_NODES: a gated bin is drafted on
        exploration steps only, and forgetting the evidence that cut it would open it again."""
        f = np.where(self.drafted * factor >= MIN_BIN_NODES, factor, 1.0)
        self.drafted *= f
        self.accepted *= f

    @property
    def nodes(self) -> float:
        return float(self.drafted.sum())

    def acceptance(self, upper: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(bins with counts, pi per bin): accepted / drafted fitted non-decreasing in confidence (isotonic,
        weighted by the counts: a more confident node is not accepted less often). upper: the GATE_QUANTILE
        upper bound of each bin's rate (Beta posterior, uniform prior) instead, fitted the same way: a bin
        drafted 200 times and never accepted may still be accepted 1 % of the time."""
        from scipy.optimize import isotonic_regression
        from scipy.stats import beta

        seen = np.flatnonzero(self.drafted > 0)
        if len(seen) == 0:
            return seen, np.zeros(0)
        acc, n = self.accepted[seen], self.drafted[seen]
        rate = beta.ppf(GATE_QUANTILE, acc + 1, n - acc + 1) if upper else acc / n
        return seen, isotonic_regression(rate, weights=n, increasing=True).x

    def gate(self, tau: float) -> float:
        """The lowest log confidence to keep for break-even acceptance `tau` (NO_GATE: keep all): the lower
        edge of the least confident measured bin whose upper-bound pi >= tau (every more confident one has
        too). A bin is dropped only when its measurements show it below the break-even."""
        if tau <= 0 or self.nodes < MIN_GATE_NODES:
            return NO_GATE
        seen, pi = self.acceptance(upper=True)
        ok = np.flatnonzero(pi >= tau)
        if len(ok) == len(seen):  # every measured bin pays
            return NO_GATE
        if len(ok) == 0:  # none does: keep the most confident bin's nodes (`none` is the plan's decision)
            return float(GATE_EDGES[seen[-1]])
        return float(GATE_EDGES[seen[ok[0]]])


@dataclass
class BucketCosts:
    """One batch-size bucket: step ms (draft excluded) against rows verified, as decayed sums.

    The slope (ms per row) comes from consecutive steps whose rows differ (first differences:
    sum dx * dy / (sum dx^2 + SLOPE_PRIOR)), so a slow drift of the whole step cost (longer contexts, other
    load on the machine) does not leak into it; the level is the decayed mean step at the mean rows. The
    prior matters while the rows have barely varied (a bucket's first steps, all drafting the same trees):
    there a noisy slope, extrapolated to the rows of a much smaller plan, predicted `none` at 36 ms per step
    where it took 55; with the prior an unproven slope leans to "rows are cheap", the side of speculating,
    until steps of different rows show otherwise.
    """

    w: float = 0.0
    sx: float = 0.0  # rows
    sy: float = 0.0  # ms
    sdxx: float = 0.0  # consecutive steps: sum of d(rows)^2
    sdxy: float = 0.0  # and of d(rows) * d(ms)
    pairs: float = 0.0  # consecutive pairs in those sums
    sb: float = 0.0  # batch sizes (the bucket's representative batch is their mean)
    draft_ms: list = field(default_factory=lambda: [0.0, 0.0])  # summed draft ms of [empty, drafting] steps
    draft_n: list = field(default_factory=lambda: [0.0, 0.0])
    none_w: float = 0.0  # steps that verified no draft node (the root rows only): what `none` costs, measured
    none_ms: float = 0.0
    last: tuple | None = None  # (step index, rows, ms) of the last sample

    def observe(self, step: int, batch: int, rows: int, step_ms: float, draft_ms: float, drafted: bool,
                draftless: bool = False, probe: bool = False) -> None:
        """draftless: the step verified no draft node. probe: a draftless step the policy inserted into a
        speculating plan to measure `none` (kept off the line: see `none_step`)."""
        if self.w >= MIN_STEPS:
            fit = self.line(None)
            if fit is not None and step_ms > OUTLIER * max(fit[0] + fit[1] * rows, 1e-3):
                self.last = None
                return
        if draftless or probe:
            self.none_w += 1
            self.none_ms += step_ms
        if probe:
            self.last = None
            return
        if self.last is not None and self.last[0] == step - 1 and self.last[1] != rows:
            dx, dy = rows - self.last[1], step_ms - self.last[2]
            self.sdxx += dx * dx
            self.sdxy += dx * dy
            self.pairs += 1
        self.last = (step, rows, step_ms)
        self.w += 1
        self.sx += rows
        self.sy += step_ms
        self.sb += batch
        self.draft_ms[drafted] += draft_ms
        self.draft_n[drafted] += 1

    def decay(self, factor: float, slope_factor: float, force: bool = False) -> None:
        """Old samples weigh `factor` (the slope's `slope_factor`, unless that leaves under MIN_PAIRS pairs and
        not `force`: exploration makes pairs sparse)."""
        for name in ("w", "sx", "sy", "sb"):
            setattr(self, name, getattr(self, name) * factor)
        if force or self.pairs * slope_factor >= MIN_PAIRS:
            self.sdxx *= slope_factor
            self.sdxy *= slope_factor
            self.pairs *= slope_factor
        self.draft_ms = [v * factor for v in self.draft_ms]
        self.draft_n = [v * factor for v in self.draft_n]
        self.none_w *= factor
        self.none_ms *= factor

    def line(self, pooled_slope: float | None) -> tuple[float, float] | None:
        """(intercept ms, ms per row), or None while rows never varied and no pooled slope is known."""
        if self.w <= 0:
            return None
        if self.sdxx > 0:
            slope = self.sdxy / (self.sdxx + SLOPE_PRIOR)
        elif pooled_slope is not None:
            slope = pooled_slope
        else:
            return None
        slope = max(0.0, slope)  # more rows never make a step faster; noise can say otherwise
        return (self.sy - slope * self.sx) / self.w, slope

    def none_step(self) -> float | None:
        """Mean ms of the draftless steps measured here (None: too few). A step's cost is not linear in its
        rows down to the root rows alone: on CPU a 16-request step of SmolLM2 took 100 ms draftless and 241 ms
        at ~6 rows a request, where the slope between neighbouring speculating steps, extrapolated, priced the
        draftless step at over 160 ms, and the policy kept speculating where switching it off was 1.11x faster."""
        return self.none_ms / self.none_w if self.none_w >= MIN_NONE_STEPS else None

    def draft(self, drafted: bool) -> float:
        """Mean draft ms of steps that drafted (True) or not; 0 before any such step."""
        n = self.draft_n[drafted]
        return self.draft_ms[drafted] / n if n > 0 else 0.0

    @property
    def batch(self) -> float:
        return self.sb / self.w if self.w > 0 else 0.0


# ---------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class Prediction:
    tokens: float  # per round, bonus included
    step_ms: float

    @property
    def rate(self) -> float:
        """Tokens per ms per request."""
        return self.tokens / self.step_ms


@dataclass(frozen=True)
class Decision:
    """One bucket's re-plan: what ran, what was predicted, what was measured."""

    bucket: int
    old: Plan
    new: Plan
    old_predicted: Prediction
    new_predicted: Prediction
    measured: Prediction | None  # the old plan's own rounds and steps in this bucket since the last re-plan
    measured_steps: float
    replan_ms: float = 0.0
    old_gate: float = NO_GATE  # score gate: log confidence below which nodes are dropped
    new_gate: float = NO_GATE
    tau: float = 0.0  # the break-even acceptance it was set from
    runner_up: tuple[Plan, Prediction] | None = None  # the best plan not chosen (how close the call was)

    @property
    def changed(self) -> bool:
        return self.old.key != self.new.key

    @property
    def gate_changed(self) -> bool:
        return self.old_gate != self.new_gate

    def describe(self, drafter: str) -> str:
        meas = ("n/a" if self.measured is None else
                f"{self.measured.tokens:.2f} tokens/round at {self.measured.step_ms:.2f} ms/step "
                f"over {self.measured_steps:.0f} steps")
        o, n = self.old_predicted, self.new_predicted
        gate = (f"; score gate {_gate_text(self.old_gate)} -> {_gate_text(self.new_gate)} (break-even acceptance "
                f"{self.tau:.3f})" if self.gate_changed else "")
        alt = ""
        if self.runner_up is not None:
            plan, pred = self.runner_up
            alt = (f"; next best {plan}: {pred.tokens:.2f} tokens/round at {pred.step_ms:.2f} ms/step "
                   f"({pred.rate * 1e3:.1f} tok/s per request)")
        return (f"Tree shape plan ({drafter}, batch <= {self.bucket}): {self.old} -> {self.new}; predicted "
                f"{o.tokens:.2f} -> {n.tokens:.2f} tokens/round, {o.step_ms:.2f} -> {n.step_ms:.2f} ms/step "
                f"({o.rate * 1e3:.1f} -> {n.rate * 1e3:.1f} tok/s per request); measured {meas}{gate}{alt}")


def _gate_text(gate: float) -> str:
    return "off" if gate == NO_GATE else f"confidence >= {math.exp(gate):.3g}"


@dataclass
class _Measured:
    """The current plan's own record in one bucket since the last re-plan."""

    rounds: float = 0.0
    tokens: float = 0.0
    steps: float = 0.0
    step_ms: float = 0.0


class OnlinePolicy:
    """Plans per batch-size bucket from an acceptance profile and step costs (see the module docstring).

    Args:
        max_nodes: the engine's per-request budget (num_speculative_tokens).
        replan_every: steps between re-plans.
        explore_every: base period, in steps, of unpruned exploration steps.
        hysteresis: a new plan must be predicted this much faster than the current one (0.05 = 5 %).
        score_gate: also drop, request by request, the nodes whose calibrated acceptance is below the
            marginal row's break-even (deterministic and greedy trees with scores; see the module docstring).
        max_depth: deepest tree planned (default min(max_nodes, MAX_DEPTH)).
        sync: called at every re-plan with (plans, decisions, drifted, changes) on every tensor-parallel rank,
            returns rank 0's: all ranks must draft the same trees (their timings differ).
    """

    def __init__(self, max_nodes: int, *, replan_every: int = 256, explore_every: int = 16,
                 hysteresis: float = 0.05, max_depth: int | None = None, score_gate: bool = True,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[tuple], tuple] | None = None) -> None:
        if max_nodes < 1 or replan_every < 1 or explore_every < 2 or hysteresis < 0:
            raise ValueError(f"max_nodes = {max_nodes}, replan_every = {replan_every}, explore_every = "
                             f"{explore_every}, hysteresis = {hysteresis}: need >= 1, >= 1, >= 2, >= 0")
        self.max_nodes = max_nodes
        self.max_depth = max(1, min(max_nodes, max_depth or MAX_DEPTH))
        self.replan_every, self.explore_every, self.hysteresis = replan_every, explore_every, hysteresis
        self.clock, self.sync = clock, sync
        self.score_gate = score_gate
        self.profile = AcceptanceProfile(self.max_depth)
        self.calibration = ScoreCalibration()
        self.gates: dict[int, float] = {}  # bucket -> log confidence below which nodes are dropped
        self.none_probes: dict[int, float] = {}  # bucket -> draftless probe steps measured (decayed)
        self.costs: dict[int, BucketCosts] = {}
        self.plans: dict[int, Plan] = {}  # bucket -> plan (absent: the nearest planned bucket's, else FULL)
        self.clean_steps: dict[int, int] = {}  # bucket -> clean steps seen (never decayed)
        self.early: dict[int, int] = {}  # bucket -> early re-plans it triggered (EARLY_STEPS)
        self.measured: dict[int, _Measured] = {}
        self.explore_period = explore_every
        self.drifted = False  # a bucket's cost moved away from its fit in this re-plan
        self.steps = 0
        self.steps_since_replan = 0
        self.replans = 0
        self.rounds_seen = 0  # request-rounds observed, never decayed
        self.changes = 0
        self.last_replan_ms = 0.0
        self.max_replan_ms = 0.0

    # -- what to draft --------------------------------------------------------

    def plan_for(self, batch_size: int) -> Plan:
        return self._current(bucket_of(batch_size))

    def _current(self, bucket: int) -> Plan:
        """The bucket's plan; an unplanned bucket borrows the nearest planned one's (ties: the smaller
        bucket), since a neighbouring batch size is a better guess than the unpruned tree."""
        if bucket in self.plans:
            return self.plans[bucket]
        if not self.plans:
            return FULL
        near = min(self.plans, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b))
        return self.plans[near]

    def gate_for(self, batch_size: int) -> float:
        """The bucket's score gate (NO_GATE until it is planned with a calibrated drafter)."""
        return self.gates.get(bucket_of(batch_size), NO_GATE)

    def exploring(self) -> bool:
        """Whether the current step explores (deterministic: a step counter)."""
        return self.steps % self.explore_period == 0

    def none_probe_due(self, batch_size: int) -> bool:
        """Whether this step drafts nothing for any request, to measure what `none` costs in the bucket: halfway
        between exploration steps, while the bucket's plan speculates and it has measured fewer than NONE_PROBES
        such steps (a decayed count, so about two a re-plan period once settled). Decided from the step counter
        and clean steps, both read from committed tokens: every tensor-parallel rank probes the same steps."""
        b = bucket_of(batch_size)
        if self._current(b).kind == "none" or self.none_probes.get(b, 0.0) >= NONE_PROBES:
            return False
        return self.steps % self.explore_period == self.explore_period // 2

    def applied(self, plan: Plan, explore: bool) -> Plan:
        """What a step drafts: the plan, or on exploration steps the unpruned tree (which measures every
        rank), or, while the plan is `full`, a rank-0 chain of half the budget (the cost of fewer rows)."""
        if not explore:
            return plan
        return Plan.of(Tree.chain(max(1, self.max_nodes // 2))) if plan.kind == "full" else FULL

    # -- measurements ---------------------------------------------------------

    def observe_round(self, batch_size: int, tree: Tree, path: Sequence[int], applied: Plan,
                      explored: bool, struct=None, linear: tuple[int, int] | None = None) -> None:
        """A verified request-round drafted under `applied` (`full`, `linear` or a tree; on exploration steps the
        probe). `linear`: (tokens, nodes) the drafter's linear draft yielded in it, when the tree held that draft."""
        if applied.kind != "linear":  # a linear draft says nothing of the ranks it leaves out (probes do)
            self.profile.observe(tree, path, applied.fanout if applied.kind == "tree" else None, struct)
        if linear is not None:
            self.profile.linear.add(*linear)
        self.rounds_seen += 1
        if not explored:  # the plan's own record
            m = self.measured.setdefault(bucket_of(batch_size), _Measured())
            m.rounds += 1
            m.tokens += 1 + len(path)

    def observe_step(self, batch_size: int, rows: int, step_ms: float, draft_ms: float, drafted: bool,
                     explored: bool, draftless: bool = False, none_probe: bool = False) -> None:
        """A clean step: `rows` verified in `step_ms` (draft excluded), after `draft_ms` of drafting. draftless:
        it verified no draft node; none_probe: it was a `none_probe_due` step (explored is then True)."""
        b = bucket_of(batch_size)
        self.clean_steps[b] = self.clean_steps.get(b, 0) + 1
        self.costs.setdefault(b, BucketCosts()).observe(self.steps, batch_size, rows, step_ms, draft_ms, drafted,
                                                        draftless, none_probe)
        if none_probe:
            self.none_probes[b] = self.none_probes.get(b, 0.0) + 1
        if not explored:
            m = self.measured.setdefault(b, _Measured())
            m.steps += 1
            m.step_ms += step_ms + draft_ms

    def end_step(self) -> list[Decision]:
        """Advance the step counter; re-plan every `replan_every` steps. Returns the decisions made."""
        self.steps += 1
        self.steps_since_replan += 1
        if self.steps_since_replan < self.replan_every and not self._early_replan_due():
            return []
        t0 = self.clock()
        decisions = self.replan(backoff=self.steps_since_replan >= self.replan_every)
        self.last_replan_ms = (self.clock() - t0) * 1e3
        self.max_replan_ms = max(self.max_replan_ms, self.last_replan_ms)
        return [dataclasses.replace(d, replan_ms=self.last_replan_ms) for d in decisions]

    # -- planning -------------------------------------------------------------

    def _early_replan_due(self) -> bool:
        """A bucket reached its next EARLY_STEPS count of clean steps (8: its first plan; 32 and 128: that plan
        revised, it rested on few steps). Clean steps are read from committed tokens, the same on every
        tensor-parallel rank, so every rank re-plans at the same step."""
        if self.rounds_seen < MIN_ROUNDS:
            return False
        due = False
        for b in sorted(self.clean_steps):
            reached = sum(self.clean_steps[b] >= n for n in EARLY_STEPS)
            if reached > self.early.get(b, 0):  # thresholds passed during the warm-up count once
                self.early[b] = reached
                due = True
        return due

    def _pooled_slope(self) -> float | None:
        """ms per row over every bucket's consecutive steps (for buckets whose rows never varied)."""
        dxx = sum(self.costs[b].sdxx for b in sorted(self.costs))
        dxy = sum(self.costs[b].sdxy for b in sorted(self.costs))
        return dxy / (dxx + SLOPE_PRIOR) if dxx > 0 else None

    def predict(self, plan: Plan, bucket: int, yield_: tuple[float, float],
                pooled: float | None) -> Prediction | None:
        """Tokens per round and ms per step of `plan` in `bucket` (None: the bucket is not measured yet).

        yield_: the plan's (tokens per round, nodes drafted per request), from `_yield`.
        """
        c = self.costs.get(bucket)
        line = None if c is None or c.w < MIN_STEPS else c.line(pooled)
        tokens, nodes = yield_
        if line is None or math.isnan(tokens):
            return None
        if plan.kind == "none" and c.none_step() is not None:  # measured, not extrapolated
            return Prediction(tokens, max(1e-3, c.none_step() + c.draft(False)))
        rows = c.batch * (1 + nodes)  # [B] root rows, plus the nodes the drafter fills in
        return Prediction(tokens, max(1e-3, line[0] + line[1] * rows + c.draft(plan.kind != "none")))

    def _yield(self, plan: Plan, a: np.ndarray, f: np.ndarray) -> tuple[float, float]:
        if plan.kind == "none":
            return 1.0, 0.0
        if plan.kind in ("full", "linear"):
            return getattr(self.profile, plan.kind).mean()
        # E(S) with a; the expected drafted nodes are the same sum with f (a drafter fills a shape partly)
        return 1.0 + path_sum(plan.shape, a), path_sum(plan.shape, f)

    def replan(self, backoff: bool = True) -> list[Decision]:
        """Re-plan every measured bucket (deterministic given the measurements). backoff: a kept plan doubles
        the exploration period (not on the early, closer re-plans: they still need the probes)."""
        self.steps_since_replan = 0
        self.replans += 1
        decisions: list[Decision] = []
        if self.rounds_seen >= MIN_ROUNDS:  # warm-up only: later the decayed profile is all there is
            a, f = self.profile.acceptance(), self.profile.fill()
            pooled = self._pooled_slope()
            # step cost does not depend on depth here (the drafter always drafts at the engine's budget),
            # so the best tree of each size (deepest limit) is the whole search space
            trees = candidate_trees(a, self.max_nodes, self.max_depth, every_depth=False)
            cands = [Plan.of(t) for t, _ in trees] + [LINEAR, FULL, NONE]
            yields = {p.key: self._yield(p, a, f) for p in cands}
            for b in sorted(self.costs):
                d = self._replan_bucket(b, cands, yields, a, f, pooled)
                if d is not None:
                    decisions.append(d)
        if self.sync is not None:  # every rank re-plans at the same step (a step counter): take rank 0's result
            self.plans, self.gates, decisions, self.drifted, self.changes = self.sync(
                (self.plans, self.gates, decisions, self.drifted, self.changes))
        changed = any(d.changed for d in decisions) or self.drifted
        self.drifted = False
        self.measured = {}  # each window measures the plan it ran
        if changed:
            self.explore_period = self.explore_every
        elif backoff:
            self.explore_period = min(self.explore_period * 2, self.explore_every * EXPLORE_BACKOFF)
        # forget old measurements, but keep enough to plan on (a `none` plan learns from exploration only)
        if self.profile.rounds * DECAY >= MIN_ROUNDS:
            self.profile.decay(DECAY)
        if self.calibration.nodes * DECAY >= MIN_GATE_NODES:
            self.calibration.decay(DECAY)
        for c in self.costs.values():
            c.decay(DECAY if c.w * DECAY >= 4 * MIN_STEPS else 1.0, DECAY)
        self.none_probes = {b: n * DECAY for b, n in self.none_probes.items()}
        return decisions

    def _break_even(self, b: int, plan: Plan, pred: Prediction, pooled: float | None) -> float:
        """tau = slope * B * E / ms: the acceptance at which one more row neither raises nor lowers the batch's
        tokens per ms under `plan` (0 where the slope is unknown or the plan drafts nothing)."""
        line = self.costs[b].line(pooled)
        if plan.kind == "none" or line is None:
            return 0.0
        return line[1] * self.costs[b].batch * pred.tokens / pred.step_ms

    def _replan_bucket(self, b: int, cands: list[Plan], yields: dict, a, f, pooled) -> Decision | None:
        old = self._current(b)
        old_yield = yields.get(old.key) or self._yield(old, a, f)
        if old.kind in ("full", "linear") and math.isnan(old_yield[0]):  # too rarely measured: its expectation
            old_yield = getattr(self.profile, old.kind).mean(min_rounds=0)
        old_pred = self.predict(old, b, old_yield, pooled)
        if old_pred is None:
            return None
        m = self.measured.get(b)
        if m is not None and m.steps >= MIN_STEPS:  # the step cost moved away from its fit: forget faster
            ratio = (m.step_ms / m.steps) / old_pred.step_ms
            if not 1 / (1 + DRIFT) <= ratio <= 1 + DRIFT:
                self.costs[b].decay(DRIFT_FORGET, DRIFT_FORGET, force=True)
                self.drifted = True
                old_pred = self.predict(old, b, old_yield, pooled) or old_pred
        best, best_pred = old, old_pred
        preds = {old.key: (old, old_pred)}
        for plan in cands:  # candidates are ordered by size: ties keep the smaller tree
            pred = self.predict(plan, b, yields[plan.key], pooled)
            if pred is None:
                continue
            preds.setdefault(plan.key, (plan, pred))
            if pred.rate > best_pred.rate * (1 + 1e-9):
                best, best_pred = plan, pred
        if best.key != old.key and best_pred.rate <= old_pred.rate * (1 + self.hysteresis):
            best, best_pred = old, old_pred  # not enough faster to be worth a switch
        others = [pp for k, pp in preds.items() if k != best.key]
        runner_up = max(others, key=lambda pp: pp[1].rate) if others else None  # first of equals: the smaller
        measured = (Prediction(m.tokens / m.rounds if m.rounds else 1.0, m.step_ms / m.steps)
                    if m is not None and m.steps >= 1 else None)
        tau = self._break_even(b, best, best_pred, pooled)
        old_gate = self.gates.get(b, NO_GATE)
        new_gate = self.calibration.gate(tau) if self.score_gate and best.kind != "none" else NO_GATE
        d = Decision(b, old, best, old_pred, best_pred, measured, m.steps if m is not None else 0.0,
                     old_gate=old_gate, new_gate=new_gate, tau=tau, runner_up=runner_up)
        self.plans[b] = best  # planned from its own measurements now (it no longer borrows a neighbour's)
        self.gates[b] = new_gate
        if d.changed:
            self.changes += 1
        return d


# ---------------------------------------------------------------------------
# Driving a drafter


@dataclass
class _Pending:
    """A request's last proposal, to read its accepted path from the next context."""

    num_tokens: int
    tree: Tree
    applied: Plan  # what it was drafted under
    explored: bool  # on an exploration step
    asked: int  # the budget the drafter was given (0: nothing asked, nothing to learn)
    scores: torch.Tensor | None = None  # [N] the verified nodes' drafter scores (None: not calibrated)
    scores_are_probs: bool = False
    drafted: TreeProposal | None = None  # the drafter's proposal, where the verified tree holds its linear draft


def _linear_yield(drafted: TreeProposal, toks: list[int], children: list[list[int]],
                  new: list[int]) -> tuple[int, int]:
    """(tokens, nodes) the drafter's linear draft yields in a round whose verified tree (`toks`, `children` by row)
    holds it, or the part of it a score gate kept, and accepted the drafts `new`.

    The linear draft is a path of the tree: the accepted path follows it while their tokens agree, and leaves it
    exactly where the linear rule would have rejected (or where the gate ended it), so the common prefix is what
    the linear draft alone accepts under the same draws (exact for the greedy and deterministic rules; for
    sampled trees, whose rule at a node depends on all its children, an estimate)."""
    drafted_toks = drafted.tree.tokens.tolist()
    lin = [drafted_toks[i] for i in linear_nodes(drafted)]
    kept, row = 0, 0
    for t in lin:  # how much of it the verified tree holds (all of it, unless the gate cut its tail)
        row = next((c + 1 for c in children[row] if toks[c] == t), 0)
        if row == 0:
            break
        kept += 1
    agree = next((i for i, (a, b) in enumerate(zip(new, lin)) if a != b), min(len(new), len(lin)))
    return 1 + min(agree, kept), kept


def _read_back(i: int, stride: int, step: int) -> bool:
    """Whether request i of a step is one of the rounds learned from (every stride-th, rotating with the step)."""
    return (i + step) % stride == 0


class ShapePolicy:
    """Wraps a drafter's `propose`: applies the plan, reads the outcome back, times clean steps.

    `on_decisions(decisions)` is called after every re-plan (the engine logs and exports them).
    """

    def __init__(self, policy: OnlinePolicy, on_decisions: Callable[[list[Decision]], None] | None = None):
        self.policy = policy
        self.on_decisions = on_decisions
        self._pending: dict[Hashable, _Pending] = {}
        self._last_start: float | None = None
        self._last_draft_ms = 0.0
        self._last_rows = 0
        self._last_drafted = False
        self._last_explored = False
        self._last_draftless = False
        self._last_probe_none = False
        self._last_ids: set = set()

    def propose(self, drafter, requests: Sequence[DraftRequest], budgets: Sequence[int]) -> list[TreeProposal]:
        pol = self.policy
        start = pol.clock()
        ids = {r.req_id for r in requests}
        # Clean: no request arrived since the last step (each one here grew by 1..1 + nodes, checked below). A
        # request that finished was verified in the interval, which its rows count; under churn (a large batch
        # whose requests finish on different steps) requiring the very same batch would leave few clean steps.
        clean = bool(requests) and ids <= self._last_ids
        stride = -(-len(requests) // OBSERVE_PER_STEP)  # learn from at most OBSERVE_PER_STEP rounds a step
        for i, r in enumerate(requests):  # the previous step's outcome, from the committed tokens
            if not self._observe(r, len(requests), learn=_read_back(i, stride, pol.steps)):
                clean = False
        if clean and self._last_start is not None:
            step_ms = (start - self._last_start) * 1e3 - self._last_draft_ms
            pol.observe_step(len(requests), self._last_rows, step_ms, self._last_draft_ms, self._last_drafted,
                             self._last_explored, self._last_draftless, self._last_probe_none)
        decisions = pol.end_step() if requests else []
        if decisions and self.on_decisions is not None:
            self.on_decisions(decisions)
        explore = pol.exploring()
        # between explorations, a step without drafts now and then: `none` is priced from measured steps
        probe_none = bool(requests) and not explore and pol.none_probe_due(len(requests))
        plan = NONE if probe_none else pol.plan_for(len(requests))
        # An exploration step probes only the rounds the next step learns from (the same rotation, read after
        # end_step): the other requests draft the plan, so a probe costs at most OBSERVE_PER_STEP requests'
        # extra rows however large the batch.
        probed = [explore and _read_back(i, stride, pol.steps) for i in range(len(requests))]
        probe = pol.applied(plan, True) if explore else plan
        applied = [probe if e else plan for e in probed]
        asked = [0 if a.kind == "none" else b for a, b in zip(applied, budgets)]
        t0 = pol.clock()
        # a request that will verify the linear draft alone says so: the drafter may skip the rest (the suffix
        # drafter its second library call)
        requests = [dataclasses.replace(r, linear_only=True) if a.kind == "linear" else r
                    for r, a in zip(requests, applied)]
        drafted = drafter.propose(requests, asked) if requests else []
        out = [prune_to_shape(p, a) if a.kind == "tree" else prune_to_linear(p) if a.kind == "linear" else p
               for p, a in zip(drafted, applied)]
        gate = pol.gate_for(len(requests))  # a probe is never gated: it calibrates every confidence
        probs = bool(getattr(drafter, "scores_are_probs", False))
        gated = [pol.score_gate and p.scores is not None and p.mode in GATED_MODES for p in out]
        if gate != NO_GATE:
            out = [gate_by_confidence(p, confidence(p.scores, probs), gate) if g and not e else p
                   for p, g, e in zip(out, gated, probed)]
        self._last_draft_ms = (pol.clock() - t0) * 1e3
        self._last_start = start  # a step's interval runs from one propose call to the next
        self._last_ids = ids
        self._last_rows = sum(1 + p.num_nodes for p in out)
        self._last_drafted = any(asked)
        self._last_explored = explore or probe_none  # neither is the plan's own record
        self._last_draftless = all(p.num_nodes == 0 for p in out)
        self._last_probe_none = probe_none
        for r, p, d, n, g, a, e in zip(requests, out, drafted, asked, gated, applied, probed):
            # confidence is computed for the rounds read back only
            self._pending[r.req_id] = _Pending(len(r.token_ids), p.tree, a, e, n, p.scores if g else None, probs,
                                               d if a.kind in ("full", "linear") else None)
        return out

    def _observe(self, req: DraftRequest, batch_size: int, learn: bool = True) -> bool:
        """Record the accepted path of this request's previous tree (if `learn`); False if the step is not
        clean."""
        prev = self._pending.pop(req.req_id, None)
        if prev is None:
            return False
        grown = len(req.token_ids) - prev.num_tokens
        tree = prev.tree
        if not 1 <= grown <= 1 + tree.num_nodes:
            return False
        if prev.asked == 0 or not learn:
            return True
        new = [int(t) for t in req.token_ids[prev.num_tokens: prev.num_tokens + grown - 1]]  # accepted drafts
        struct = structure(tree.parents.tolist())
        toks, children = tree.tokens.tolist(), struct[3]
        path, row = [], 0
        for t in new:
            nxt = next((c for c in children[row] if toks[c] == t), None)
            if nxt is None:
                return False  # not this tree's path (the scheduler cut it, or the context was rewritten)
            path.append(nxt)
            row = nxt + 1
        linear = None if prev.drafted is None else _linear_yield(prev.drafted, toks, children, new)
        self.policy.observe_round(batch_size, tree, path, prev.applied, prev.explored, struct, linear)
        if prev.scores is not None:
            self.policy.calibration.observe(confidence(prev.scores, prev.scores_are_probs), path)
        return True

    def finish_request(self, req_id: Hashable) -> None:
        self._pending.pop(req_id, None)
