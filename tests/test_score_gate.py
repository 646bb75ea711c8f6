"""The shape policy's score gate (online_policy/): per-node pruning by calibrated drafter confidence.

A plan prunes every request's tree to the same child ranks; the gate drops, request by request, the
nodes whose drafter score says they will rarely be accepted, when a verified row costs more than such a
node brings. The synthetic engine here gives half the requests a confident chain that is often accepted
and half a doubtful chain that rarely is (the drafter's scores are the true acceptance probabilities), so
no rank-based plan can tell them apart and the right answer is known: drop the doubtful chains where rows
are dear, keep everything where rows are nearly free, never touch sampled trees.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from vllm_tree_spec.drafters.base import DraftRequest, TreeDrafter, TreeProposal
from vllm_tree_spec.online_policy import (
    GATE_EDGES,
    MIN_GATE_NODES,
    NO_GATE,
    OnlinePolicy,
    ScoreCalibration,
    ShapePolicy,
    confidence,
    gate_by_confidence,
)
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode

BONUS = 7
DEPTH = 6
GOOD, BAD = (0.8, 0.8), (0.05, 0.6)  # (P(depth-1 node accepted), P(next accepted | this one)) per chain kind


def path_probs(kind: tuple[float, float]) -> list[float]:
    first, cond = kind
    return [first * cond ** d for d in range(DEPTH)]


class ScoredChains(TreeDrafter):
    """A 6-node chain per request; even requests confident, odd ones doubtful. Scores = true P(accepted)."""

    scores_are_probs = True

    def __init__(self, mode: Mode = Mode.DETERMINISTIC, vocab: int = 2048):
        super().__init__()
        self.mode, self.vocab = mode, vocab

    @staticmethod
    def kind(req_id: str) -> tuple[float, float]:
        return GOOD if int(req_id[1:]) % 2 == 0 else BAD

    def _propose(self, requests, budgets):
        out = []
        for r, b in zip(requests, budgets):
            n = min(b, DEPTH)
            if n == 0:
                out.append(TreeProposal.empty(self.mode))
                continue
            tree = Tree.chain(n, [1000 + i for i in range(n)])
            scores = torch.tensor(path_probs(self.kind(r.req_id))[:n], dtype=torch.float64)
            q = None
            if self.mode == Mode.SAMPLED:
                q = torch.zeros(n + 1, self.vocab)
                q[torch.arange(n), 1000 + torch.arange(n)] = 1.0  # row r drew node r's token
            out.append(TreeProposal(tree, self.mode, q, scores))
        return out


class Engine:
    """Drives ShapePolicy like the runner: propose, accept along the chain with the true law, commit."""

    def __init__(self, policy: OnlinePolicy, row_ms: float, fixed_ms: float = 20.0, batch: int = 4, seed: int = 0):
        self.now = 0.0
        policy.clock = lambda: self.now
        self.policy, self.drafter = policy, ScoredChains()
        self.shape_policy = ShapePolicy(policy)
        self.row_ms, self.fixed_ms = row_ms, fixed_ms
        self.rng = random.Random(seed)
        self.contexts = {f"r{i}": [1, 2, 3] for i in range(batch)}
        for rid, ctx in self.contexts.items():
            self.drafter.start_request(rid, ctx)
        self.tokens, self.ms, self.rows = 0, 0.0, 0
        self.last: dict[str, TreeProposal] = {}

    def step(self) -> None:
        reqs = [DraftRequest(rid, list(ctx), 1.0) for rid, ctx in self.contexts.items()]
        out = self.shape_policy.propose(self.drafter, reqs, [DEPTH] * len(reqs))
        rows = 0
        for r, p in zip(reqs, out):
            first, cond = ScoredChains.kind(r.req_id)
            path = []
            for i in range(p.num_nodes):  # a chain: node i is accepted w.p. first (i = 0) or cond
                if self.rng.random() >= (first if i == 0 else cond):
                    break
                path.append(i)
            self.contexts[r.req_id] += [int(p.tree.tokens[n]) for n in path] + [BONUS]
            rows += 1 + p.num_nodes
            self.tokens += 1 + len(path)
            self.last[r.req_id] = p
        ms = self.fixed_ms + self.row_ms * rows
        self.now += ms / 1e3
        self.ms += ms
        self.rows += rows

    def run(self, steps: int) -> "Engine":
        for _ in range(steps):
            self.step()
        return self

    def measure(self, steps: int) -> tuple[float, float]:
        """(tokens per ms, rows per step) over the next `steps` steps."""
        t, ms, rows = self.tokens, self.ms, self.rows
        self.run(steps)
        return (self.tokens - t) / (self.ms - ms), (self.rows - rows) / steps


def test_dear_rows_drop_the_doubtful_chains():
    """Rows cost 1 ms each against a 20 ms step: the doubtful chains (P(accepted) <= 0.05) cost more than
    they bring and are dropped; the confident chains keep their nodes above the break-even."""
    gated = Engine(OnlinePolicy(DEPTH, replan_every=64, explore_every=8), row_ms=1.0).run(640)
    pol = gated.policy
    gate = pol.gate_for(4)
    assert gate != NO_GATE, pol.gates
    assert math.log(BAD[0]) < gate <= math.log(GOOD[0]), (gate, pol.gates)
    # the next non-exploring step: doubtful requests draft nothing, confident ones keep >= 2 nodes
    while pol.exploring():
        gated.step()
    gated.step()
    assert [gated.last[f"r{i}"].num_nodes for i in (1, 3)] == [0, 0]
    assert all(gated.last[f"r{i}"].num_nodes >= 2 for i in (0, 2)), {k: p.num_nodes for k, p in gated.last.items()}
    # negative control: the same engine without the gate verifies the doubtful rows and is slower
    ungated = Engine(OnlinePolicy(DEPTH, replan_every=64, explore_every=8, score_gate=False), row_ms=1.0).run(640)
    assert ungated.policy.gates == {4: NO_GATE}
    rate_g, rows_g = gated.measure(512)
    rate_u, rows_u = ungated.measure(512)
    assert rate_g > 1.10 * rate_u, (rate_g, rate_u)  # 1.17x if exploration were free (chain:3 plan)
    assert rows_g < 0.8 * rows_u, (rows_g, rows_u)


def test_nearly_free_rows_keep_every_node():
    """Rows cost 0.002 ms against a 20 ms step: the break-even is ~1e-3, below every node's acceptance."""
    eng = Engine(OnlinePolicy(DEPTH, replan_every=64, explore_every=8), row_ms=0.002).run(640)
    decisions_tau = eng.policy._break_even(4, eng.policy.plan_for(4), *_pred(eng.policy))
    assert 0 < decisions_tau < min(path_probs(BAD)), decisions_tau
    _, rows = eng.measure(256)
    assert rows >= 0.95 * 4 * (1 + DEPTH), rows  # the full chains, exploration's half chains aside


def _pred(pol: OnlinePolicy):
    """The bucket's current prediction (for _break_even) and the pooled slope."""
    pooled = pol._pooled_slope()
    plan = pol.plan_for(4)
    return pol.predict(plan, 4, pol._yield(plan, pol.profile.acceptance(), pol.profile.fill()), pooled), pooled


def test_sampled_trees_are_never_gated():
    """A drawn child set filtered by its own values is no longer a draw from q: the gate only touches
    deterministic and greedy trees, and sampled proposals pass through whole."""
    pol = OnlinePolicy(DEPTH, explore_every=1 << 30)
    pol.steps = 1  # not an exploration step
    pol.gates = {4: 0.0}  # keep only confidence >= 1: would drop every node of a gated tree
    sp = ShapePolicy(pol)
    reqs = [DraftRequest(f"r{i}", [1, 2, 3], 1.0) for i in range(4)]
    for mode, expect in ((Mode.SAMPLED, DEPTH), (Mode.DETERMINISTIC, 0)):
        drafter = ScoredChains(mode)
        for r in reqs:
            drafter.start_request(r.req_id, r.token_ids)
        out = sp.propose(drafter, reqs, [DEPTH] * 4)
        assert [p.num_nodes for p in out] == [expect] * 4, (mode, [p.num_nodes for p in out])


def test_gate_keeps_an_ancestor_closed_subset_with_its_q_rows():
    tree = Tree(torch.tensor([-1, -1, 0, 0, 1, 2]), torch.tensor([10, 11, 12, 13, 14, 15]))
    q = torch.softmax(torch.randn(7, 20), -1)
    scores = torch.tensor([0.9, 0.05, 0.5, 0.01, 0.9, 0.4], dtype=torch.float64)  # node 4 sure, under doubtful 1
    prop = TreeProposal(tree, Mode.DETERMINISTIC, q, scores)
    out = gate_by_confidence(prop, confidence(scores, True), math.log(0.3))
    assert out.tree.parents.tolist() == [-1, 0, 1] and out.tree.tokens.tolist() == [10, 12, 15]
    assert torch.equal(out.draft_probs, q[[0, 1, 3, 6]]) and out.scores.tolist() == [0.9, 0.5, 0.4]
    out.validate()
    assert gate_by_confidence(prop, confidence(scores, True), math.log(0.001)) is prop  # nothing to cut
    empty = gate_by_confidence(prop, confidence(scores, True), 0.0)
    assert empty.num_nodes == 0
    empty.validate()
    logq = torch.log(scores)  # model drafters give log q: the same gate
    assert gate_by_confidence(prop, confidence(logq, False), math.log(0.3)).tree.tokens.tolist() == [10, 12, 15]


def test_calibration_is_monotone_and_sets_the_lowest_paying_bin():
    cal = ScoreCalibration()
    assert cal.gate(0.2) == NO_GATE  # nothing calibrated yet
    rng = np.random.default_rng(0)
    for _ in range(200):
        conf = np.log(np.array([0.9, 0.5, 0.1, 0.01]))
        acc = rng.random(4) < np.array([0.8, 0.45, 0.3, 0.35])  # the 0.01 bin measures above the 0.1 bin
        cal.observe(conf, [i for i in range(4) if acc[i]])
    assert cal.nodes == 800 >= MIN_GATE_NODES
    seen, pi = cal.acceptance()
    assert list(seen) == sorted(cal.bins(np.log(np.array([0.01, 0.1, 0.5, 0.9]))))
    assert np.all(np.diff(pi) >= 0) and abs(pi[0] - pi[1]) < 1e-12  # pooled by isotonic regression
    assert cal.gate(0.4) == GATE_EDGES[cal.bins(np.log(np.array([0.5])))[0]]  # keeps 0.5 and 0.9
    assert cal.gate(0.1) == NO_GATE  # every bin pays
    assert cal.gate(0.0) == NO_GATE
    assert cal.gate(0.99) == GATE_EDGES[seen[-1]]  # none pays: the most confident bin stays
    cal.decay(0.5)
    assert cal.nodes == 400
