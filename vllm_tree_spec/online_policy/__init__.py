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

The package, one concern per module (every name below is importable from
`vllm_tree_spec.online_policy`):

    constants.py     the policy's tuning constants, in one table
    pruning.py       `Plan` (`full`, `linear`, a tree shape, `none`) and how a plan is applied to a
                     proposal: `prune_to_shape`, `prune_to_linear`, the score gate's `gate_by_confidence`
    measurement.py   what a verified round teaches: the acceptance profile a[d][r] / f[d][r], the
                     yields of `full` and `linear`, the confidence calibration pi(c)
    cost_fit.py      `BucketCosts`: step ms against rows verified per batch-size bucket, the drafting
                     ms, and the measured cost of draftless steps
    planning.py      `OnlinePolicy`: when to re-plan, each candidate's predicted tokens per ms, the
                     hysteresis, the break-even tau of the score gate, exploration and `none` probes
    driver.py        `ShapePolicy`: wraps a drafter's `propose`, applies the plan, reads each round's
                     accepted path back from the committed tokens, times clean steps
"""

from vllm_tree_spec.online_policy.constants import (
    DECAY,
    DRIFT,
    DRIFT_FORGET,
    EARLY_STEPS,
    EXPLORE_BACKOFF,
    GATE_EDGES,
    GATE_QUANTILE,
    GATED_MODES,
    MAX_DEPTH,
    MAX_RANK,
    MIN_BIN_NODES,
    MIN_FULL_ROUNDS,
    MIN_GATE_NODES,
    MIN_NONE_STEPS,
    MIN_PAIRS,
    MIN_ROUNDS,
    MIN_STEPS,
    NO_GATE,
    NONE_PROBES,
    OBSERVE_PER_STEP,
    OUTLIER,
    PROFILE_PRIOR,
    SLOPE_PRIOR,
)
from vllm_tree_spec.online_policy.cost_fit import BucketCosts
from vllm_tree_spec.online_policy.driver import ShapePolicy
from vllm_tree_spec.online_policy.measurement import AcceptanceProfile, ScoreCalibration, Yield
from vllm_tree_spec.online_policy.planning import Decision, OnlinePolicy, Prediction, bucket_of, path_sum
from vllm_tree_spec.online_policy.pruning import (
    FULL,
    LINEAR,
    NONE,
    Plan,
    confidence,
    gate_by_confidence,
    linear_nodes,
    prune_to_linear,
    prune_to_shape,
    structure,
)

__all__ = [
    "AcceptanceProfile",
    "BucketCosts",
    "DECAY",
    "DRIFT",
    "DRIFT_FORGET",
    "Decision",
    "EARLY_STEPS",
    "EXPLORE_BACKOFF",
    "FULL",
    "GATED_MODES",
    "GATE_EDGES",
    "GATE_QUANTILE",
    "LINEAR",
    "MAX_DEPTH",
    "MAX_RANK",
    "MIN_BIN_NODES",
    "MIN_FULL_ROUNDS",
    "MIN_GATE_NODES",
    "MIN_NONE_STEPS",
    "MIN_PAIRS",
    "MIN_ROUNDS",
    "MIN_STEPS",
    "NONE",
    "NONE_PROBES",
    "NO_GATE",
    "OBSERVE_PER_STEP",
    "OUTLIER",
    "OnlinePolicy",
    "PROFILE_PRIOR",
    "Plan",
    "Prediction",
    "SLOPE_PRIOR",
    "ScoreCalibration",
    "ShapePolicy",
    "Yield",
    "bucket_of",
    "confidence",
    "gate_by_confidence",
    "linear_nodes",
    "path_sum",
    "prune_to_linear",
    "prune_to_shape",
    "structure",
]
