"""Planning: when a bucket re-plans, what each candidate plan is predicted to yield per ms, and which one runs.

At a re-plan Sequoia's DP on the measured a[d][r] (`planner.candidate_trees`) gives the best tree of
every size; each candidate, next to `full`, `linear` and `none`, is scored as expected tokens per
round (`path_sum` of a, or the measured yield) over the step ms its rows cost under the bucket's
fitted line (`cost_fit.py`) plus the drafting ms. A new plan replaces the current one only when it is
predicted `hysteresis` faster under the same measurements; the score gate's threshold is the chosen
plan's break-even acceptance tau. `OnlinePolicy` also keeps the clocks of exploration and of the
`none` probes. Given the measurements the result is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from vllm_tree_spec.online_policy.constants import (
    DECAY,
    DRIFT,
    DRIFT_FORGET,
    EARLY_STEPS,
    EXPLORE_BACKOFF,
    MAX_DEPTH,
    MIN_GATE_NODES,
    MIN_ROUNDS,
    MIN_STEPS,
    NO_GATE,
    NONE_PROBES,
    SLOPE_PRIOR,
)
from vllm_tree_spec.online_policy.cost_fit import BucketCosts
from vllm_tree_spec.online_policy.measurement import AcceptanceProfile, ScoreCalibration
from vllm_tree_spec.online_policy.pruning import FULL, LINEAR, NONE, Plan
from vllm_tree_spec.planner import candidate_trees
from vllm_tree_spec.tree import Tree


def bucket_of(batch_size: int) -> int:
    """The batch-size bucket a batch is planned in: the next power of two (1, 2, 4, ...)."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


def path_sum(shape: Tree, table: np.ndarray) -> float:
    """sum over nodes v of prod over u on root->v of table[depth(u) - 1, rank(u)] (0 beyond the table)."""
    reach = [1.0] * (shape.num_nodes + 1)  # by row, root = 1
    rows, cols = table.shape
    for i, (p, d, r) in enumerate(zip(shape.parents.tolist(), shape.depth.tolist(), shape.sibling_rank.tolist())):
        reach[i + 1] = reach[p + 1] * (float(table[d - 1, r]) if d <= rows and r < cols else 0.0)
    return math.fsum(reach[1:])


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
    """Plans per batch-size bucket from an acceptance profile and step costs (see the package docstring).

    Args:
        max_nodes: the engine's per-request budget (num_speculative_tokens).
        replan_every: steps between re-plans.
        explore_every: base period, in steps, of unpruned exploration steps.
        hysteresis: a new plan must be predicted this much faster than the current one (0.05 = 5 %).
        score_gate: also drop, request by request, the nodes whose calibrated acceptance is below the
            marginal row's break-even (deterministic and greedy trees with scores; see the package docstring).
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
