"""The online shape policy (online_policy/) on synthetic drafters, targets and step costs.

A synthetic engine drives `ShapePolicy` exactly as the tree runner does: one propose call per step,
the committed context grown by the accepted path plus a bonus token, and a fake clock that advances
by a known step cost. The drafter's full tree and the true acceptance a[d][r] are chosen per test, so
the right plan is known: a flat drafter -> a chain, rank-2 mass -> a branching tree, a costly verify
-> no speculation; re-planning is deterministic, hysteresis stops flapping, exploration brings a
chain back to a tree when the drafter changes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from vllm_tree_spec.drafters.base import DraftRequest, TreeDrafter, TreeProposal
from vllm_tree_spec.online_policy import (
    FULL,
    LINEAR,
    NONE,
    OBSERVE_PER_STEP,
    AcceptanceProfile,
    BucketCosts,
    OnlinePolicy,
    Plan,
    ShapePolicy,
    bucket_of,
    linear_nodes,
    prune_to_linear,
    prune_to_shape,
    structure,
)
from vllm_tree_spec.online_policy.driver import _linear_yield
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode

BONUS = 7  # never a draft token (drafts use ids >= 1000)


def wide_shape(depth: int, width: int) -> Tree:
    """Every node has `width` children down to `depth` levels (listed by depth, then rank)."""
    paths, level = [], [()]
    for _ in range(depth):
        level = [p + (r,) for p in level for r in range(width)]
        paths += level
    return Tree.from_paths(paths)


class ShapeDrafter(TreeDrafter):
    """Proposes a fixed shape (a topological prefix at smaller budgets); token = 1000 + node index."""

    def __init__(self, shape: Tree):
        super().__init__()
        self.shape = shape
        self.calls: list[list[int]] = []

    def _propose(self, requests, budgets):
        self.calls.append(list(budgets))
        out = []
        for b in budgets:
            sub = self.shape.subtree(min(b, self.shape.num_nodes))
            out.append(TreeProposal(Tree(sub.parents, 1000 + torch.arange(sub.num_nodes)), Mode.DETERMINISTIC))
        return out


class Engine:
    """Drives a ShapePolicy like the runner: propose, verify with a synthetic a[d][r], commit, repeat."""

    def __init__(self, policy: OnlinePolicy, drafter: ShapeDrafter, acceptance, cost, batch: int = 4,
                 budget: int = 8, seed: int = 0, noise: float = 0.0):
        self.now = 0.0
        policy.clock = lambda: self.now
        self.policy, self.drafter = policy, drafter
        self.shape_policy = ShapePolicy(policy, self.on_decisions)
        self.acceptance, self.cost, self.budget, self.noise = acceptance, cost, budget, noise
        self.rng = random.Random(seed)
        self.contexts = {f"r{i}": [1, 2, 3] for i in range(batch)}
        for rid, ctx in self.contexts.items():
            drafter.start_request(rid, ctx)
        self.history: list[tuple[int, str]] = []  # (step, plan) after every change
        self.tokens = 0
        self.steps = 0

    def on_decisions(self, decisions):
        for d in decisions:
            if d.changed:
                self.history.append((self.steps, str(d.new)))

    def accept(self, tree: Tree) -> list[int]:
        """The accepted path: at each reached node draw the accepted rank from a[d] (None: stop)."""
        path, row, d = [], 0, 0
        while True:
            a = self.acceptance(d) if callable(self.acceptance) else self.acceptance
            u, r, acc = self.rng.random(), None, 0.0
            for rank, p in enumerate(a):
                acc += p
                if u < acc:
                    r = rank
                    break
            kids = tree.children[row]
            if r is None or r >= len(kids):
                return path
            path.append(kids[r])
            row, d = kids[r] + 1, d + 1

    def step(self) -> None:
        reqs = [DraftRequest(rid, list(ctx), 0.0) for rid, ctx in self.contexts.items()]
        t0 = self.now
        out = self.shape_policy.propose(self.drafter, reqs, [self.budget] * len(reqs))
        self.now = t0 + 0.0002  # drafting
        rows = 0
        for r, p in zip(reqs, out):
            path = self.accept(p.tree)
            self.contexts[r.req_id] += [int(p.tree.tokens[n]) for n in path] + [BONUS]
            rows += 1 + p.num_nodes
            self.tokens += 1 + len(path)
        ms = self.cost(len(reqs), rows) * (1 + self.noise * (2 * self.rng.random() - 1))
        self.now += ms / 1e3
        self.steps += 1

    def run(self, steps: int) -> "Engine":
        for _ in range(steps):
            self.step()
        return self


def plan_of(engine: Engine) -> Plan:
    return engine.policy.plan_for(len(engine.contexts))


def line(fixed_ms: float, row_ms: float):
    return lambda batch, rows: fixed_ms + row_ms * rows


def test_flat_drafter_settles_on_a_chain():
    """Only rank-0 children are ever accepted: the siblings are dead rows, a chain verifies fewer."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(4, 2)), [0.8], line(5.0, 0.4)).run(640)
    plan = plan_of(eng)
    assert plan.kind == "tree" and plan.shape.is_chain(), (plan, eng.history)
    # the drafter's full tree holds a depth-4 rank-0 chain; deeper chain nodes are never offered
    assert 2 <= plan.num_nodes <= 8, plan
    assert eng.history and eng.history[0][1] != "full"


def test_rank_two_mass_keeps_a_branching_tree():
    """Siblings carry acceptance and extra rows are cheap: the plan branches."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 3)), [0.4, 0.3, 0.2], line(10.0, 0.01)).run(640)
    plan = plan_of(eng)
    assert plan.kind == "full" or (plan.kind == "tree" and plan.shape.max_children >= 2), (plan, eng.history)
    if plan.kind == "tree":
        assert plan.shape.max_children >= 2


def test_costly_verify_switches_speculation_off():
    """Every verified row costs as much as the fixed step: no tree is worth its rows."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 2)), [0.3, 0.1], line(1.0, 5.0)).run(640)
    assert plan_of(eng) == NONE, eng.history
    # switched off: the drafter is asked for nothing except on exploration steps
    tail = eng.drafter.calls[-64:]
    asked = [c for c in tail if any(c)]
    assert 0 < len(asked) <= 64 // pol.explore_every + 1, (len(asked), pol.explore_period)


def test_a_probe_is_drafted_only_for_the_rounds_read_back():
    """At 32 requests the policy learns from 8 rounds a step (every 4th request, rotating): an exploration step
    drafts the unpruned tree for exactly the requests whose rounds the next step reads back, the plan ('none'
    here) for the others, and those probes are what the next step learns from."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 2)), [0.3, 0.1], line(1.0, 5.0), batch=32).run(640)
    assert plan_of(eng) == NONE, eng.history
    probes = [c for c in eng.drafter.calls[-128:] if any(c)]
    assert probes, "no exploration step in 128 steps"
    for budgets in probes:
        asked = [i for i, b in enumerate(budgets) if b]
        assert len(asked) == OBSERVE_PER_STEP, budgets
        assert len({i % 4 for i in asked}) == 1  # one residue of the rotation
    while not pol.exploring():  # until the last step explored (the counter is read after a step's end_step)
        eng.step()
    before = pol.rounds_seen
    eng.step()  # reads the probes back
    assert pol.rounds_seen - before == OBSERVE_PER_STEP


def test_a_finished_request_leaves_the_step_clean_and_an_arrival_does_not():
    """A step interval is timed unless a request arrived (its prefill shares the forward): a request that
    finished was verified in the interval, and its rows are counted."""
    pol = OnlinePolicy(8, replan_every=10_000, explore_every=1 << 20)
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 2)), [0.5, 0.2], line(1.0, 0.1), batch=4).run(4)
    w = pol.costs[4].w
    assert w == 3  # the first call has no interval before it
    rid = next(iter(eng.contexts))
    del eng.contexts[rid]
    eng.shape_policy.finish_request(rid)
    eng.step()
    assert pol.costs[4].w == w + 1
    eng.contexts["new"] = [1, 2, 3]
    eng.drafter.start_request("new", [1, 2, 3])
    eng.step()
    assert pol.costs[4].w == w + 1


def test_no_speculation_returns_when_verify_gets_cheap():
    """From 'none', exploration steps keep measuring acceptance and cost; cheap rows bring trees back."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    costly = {"on": True}
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 2)), [0.6, 0.2],
                 lambda b, rows: 1.0 + (5.0 if costly["on"] else 0.01) * rows).run(512)
    assert plan_of(eng) == NONE, eng.history
    costly["on"] = False
    eng.run(1536)
    assert plan_of(eng) != NONE, eng.history


def test_chain_returns_to_a_tree_when_siblings_start_paying():
    """Exploration: a chain plan still measures sibling ranks, so it can come back to a tree."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    phase = {"flat": True}
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 3)),
                 lambda d: [0.8] if phase["flat"] else [0.35, 0.3, 0.25], line(5.0, 0.3)).run(768)
    first = plan_of(eng)
    assert first.kind == "tree" and first.shape.is_chain(), eng.history
    phase["flat"] = False
    eng.run(1536)
    later = plan_of(eng)
    assert later.kind == "full" or later.shape.max_children >= 2, eng.history


def test_replanning_is_deterministic():
    """Same measurements -> same plans, at the same steps."""
    def run():
        pol = OnlinePolicy(8, replan_every=32, explore_every=8)
        return Engine(pol, ShapeDrafter(wide_shape(3, 3)), [0.45, 0.25, 0.1], line(6.0, 0.2),
                      seed=3, noise=0.05).run(512).history

    first = run()
    assert first and first == run()


def test_hysteresis_stops_flapping():
    """Two near-equal plans under noisy costs: hysteresis keeps the plan; without it, it flaps."""
    def changes(hysteresis):
        pol = OnlinePolicy(6, replan_every=32, explore_every=8, hysteresis=hysteresis)
        eng = Engine(pol, ShapeDrafter(wide_shape(6, 1)), [0.5], line(4.0, 0.2), budget=6, seed=1, noise=0.2)
        eng.run(1600)
        return pol.changes, eng.history

    calm, history = changes(0.05)
    assert calm <= 2, history
    jumpy, jumpy_history = changes(0.0)
    assert jumpy > calm, (jumpy_history, history)


def test_replan_is_cheap_and_measured():
    """A re-plan at a 16-node budget takes milliseconds (docs/planner.md gives the measured numbers)."""
    import time

    eng = Engine(OnlinePolicy(16, replan_every=64, explore_every=8), ShapeDrafter(wide_shape(4, 3)),
                 [0.4, 0.3, 0.1], line(5.0, 0.1), budget=16).run(256)
    pol = eng.policy
    assert pol.replans >= 3 and pol.profile.rounds >= 64
    pol.clock = time.perf_counter  # real time for the re-plan itself
    pol.steps_since_replan = pol.replan_every - 1
    pol.end_step()
    assert 0 < pol.last_replan_ms < 250, pol.last_replan_ms  # loose: a shared 2-core CI machine


def test_profile_counts_asked_ranks_only():
    """a[d][r] is counted over the slots the plan asked for: a chain plan learns nothing about rank 1."""
    prof = AcceptanceProfile(4)
    chain = Tree.chain(3, [11, 12, 13])
    prof.observe(chain, [0, 1], {(): 1, (0,): 1, (0, 0): 1})
    assert prof.reached[:3, 0].tolist() == [1, 1, 1] and prof.reached[:, 1].sum() == 0
    assert prof.accepted[:3, 0].tolist() == [1, 1, 0]
    wide = Tree(torch.tensor([-1, -1, 0]), torch.tensor([5, 6, 7]))
    prof.observe(wide, [1], None)  # unpruned: every rank up to MAX_RANK was asked
    assert prof.accepted[0, 1] == 1 and prof.reached[0, 7] == 1 and prof.reached[1, 0] == 2
    assert prof.drafted[0, :2].tolist() == [2, 1] and prof.full.rounds == 1 and prof.full.tokens == 2


def test_profile_histograms_equal_per_rank_counting():
    """The profile's prefix-length histograms give exactly the per-rank counts the docstring defines, counted
    here directly into [D, R] arrays (random trees, accepted paths, pruned and unpruned plans, a decay)."""
    import numpy as np

    from vllm_tree_spec.online_policy import MAX_RANK

    rng = random.Random(3)
    depth_cap = 5
    prof = AcceptanceProfile(depth_cap)
    ref = {k: np.zeros((depth_cap, MAX_RANK)) for k in ("reached", "accepted", "present", "drafted")}
    for step in range(300):
        n = rng.randint(0, 14)
        parents = [-1 if i == 0 else rng.randint(-1, i - 1) for i in range(n)]
        tree = Tree(torch.tensor(parents, dtype=torch.long), torch.arange(n))
        ranks, depths, paths, children = structure(parents)
        path, row = [], 0
        while children[row] and rng.random() < 0.7:
            path.append(rng.choice(children[row]))
            row = path[-1] + 1
        asked = None if rng.random() < 0.5 else {p: rng.randint(0, 10) for p in [()] + paths if rng.random() < 0.8}

        def ask(r):
            return MAX_RANK if asked is None else min(MAX_RANK, asked.get(() if r == 0 else paths[r - 1], 0))

        for r, kids in enumerate(children):
            d = 0 if r == 0 else depths[r - 1]
            if d < depth_cap:
                ref["present"][d, : ask(r)] += 1
                ref["drafted"][d, : min(ask(r), len(kids))] += 1
        r = 0
        for d in range(min(len(path), depth_cap - 1) + 1):
            ref["reached"][d, : ask(r)] += 1
            if d < len(path):
                if ranks[path[d]] < MAX_RANK:
                    ref["accepted"][d, ranks[path[d]]] += 1
                r = path[d] + 1
        prof.observe(tree, path, asked)
        if step == 150:
            prof.decay(0.5)
            for a in ref.values():
                a *= 0.5
    for name, want in ref.items():
        assert np.allclose(getattr(prof, name), want), name
    assert want.sum() > 0


def test_prune_to_shape_keeps_rank_paths_in_order():
    tree = Tree(torch.tensor([-1, -1, 0, 0, 1, 2]), torch.tensor([10, 11, 12, 13, 14, 15]))
    q = torch.softmax(torch.randn(7, 20), -1)
    prop = TreeProposal(tree, Mode.SAMPLED_WITHOUT_REPLACEMENT, q, torch.arange(6, dtype=torch.float64))
    out = prune_to_shape(prop, Plan.of(Tree.from_paths([(0,), (0, 0), (0, 0, 0)])))
    assert out.tree.parents.tolist() == [-1, 0, 1] and out.tree.tokens.tolist() == [10, 12, 15]
    assert torch.equal(out.draft_probs, q[[0, 1, 3, 6]]) and out.scores.tolist() == [0.0, 2.0, 5.0]
    out.validate()
    assert prune_to_shape(prop, Plan.of(wide_shape(3, 2))) is prop  # nothing to cut


def test_plans_and_buckets():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert str(FULL) == "full" and str(NONE) == "none" and str(Plan.of(Tree.chain(3))) == "chain n=3"
    assert Plan.of(wide_shape(2, 2)).width == 4 and Plan.of(None) == NONE
    with pytest.raises(ValueError):
        OnlinePolicy(0)


def test_tensor_parallel_ranks_take_the_first_ranks_plans():
    """Ranks time their steps differently; `sync` (rank 0's state) makes them draft the same trees."""
    rank0 = OnlinePolicy(8, replan_every=32, explore_every=8)
    states = []  # rank 0 sends its state, rank 1 receives it (what the broadcast does)
    rank0.sync = lambda st: states.append(st) or st
    eng0 = Engine(rank0, ShapeDrafter(wide_shape(3, 2)), [0.7, 0.1], line(5.0, 0.4), seed=4)
    rank1 = OnlinePolicy(8, replan_every=32, explore_every=8)
    received = iter(states)
    rank1.sync = lambda st: next(received)
    eng1 = Engine(rank1, ShapeDrafter(wide_shape(3, 2)), [0.7, 0.1], line(1.0, 5.0), seed=4)  # other timings
    for _ in range(320):
        eng0.step()
        eng1.step()
        assert {b: p.key for b, p in rank0.plans.items()} == {b: p.key for b, p in rank1.plans.items()}
    assert rank0.changes >= 1 and rank1.changes == rank0.changes and rank1.explore_period == rank0.explore_period


def test_a_short_load_is_planned_before_the_periodic_replan():
    """A bucket re-plans early at its 8th, 32nd and 128th clean step: a load shorter than `replan_every` is
    still planned (here the periodic re-plan never comes), and that first plan is revised twice."""
    pol = OnlinePolicy(8, replan_every=10_000, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(4, 2)), [0.8], line(5.0, 0.4)).run(120)
    plan = plan_of(eng)
    assert plan.kind == "tree" and plan.shape.is_chain(), (plan, eng.history)
    assert pol.replans == 2 and pol.early == {4: 2}, (pol.replans, pol.early)  # 8 and 32 clean steps
    eng.run(200)
    assert pol.replans == 3 and pol.early == {4: 3}  # 128; then only the periodic re-plans


def test_early_steps_passed_in_the_warm_up_count_once():
    """At batch 1 the 64 warm-up rounds take 64 steps: the 8 and 32 clean-step re-plans are one re-plan."""
    pol = OnlinePolicy(8, replan_every=10_000, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(4, 2)), [0.8], line(5.0, 0.4), batch=1).run(100)
    assert pol.replans == 1 and pol.early == {1: 2}, (pol.replans, pol.early)
    eng.run(100)
    assert pol.replans == 2 and pol.early == {1: 3}, (pol.replans, pol.early)


def test_without_early_replans_the_same_load_keeps_the_full_tree():
    """The negative control of the test above: with the early re-plan disabled the bucket stays `full`."""
    pol = OnlinePolicy(8, replan_every=10_000, explore_every=8)
    pol._early_replan_due = lambda: False
    eng = Engine(pol, ShapeDrafter(wide_shape(4, 2)), [0.8], line(5.0, 0.4)).run(120)
    assert plan_of(eng) == FULL and pol.replans == 0


def test_an_unplanned_bucket_borrows_the_nearest_planned_one():
    pol = OnlinePolicy(8)
    assert pol.plan_for(16) == FULL  # nothing planned yet: the drafter's own tree
    chain2, chain4 = Plan.of(Tree.chain(2)), Plan.of(Tree.chain(4))
    pol.plans = {2: chain4, 8: chain2}
    assert pol.plan_for(2) == chain4 and pol.plan_for(8) == chain2
    assert pol.plan_for(3) == chain4  # bucket 4: as near to 2 as to 8, the smaller bucket wins
    assert pol.plan_for(1) == chain4 and pol.plan_for(64) == chain2 and pol.plan_for(16) == chain2


# ---------------------------------------------------------------------------
# The drafter's linear draft as a plan


class LinearFirstDrafter(TreeDrafter):
    """A suffix-like drafter: a rank-0 chain of `depth` nodes whose first L are its linear draft (L drawn per
    round from `lengths`), plus a rank-1 sibling under every chain node. The engine accepts exactly the linear
    draft: the linear part is sure, everything else is wrong, so rows beyond it only cost."""

    def __init__(self, depth: int, lengths: list[int], seed: int = 0):
        super().__init__()
        self.depth, self.lengths, self.rng = depth, lengths, random.Random(seed)
        self.linear: dict = {}  # req_id -> the token ids of its last linear draft

    def _propose(self, requests, budgets):
        out = []
        self.hints = [r.linear_only for r in requests]
        for r, b in zip(requests, budgets):
            parents = list(range(-1, self.depth - 1)) + list(range(-1, self.depth - 1))  # chain, then siblings
            parents = parents[:b]
            n = len(parents)
            k = min(self.rng.choice(self.lengths), n, self.depth)
            tokens = 1000 + torch.arange(n)
            self.linear[r.req_id] = set(range(1000, 1000 + k))
            out.append(TreeProposal(Tree(torch.tensor(parents), tokens), Mode.DETERMINISTIC, linear_len=k))
        return out


class LinearEngine(Engine):
    def accept(self, tree: Tree) -> list[int]:
        rid = self._rid
        path, row = [], 0
        while True:
            kids = [c for c in tree.children[row] if int(tree.tokens[c]) in self.drafter.linear[rid]]
            if not kids:
                return path
            path.append(kids[0])
            row = kids[0] + 1

    def step(self) -> None:  # the base step, with the request id known to `accept`
        reqs = [DraftRequest(rid, list(ctx), 0.0) for rid, ctx in self.contexts.items()]
        t0 = self.now
        out = self.shape_policy.propose(self.drafter, reqs, [self.budget] * len(reqs))
        self.now = t0 + 0.0002
        rows = 0
        for r, p in zip(reqs, out):
            self._rid = r.req_id
            path = self.accept(p.tree)
            self.contexts[r.req_id] += [int(p.tree.tokens[n]) for n in path] + [BONUS]
            rows += 1 + p.num_nodes
            self.tokens += 1 + len(path)
        self.now += self.cost(len(reqs), rows) / 1e3
        self.steps += 1


def test_linear_nodes_and_pruning():
    parents = [-1, 0, 1, -1, 0]  # chain 0-1-2, sibling 3 of 0, sibling 4 of 1
    p = TreeProposal(Tree(torch.tensor(parents), torch.tensor([10, 11, 12, 13, 14])), Mode.DETERMINISTIC,
                     scores=torch.tensor([0.9, 0.8, 0.7, 0.2, 0.1], dtype=torch.float64), linear_len=2)
    assert linear_nodes(p) == [0, 1]
    lin = prune_to_linear(p)
    assert lin.tree.parents.tolist() == [-1, 0] and lin.tree.tokens.tolist() == [10, 11]
    assert lin.scores.tolist() == [0.9, 0.8]
    p = dataclasses.replace(p, linear_len=None)  # no linear draft given: the rank-0 path
    assert linear_nodes(p) == [0, 1, 2]
    assert prune_to_linear(p).tree.tokens.tolist() == [10, 11, 12]
    shuffled = TreeProposal(Tree(torch.tensor([-1, -1, 1, 0]), torch.tensor([5, 6, 7, 8])), Mode.DETERMINISTIC)
    assert linear_nodes(shuffled) == [0, 3]  # first child at each level, wherever it is listed
    assert str(LINEAR) == "linear" and LINEAR.kind == "linear" and LINEAR.num_nodes == 0


def test_a_bad_linear_len_is_refused():
    from vllm_tree_spec.drafters.base import DrafterError

    tree = Tree(torch.tensor([-1, -1, 1]), torch.tensor([5, 6, 7]))
    TreeProposal(tree, Mode.DETERMINISTIC, linear_len=1).validate(budget=3)
    for bad in (2, 4, -1):  # node 1 is not node 0's child; more than N; negative
        with pytest.raises(DrafterError, match="linear_len"):
            TreeProposal(tree, Mode.DETERMINISTIC, linear_len=bad).validate(budget=3)


def _greedy_walk(parents: list[int], tokens: list[int], target: list[int]) -> list[int]:
    """The tokens the greedy rule accepts: follow the child spelling the target while there is one."""
    node, out = -1, []
    for t in target:
        nxt = [j for j, q in enumerate(parents) if q == node and tokens[j] == t]
        if not nxt:
            break
        node = nxt[0]
        out.append(t)
    return out


def test_linear_yield_is_what_the_linear_draft_alone_accepts():
    """Exhaustive over small trees and targets: the linear draft's yield read from a round that verified the
    whole tree (or the part a gate kept) equals verifying the linear draft (so gated) alone."""
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 7)
        k = rng.randint(0, n)
        parents = list(range(-1, k - 1)) + [rng.randint(-1, i - 1) for i in range(k, n)]
        tokens = []
        for i, par in enumerate(parents):  # distinct siblings from a small alphabet
            used = {tokens[j] for j in range(i) if parents[j] == par}
            tokens.append(rng.choice([t for t in range(6) if t not in used]))
        p = TreeProposal(Tree(torch.tensor(parents), torch.tensor(tokens)), Mode.DETERMINISTIC, linear_len=k)
        p.validate()
        keep = rng.randint(0, n)  # a gate that keeps an ancestor-closed prefix of the nodes
        v_par, v_tok = parents[:keep], tokens[:keep]
        lin_kept = [tokens[i] for i in range(min(k, keep))]
        for _ in range(5):
            target = [rng.randrange(6) for _ in range(8)]
            new = _greedy_walk(v_par, v_tok, target)
            children = structure(v_par)[3]
            got = _linear_yield(p, v_tok, children, new)
            alone = _greedy_walk(list(range(-1, len(lin_kept) - 1)), lin_kept, target)
            assert got == (1 + len(alone), len(lin_kept)), (parents, tokens, keep, target, got, alone)


def test_rows_that_only_cost_settle_on_the_linear_draft():
    """The linear draft is accepted whole and nothing else is; its length varies by round, so no fixed chain
    matches it: with rows that cost, the policy settles on `linear` (its measured yield) and gets its
    tokens at the fewest rows."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8, score_gate=False)
    eng = LinearEngine(pol, LinearFirstDrafter(6, [0, 1, 4]), None, line(5.0, 2.0)).run(400)
    assert plan_of(eng) == LINEAR, eng.history
    assert ("linear" in [h[1] for h in eng.history])
    # under `linear` the drafter is told that only the linear draft is verified, except on a probe
    seen = set()
    for _ in range(2 * pol.explore_period):
        eng.step()
        seen.add(tuple(eng.drafter.hints))
    assert (True,) * 4 in seen and any(not all(h) for h in seen), seen  # plan steps and probe steps
    # the negative control: where rows are free the longer chain is no worse and the policy has no reason to
    # leave the drafter's own tree for its linear draft
    pol2 = OnlinePolicy(8, replan_every=64, explore_every=8, score_gate=False)
    eng2 = LinearEngine(pol2, LinearFirstDrafter(6, [0, 1, 4]), None, line(5.0, 0.0)).run(400)
    assert plan_of(eng2) != LINEAR, eng2.history


def test_an_unproven_slope_leans_to_cheap_rows():
    """Steps whose rows barely vary (27 / 29) say little about the cost of a row: the fitted slope starts
    shrunk toward 0 (a `none` plan's 4 rows are not extrapolated from it as if it were sure) and reaches the
    true 5 ms per row as such steps accumulate."""
    c = BucketCosts()
    for i in range(8):
        rows = 27 + 2 * (i % 2)
        c.observe(i, 4, rows, 50.0 + 5.0 * rows, 0.0, True)
    level, slope = c.line(None)
    assert 1.0 < slope < 2.5, slope  # 7 pairs of 2 rows: half the evidence of the prior
    assert level + slope * 4 > 50.0 + 5.0 * 4 + 30, (level, slope)  # `none` is not predicted at its true 70 ms yet
    for i in range(8, 400):
        rows = 27 + 2 * (i % 2)
        c.observe(i, 4, rows, 50.0 + 5.0 * rows, 0.0, True)
    assert 4.8 < c.line(None)[1] <= 5.0


def _concave(draftless_ms: float, spec_ms: float, row_ms: float):
    """A step that costs `draftless_ms` with the root rows alone and `spec_ms` + row_ms per row past 7 per
    request once it verifies drafts: the slope between speculating steps says nothing of the draftless step."""
    return lambda batch, rows: draftless_ms if rows <= batch else spec_ms + row_ms * (rows - 7 * batch)


def test_none_is_priced_from_measured_draftless_steps():
    """Speculating steps cost 180-200 ms whatever their rows, a draftless one 70: `none` is 1.4x faster than any
    tree, but the line through the speculating steps, extrapolated to the root rows, prices it at ~170 ms. The
    policy's draftless probes measure it, and it switches speculation off; without the probes it does not
    (negative control)."""
    cost = _concave(70.0, 200.0, 1.0)
    pol = OnlinePolicy(6, replan_every=64, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(3, 2)), [0.5, 0.1], cost).run(640)
    assert plan_of(eng) == NONE, eng.history
    c = pol.costs[4]
    assert c.none_step() == pytest.approx(70.0, abs=0.5)  # (+ the synthetic engine's 0.2 ms of drafting)

    pol2 = OnlinePolicy(6, replan_every=64, explore_every=8)
    pol2.none_probe_due = lambda batch_size: False
    eng2 = Engine(pol2, ShapeDrafter(wide_shape(3, 2)), [0.5, 0.1], cost).run(640)
    assert plan_of(eng2) != NONE, eng2.history
    assert pol2.costs[4].none_step() is None
    level, slope = pol2.costs[4].line(None)
    assert level + slope * 4 > 120.0, (level, slope)  # what the line alone prices `none` at


def test_none_probes_are_few_and_never_on_exploration_steps():
    """A settled chain plan probes `none` on about two steps per re-plan period (NONE_PROBES, decayed), halfway
    between exploration steps; a bucket already on `none` is never probed."""
    pol = OnlinePolicy(8, replan_every=64, explore_every=8)
    eng = Engine(pol, ShapeDrafter(wide_shape(4, 2)), [0.8], line(5.0, 0.4))
    seen = {}
    exploring, due = pol.exploring, pol.none_probe_due
    pol.exploring = lambda: seen.setdefault("explore", exploring())
    pol.none_probe_due = lambda b: seen.setdefault("probe", due(b))
    probes = []
    for _ in range(1280):
        seen.clear()
        eng.step()
        probe = seen.get("probe", False)
        assert not (probe and seen["explore"])  # asked only on steps that do not explore
        probes.append(probe)
        if probe:  # the step drafted nothing for any request
            assert not any(eng.drafter.calls[-1]), eng.drafter.calls[-1]
    assert plan_of(eng).kind == "tree", eng.history
    late = sum(probes[640:])
    assert 1 <= late <= 2 * 640 // 64 + 2, late  # ~2 per re-plan period once settled
    assert pol.none_probes[4] <= 4
    assert pol.costs[4].none_step() is not None

    off = OnlinePolicy(8, replan_every=64, explore_every=8)
    eng_off = Engine(off, ShapeDrafter(wide_shape(3, 2)), [0.3, 0.1], line(1.0, 5.0)).run(640)
    assert plan_of(eng_off) == NONE
    assert not off.none_probe_due(4)
    n = off.none_probes.get(4, 0.0)
    eng_off.run(256)
    assert off.none_probes.get(4, 0.0) <= n  # no new probe while the plan is `none`


def test_probes_stay_off_the_line_and_draftless_steps_count_for_none():
    """A probe's time prices `none` only; a step that happened to verify no draft is on the line too."""
    c = BucketCosts()
    for i in range(16):
        rows = 24 + 4 * (i % 2)
        c.observe(i, 4, rows, 100.0 + 2.0 * rows, 0.0, True)
    before = c.line(None)
    c.observe(16, 4, 4, 30.0, 0.0, False, draftless=True, probe=True)
    c.observe(17, 4, 4, 34.0, 0.0, False, draftless=True, probe=True)
    assert c.line(None) == before and c.w == 16
    assert c.none_step() == pytest.approx(32.0)
    c.observe(18, 4, 4, 38.0, 0.0, False, draftless=True)
    assert c.w == 17 and c.none_step() == pytest.approx(34.0)
    c.decay(0.5, 0.5)  # old measurements fade: below MIN_NONE_STEPS of weight the line prices `none` again
    assert c.none_w == pytest.approx(1.5) and c.none_step() is None
    c.observe(19, 4, 4, 34.0, 0.0, False, draftless=True, probe=True)
    assert c.none_step() == pytest.approx(34.0)
    assert BucketCosts().none_step() is None
