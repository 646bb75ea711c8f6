"""Driving a drafter: `ShapePolicy` wraps its `propose`, applies the plan and reads each round back.

Observations are read from the committed tokens themselves: the next call's context extends the
previous one by the accepted path plus one bonus token, and the path is found by matching those
tokens against the tree that was verified (at most OBSERVE_PER_STEP requests a step, rotating). Only
clean steps (no request arrived since the step before, each grown by 1..1 + nodes tokens) time the
step; a request whose growth does not match its tree (preempted, truncated) is skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from vllm_tree_spec.drafters.base import DraftRequest, TreeProposal
from vllm_tree_spec.online_policy.constants import GATED_MODES, NO_GATE, OBSERVE_PER_STEP
from vllm_tree_spec.online_policy.planning import Decision, OnlinePolicy
from vllm_tree_spec.online_policy.pruning import (
    NONE,
    Plan,
    confidence,
    gate_by_confidence,
    linear_nodes,
    prune_to_linear,
    prune_to_shape,
    structure,
)
from vllm_tree_spec.tree import Tree


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
