"""What the policy learns from verified rounds: the acceptance profile, the plans' yields, the confidence calibration.

`AcceptanceProfile` counts, by (depth, sibling rank), the child slots the step asked the drafter for,
those it drafted and those accepted: a[d][r] = P(the rank-r child of a reached depth d - 1 node is
drafted and accepted) and f[d][r] = P(it is drafted), decayed at every re-plan so the plan follows
the workload. `Yield` records what `full` and `linear` rounds yielded as a whole. `ScoreCalibration`
maps a drafter's log confidence in a node to the rate at which such nodes are accepted, pi(c), with
the upper bound the score gate cuts on.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from vllm_tree_spec.online_policy.constants import (
    _EDGES,
    GATE_EDGES,
    GATE_QUANTILE,
    MAX_RANK,
    MIN_BIN_NODES,
    MIN_FULL_ROUNDS,
    MIN_GATE_NODES,
    NO_GATE,
    PROFILE_PRIOR,
)
from vllm_tree_spec.online_policy.pruning import structure
from vllm_tree_spec.tree import Tree


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
