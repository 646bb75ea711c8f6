"""The online shape policy's tuning constants (what each one trades is in its comment)."""

from __future__ import annotations

import math

import numpy as np

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
