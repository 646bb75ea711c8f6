"""The online shape policy in the engine (`"budgets": "auto"`): logging and `/metrics` around online_policy.py.

`TreeProposer` wraps its drafter in a `ShapePolicy` (online_policy.py: what is measured, how it re-plans,
how a plan is applied and explored); this module adds what users see:

    log      one INFO line per change of plan or of its score gate: bucket, old -> new, predicted
             tokens/round, ms/step and tok/s of both, and what the old plan measured since it was chosen
    metrics  `vllm_tree_spec:plan_nodes|plan_depth|plan_width|plan_full|plan_score_gate{drafter, batch_size}`
             and `vllm_tree_spec:plan_changes_total{drafter}` (metrics.PlanGauges)

and, under tensor parallelism, makes every rank hold rank 0's plan: each rank drafts its own trees and
the scheduler's drafts (rank 0's) must match them, while each rank's own step timings differ; the
re-plan happens at the same step everywhere (a step counter) and its result is broadcast with the TP
group's `broadcast_object`, once per re-plan. Touches no vLLM internals (its logger and that public
collective only).
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_tree_spec.config import TreeSpecConfig
from vllm_tree_spec.online_policy import NO_GATE, Decision, OnlinePolicy, Plan, ShapePolicy
from vllm_tree_spec.tree import TreeShape

logger = init_logger(__name__)


def make_shape_policy(cfg: TreeSpecConfig, max_num_seqs: int | None = None) -> ShapePolicy | None:
    """The engine's policy for `"budgets": "auto"` (None for a static budgets table)."""
    if cfg.budgets != "auto":
        return None
    policy = OnlinePolicy(cfg.max_nodes, replan_every=cfg.replan_every, explore_every=cfg.explore_every,
                          score_gate=cfg.score_gate, sync=_from_first_rank)
    gauges = _Gauges(cfg, max_num_seqs or 1)

    def on_decisions(decisions: list[Decision]) -> None:
        for d in decisions:
            if d.gate_changed:
                gauges.metrics.gate(d.bucket, d.tau if d.new_gate != NO_GATE else 0.0)
            if d.changed or d.gate_changed:
                if _rank() == 0:  # every rank holds rank 0's plan; one log line
                    logger.info("%s (re-plan %.2f ms)", d.describe(cfg.drafter), d.replan_ms)
                if d.changed:
                    gauges.plan(d.bucket, d.new)
                    gauges.metrics.changed()
            else:
                logger.debug("%s (kept; re-plan %.2f ms)", d.describe(cfg.drafter), d.replan_ms)

    return ShapePolicy(policy, on_decisions)


def _tp_group():
    try:
        from vllm.distributed import get_tp_group

        return get_tp_group()
    except Exception:  # no distributed state (unit tests, tools)
        return None


def _rank() -> int:
    group = _tp_group()
    return 0 if group is None else group.rank_in_group


def _from_first_rank(state: tuple) -> tuple:
    """Tensor-parallel ranks draft every tree themselves and the scheduler checks them against rank 0's drafts,
    so all must hold rank 0's plan; their own step timings differ. One small broadcast per re-plan."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return state
    return group.broadcast_object(state, src=0)


class _Gauges:
    def __init__(self, cfg: TreeSpecConfig, max_num_seqs: int):
        from vllm_tree_spec.integration.metrics import PlanGauges

        self.metrics = PlanGauges(cfg.drafter)
        lay = cfg.layout()  # `full` shows the caps of the drafter's own tree
        if cfg.drafter in ("suffix", "ngram"):  # model-free: only the node budget is fixed
            self.full_caps = (cfg.max_nodes, cfg.max_nodes, cfg.max_nodes)
        elif isinstance(lay, TreeShape):
            self.full_caps = (lay.num_nodes, lay.steps, lay.num_nodes)
        else:
            self.full_caps = (lay.num_nodes, lay.max_depth, Plan.of(lay).width)
        b = 1
        while True:  # every bucket starts on `full`, ungated
            self.plan(b, Plan("full"))
            self.metrics.gate(b, 0.0)
            if b >= max_num_seqs:
                break
            b *= 2

    def plan(self, bucket: int, plan: Plan) -> None:
        if plan.kind == "full":
            self.metrics.set(bucket, *self.full_caps, full=True)
        elif plan.kind == "linear":  # the drafter's linear draft: a chain of at most the node budget
            self.metrics.set(bucket, self.full_caps[0], self.full_caps[0], 1, full=False)
        else:
            self.metrics.set(bucket, plan.num_nodes, plan.depth, plan.width, full=False)
