"""Tree builders (vllm_tree_spec/build.py) against loop references.

Drafts are deterministic functions of the token context (a generator seeded
by a CRC of the context), so a builder and its reference see identical q.
The dynamic builder is compared with a plain-Python transcription of SGLang's
algorithm; Sequoia's DP with exhaustive search over all small trees and with
the greedy top-n construction, which is optimal when acceptance is monotone
in the rank.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from vllm_tree_spec.build import (
    ChildSampling,
    DraftQuery,
    acceptance_table,
    budget_shape,
    build_dynamic,
    build_dynamic_batch,
    build_dynamic_budget,
    context_draft,
    draw_without_replacement,
    expand_static,
    expand_static_batch,
    expected_accepted_length,
    optimal_static_tree,
    optimal_static_trees,
    sample_children,
    sample_children_batch,
)
from vllm_tree_spec.tree import NO_PARENT, Tree, TreeShape

PROPS = settings(max_examples=40, deadline=None)


def hashed_q(vocab: int, sharp: float = 3.0, levels: int = 0, seed: int = 0):
    """q(context): a fixed random distribution per context.

    levels > 0 quantises the weights to `levels` integer steps, which makes
    exact probability ties (and zero-probability tokens) common.
    """

    def q(ctx: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, ctx)).encode()))
        w = torch.rand(vocab, generator=g, dtype=torch.float64) ** sharp
        if levels:
            w = torch.floor(w / w.max() * levels)
            if w.sum() == 0:
                w[0] = 1.0
        return (w / w.sum()).to(torch.float32)

    return q


class CountingDraft:
    """A DraftFn that records every call (to check per-level batching)."""

    def __init__(self, q):
        self.q = q
        self.calls: list[list[DraftQuery]] = []

    def __call__(self, queries):
        self.calls.append(list(queries))
        return torch.stack([self.q(qr.context) for qr in queries])


def ranked(q: torch.Tensor) -> list[int]:
    """Token ids by descending q, ties toward the lower id."""
    return sorted(range(q.numel()), key=lambda t: (-float(q[t]), t))


# ---------------------------------------------------------------------------
# Static expansion


def test_static_expansion_fills_ranks_from_the_parent_distribution():
    qf = hashed_q(11)
    paths = [(0,), (2,), (0, 0), (0, 3), (2, 1), (0, 3, 0)]  # rank 1 of the root is skipped on purpose
    draft = CountingDraft(qf)
    dt = expand_static(draft, paths, prefix=(5, 9), return_q=True)
    t = dt.tree
    assert dt.sampling is ChildSampling.TOPK
    assert t.parents.tolist() == Tree.from_paths(paths).parents.tolist()
    order = sorted(paths, key=lambda p: (len(p), p))
    for i, p in enumerate(order):
        ctx = (5, 9) + tuple(t.path_tokens(i)[:-1])
        q = qf(ctx)
        assert int(t.tokens[i]) == ranked(q)[p[-1]]
        parent = int(t.parents[i])
        base = 0.0 if parent == NO_PARENT else float(dt.scores[parent])
        assert float(dt.scores[i]) == pytest.approx(base + math.log(float(q[t.tokens[i]])), abs=1e-9)
    # one draft call per level with children, each covering all of that level's expanded rows
    assert [len(c) for c in draft.calls] == [1, 2, 1]
    assert torch.equal(dt.q[0], qf((5, 9)))
    for row, kids in enumerate(t.children):
        if kids:
            ctx = (5, 9) + (tuple(t.path_tokens(row - 1)) if row else ())
            assert torch.equal(dt.q[row], qf(ctx))
        else:
            assert not bool(dt.q[row].any())


def test_static_expansion_breaks_ties_toward_lower_ids():
    uniform = context_draft(lambda ctx: torch.full((6,), 1 / 6))
    dt = expand_static(uniform, Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0)]))
    assert dt.tree.tokens.tolist() == [0, 1, 2, 0, 1, 0]  # every rank r is token r


def test_static_expansion_of_a_tree_uses_sibling_positions_and_chain_is_greedy():
    qf = hashed_q(9)
    dt = expand_static(context_draft(qf), Tree.chain(4))
    ctx: tuple[int, ...] = ()
    for tok in dt.tree.tokens.tolist():  # a chain is the greedy draft path
        assert tok == ranked(qf(ctx))[0]
        ctx += (tok,)
    assert expand_static(context_draft(qf), Tree.chain(0)).tree.num_nodes == 0


def test_static_batch_matches_single_requests_with_one_call_per_level():
    qf = hashed_q(13)
    prefixes = [(1,), (2, 3), ()]
    draft = CountingDraft(qf)
    shape = Tree(torch.tensor([-1, -1, 0, 0, 2]))
    out = expand_static_batch(draft, shape, prefixes)
    assert len(draft.calls) == 3  # levels 0, 1, 2
    assert {qr.request for qr in draft.calls[0]} == {0, 1, 2}
    for b, p in enumerate(prefixes):
        one = expand_static(context_draft(qf), shape, prefix=p)
        assert torch.equal(out[b].tree.tokens, one.tree.tokens)
        assert torch.equal(out[b].scores, one.scores)


def test_context_draft_batched_and_per_row_agree():
    qf = hashed_q(7)
    batched = context_draft(lambda ctxs: torch.stack([qf(c) for c in ctxs]), batched=True)
    a = build_dynamic(batched, "s3_k2_d7", prefix=(4,), return_q=True)
    b = build_dynamic(context_draft(qf), "s3_k2_d7", prefix=(4,), return_q=True)
    assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.q, b.q)


def test_static_rank_beyond_vocab_is_an_error():
    with pytest.raises(ValueError, match="vocabulary of 4"):
        expand_static(context_draft(hashed_q(4)), [(0,), (4,)])


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda n: torch.linspace(-2.0, 2.0, 5).repeat(n, 1), "not logits"),  # logits: some negative
        (lambda n: torch.full((n, 5), 0.5), "sums to"),
        (lambda n: torch.zeros(n, 5), "sums to"),
        (lambda n: torch.full((n + 1, 5), 0.2), "one row per query"),
        (lambda n: [[0.2] * 5] * n, "torch.Tensor"),
        (lambda n: torch.ones(n, 5, dtype=torch.long), "floating-point"),
    ],
)
def test_bad_draft_outputs_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        expand_static(lambda queries: bad(len(queries)), Tree.chain(2))


# ---------------------------------------------------------------------------
# Dynamic trees vs a transcription of SGLang's algorithm


def sglang_reference(qf, s: int, k: int, d: int, prefix=()):
    """Loop form of EAGLE-2 / SGLang: beams, k*k candidates, global top d-1, sorted.

    Candidates are (score, token, parent candidate, path); every ranking sorts
    by (-score, candidate number). log q is torch.log in float64, as the builder.
    """

    def top(ctx):
        q = qf(prefix + ctx)
        lq = torch.log(q.to(torch.float64)).tolist()
        return [(t, lq[t]) for t in ranked(q)[:k]]

    cands = [(lq, t, NO_PARENT, (t,)) for t, lq in top(())]
    beams = list(range(k))
    for _ in range(1, s):
        new = []
        for bi in beams:
            score, _, _, path = cands[bi]
            new += [(score + lq, t, bi, path + (t,)) for t, lq in top(path)]
        base = len(cands)
        cands += new
        beams = [base + j for j in sorted(range(len(new)), key=lambda j: (-new[j][0], j))[:k]]
    keep = sorted(sorted(range(len(cands)), key=lambda c: (-cands[c][0], c))[: d - 1])
    node = {c: i for i, c in enumerate(keep)}
    parents = [NO_PARENT if cands[c][2] == NO_PARENT else node[cands[c][2]] for c in keep]
    return parents, [cands[c][1] for c in keep], [cands[c][0] for c in keep]


@st.composite
def dynamic_cases(draw):
    s, k = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    d = draw(st.integers(2, k + (s - 1) * k * k + 1))
    vocab = draw(st.integers(k, 9))
    levels = draw(st.sampled_from([0, 0, 1, 2, 4]))  # 1 = one-hot-ish drafts with q = 1 children
    return s, k, d, vocab, levels, draw(st.integers(0, 10**6))


@PROPS
@given(dynamic_cases())
def test_dynamic_builder_matches_the_sglang_reference(case):
    s, k, d, vocab, levels, seed = case
    qf = hashed_q(vocab, levels=levels, seed=seed)
    dt = build_dynamic(context_draft(qf), f"s{s}_k{k}_d{d}", prefix=(7,))
    parents, tokens, scores = sglang_reference(qf, s, k, d, prefix=(7,))
    assert dt.tree.parents.tolist() == parents  # Tree() also re-checks topological order
    assert dt.tree.tokens.tolist() == tokens
    assert dt.scores.tolist() == scores  # bitwise: same float64 operations in the same order
    assert dt.tree.num_nodes == d - 1 and dt.tree.max_depth <= s
    assert dt.tree.duplicate_siblings() == []


def test_dynamic_tree_stays_ancestor_closed_with_q_equal_one_children():
    # Every draft row is one-hot: each beam's best child has q = 1 (score unchanged),
    # the other k - 1 children have q = 0 (score -inf). Ties everywhere.
    vocab = 5
    one_hot = context_draft(lambda ctx: torch.nn.functional.one_hot(torch.tensor(len(ctx) % vocab), vocab).float())
    dt = build_dynamic(one_hot, "s4_k3_d12")
    t = dt.tree
    assert t.num_nodes == 11
    for i, p in enumerate(t.parents.tolist()):  # parents precede children and are kept
        assert p < i
    # the zero-score path (the q = 1 chain) is kept in full, deepest level included
    chain = [i for i in range(t.num_nodes) if dt.scores[i] == 0.0]
    assert t.tokens[chain].tolist() == [0, 1, 2, 3]
    assert t.depth[chain].tolist() == [1, 2, 3, 4]


def test_s3_k2_d6_has_five_nodes_of_depth_at_most_three():
    qf = hashed_q(10)
    draft = CountingDraft(qf)
    dt = build_dynamic(draft, TreeShape.parse("s3_k2_d6"), return_q=True)
    assert dt.tree.num_nodes == 5 and dt.tree.max_depth <= 3
    assert [len(c) for c in draft.calls] == [1, 2, 2]  # root, then k beams per later step
    for row, kids in enumerate(dt.tree.children):
        if kids:  # q where children were drawn is the draft's q at that row
            ctx = tuple(dt.tree.path_tokens(row - 1)) if row else ()
            assert torch.equal(dt.q[row], qf(ctx))


@pytest.mark.parametrize("s, d", [(4, 5), (5, 3), (1, 2)])
def test_topk_one_is_the_greedy_chain(s, d):
    qf = hashed_q(8)
    dt = build_dynamic(context_draft(qf), f"s{s}_k1_d{d}")
    assert dt.tree.is_chain() and dt.tree.num_nodes == min(s, d - 1)
    assert torch.equal(dt.tree.tokens, expand_static(context_draft(qf), Tree.chain(d - 1)).tree.tokens)


def test_dynamic_batch_matches_single_requests_with_one_call_per_step():
    qf = hashed_q(12)
    draft = CountingDraft(qf)
    prefixes = [(1,), (2,), (3, 4)]
    out = build_dynamic_batch(draft, "s3_k3_d9", prefixes)
    assert [len(c) for c in draft.calls] == [3, 9, 9]
    for b, p in enumerate(prefixes):
        one = build_dynamic(context_draft(qf), "s3_k3_d9", prefix=p)
        assert torch.equal(out[b].tree.parents, one.tree.parents)
        assert torch.equal(out[b].tree.tokens, one.tree.tokens)


def test_budget_variant_is_the_shape_variant():
    qf = hashed_q(10)
    assert budget_shape(depth=4, topk=3, budget=20) == TreeShape(4, 3, 21)
    a = build_dynamic_budget(context_draft(qf), depth=4, topk=3, budget=20)[0]
    b = build_dynamic(context_draft(qf), "s4_k3_d21")
    assert torch.equal(a.tree.parents, b.tree.parents) and torch.equal(a.tree.tokens, b.tree.tokens)
    with pytest.raises(ValueError, match="budget = 30"):
        budget_shape(depth=3, topk=3, budget=30)
    with pytest.raises(ValueError, match=">= 1"):
        budget_shape(depth=0, topk=3, budget=2)


def test_dynamic_scores_rank_the_kept_nodes_above_the_dropped_ones():
    # The kept set is the top (d - 1) of all candidates: its worst score is >= the
    # best score among candidates of the full (d = max) tree that were dropped.
    qf = hashed_q(10, sharp=1.5)
    full = build_dynamic(context_draft(qf), "s3_k3_d22")
    part = build_dynamic(context_draft(qf), "s3_k3_d8")
    kept = set(map(tuple, (part.tree.path_tokens(i) for i in range(part.tree.num_nodes))))
    dropped = [float(full.scores[i]) for i in range(full.tree.num_nodes)
               if tuple(full.tree.path_tokens(i)) not in kept]
    assert float(part.scores.min()) >= max(dropped)


# ---------------------------------------------------------------------------
# Sampled children


def test_without_replacement_draws_distinct_tokens_in_draw_order():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    n = 40_000
    draws = draw_without_replacement(q.expand(n, 4), 2, g)  # [n, 2]
    assert bool((draws[:, 0] != draws[:, 1]).all())
    # ordered pairs (x, y) have probability q(x) * q(y) / (1 - q(x)); chi-squared, fixed seed
    counts = torch.zeros(4, 4)
    counts.index_put_((draws[:, 0], draws[:, 1]), torch.ones(n), accumulate=True)
    cells = [(x, y) for x, y in itertools.product(range(4), repeat=2) if x != y]
    expect = [n * float(q[x] * q[y] / (1 - q[x])) for x, y in cells]
    observed = [float(counts[x, y]) for x, y in cells]
    assert stats.chisquare(observed, expect).pvalue > 1e-3
    # a reversed order (the second draw first) would be rejected by the same test
    rev = [float(counts[y, x]) for x, y in cells]
    assert stats.chisquare(rev, expect).pvalue < 1e-6


def test_without_replacement_never_draws_zero_probability_tokens():
    q = torch.tensor([[0.0, 0.7, 0.0, 0.3]])
    d = draw_without_replacement(q.expand(1000, 4), 2, torch.Generator().manual_seed(0))
    assert set(d.flatten().tolist()) == {1, 3}
    with pytest.raises(ValueError, match="only 2 tokens"):
        draw_without_replacement(q, 3)


def test_sampled_children_builders():
    qf = hashed_q(6, sharp=6.0)  # peaked: i.i.d. draws repeat tokens
    shape = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    wor = sample_children(context_draft(qf), shape, replacement=False, generator=gen(3))
    assert wor.sampling is ChildSampling.WITHOUT_REPLACEMENT and wor.tree.duplicate_siblings() == []
    again = sample_children(context_draft(qf), shape, replacement=False, generator=gen(3))
    assert torch.equal(wor.tree.tokens, again.tree.tokens)  # seeded => reproducible
    # q rows are the unmodified draft rows where children were drawn
    for row, kids in enumerate(wor.tree.children):
        if kids:
            ctx = tuple(wor.tree.path_tokens(row - 1)) if row else ()
            assert torch.equal(wor.q[row], qf(ctx))
    dups = 0
    for s in range(30):
        iid = sample_children(context_draft(qf), shape, replacement=True, generator=gen(s))
        assert iid.sampling is ChildSampling.IID and iid.q is not None
        dups += len(iid.tree.duplicate_siblings())
    assert dups > 0  # duplicates are kept as separate siblings, never merged


def test_sampled_batch_uses_one_generator_per_request():
    qf = hashed_q(20)
    shape = Tree.from_paths([(0,), (1,), (0, 0)])
    alone = sample_children(context_draft(qf), shape, replacement=False, generator=torch.Generator().manual_seed(5),
                            prefix=(1,))
    draft = CountingDraft(qf)
    both = sample_children_batch(draft, shape, [(2,), (1,)], replacement=False,
                                 generators=[torch.Generator().manual_seed(9), torch.Generator().manual_seed(5)])
    assert torch.equal(both[1].tree.tokens, alone.tree.tokens)  # independent of the rest of the batch
    assert [len(c) for c in draft.calls] == [2, 2]
    with pytest.raises(ValueError, match="one per request"):
        sample_children_batch(draft, shape, [(), ()], replacement=True, generators=[None])


def test_iid_children_follow_q():
    q = torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64)
    shape = Tree.from_paths([(0,), (1,)])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        toks = sample_children(context_draft(lambda ctx: q), shape, replacement=True, generator=g).tree.tokens
        counts += torch.bincount(toks, minlength=4)
    assert stats.chisquare(counts.tolist(), (4000 * q).tolist()).pvalue > 1e-3


# ---------------------------------------------------------------------------
# Sequoia: optimal static trees


def all_trees(n: int, max_depth: int, ranks: int):
    """Every tree of exactly n nodes, depth <= max_depth, < ranks children per node, as rank paths."""

    def forests(m: int, depth: int, rank: int):
        if m == 0:
            yield []
            return
        if depth > max_depth or rank >= ranks:
            return
        for size in range(1, m + 1):  # the rank-`rank` child's subtree has `size` nodes
            for sub in forests(size - 1, depth + 1, 0):
                for rest in forests(m - size, depth, rank + 1):
                    yield [(rank,)] + [(rank,) + p for p in sub] + rest

    for paths in forests(n, 1, 0):
        yield Tree.from_paths(paths) if paths else Tree.chain(0)


def greedy_tree(acceptance, n: int, max_depth: int) -> Tree:
    """Medusa/EAGLE greedy: repeatedly add the frontier node with the largest path product."""
    a = acceptance_table(acceptance, max_depth)
    paths, value = [], {(): 1.0}
    frontier = {(0,): a[0, 0]}
    for _ in range(n):
        p = max(frontier, key=lambda x: (frontier[x], [-r for r in x]))
        v = frontier.pop(p)
        paths.append(p)
        value[p] = v
        if p[-1] + 1 < a.shape[1]:  # next sibling
            frontier[p[:-1] + (p[-1] + 1,)] = value[p[:-1]] * a[len(p) - 1, p[-1] + 1]
        if len(p) < max_depth:  # first child
            frontier[p + (0,)] = v * a[len(p), 0]
    return Tree.from_paths(paths)


def test_expected_accepted_length_of_a_chain_is_the_geometric_sum():
    for alpha, k in [(0.8, 4), (0.5, 0), (1.0, 3), (0.0, 5)]:
        assert expected_accepted_length(Tree.chain(k), [alpha]) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_expected_accepted_length_by_hand():
    t = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (2,)])
    a = [[0.5, 0.2], [0.4, 0.3]]  # depth 3 repeats row 2; rank 2 is unmeasured -> 0
    e = 1 + 0.5 + 0.2 + 0.5 * 0.4 + 0.5 * 0.3 + 0.5 * 0.4 * 0.4 + 0.0
    assert expected_accepted_length(t, a) == pytest.approx(e)
    assert expected_accepted_length(Tree.chain(0), a) == 1.0


@pytest.mark.parametrize(
    "acc, match",
    [([0.7, 0.4], "sums to 1.1"), ([0.5, -0.1], r"\[0, 1\]"), ([], "shape"), ([[0.5], [1.2]], r"\[0, 1\]")],
)
def test_acceptance_errors(acc, match):
    with pytest.raises(ValueError, match=match):
        acceptance_table(acc, 3)


@st.composite
def acceptances(draw, monotone: bool = False):
    ranks = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 3))
    table = []
    for _ in range(rows):
        w = draw(st.lists(st.floats(0.0, 1.0), min_size=ranks, max_size=ranks))
        total = draw(st.floats(0.0, 1.0))
        row = [x / sum(w) * total for x in w] if sum(w) > 0 else [0.0] * ranks
        table.append(sorted(row, reverse=True) if monotone else row)
    return table[0] if rows == 1 and draw(st.booleans()) else table


@settings(max_examples=200, deadline=None)
@given(acceptances(), st.integers(1, 6), st.integers(1, 4))
def test_sequoia_dp_matches_exhaustive_search(acc, n, max_depth):
    ranks = acceptance_table(acc, 1).shape[1]
    best = max((expected_accepted_length(t, acc) for t in all_trees(n, max_depth, ranks)), default=None)
    if best is None:  # n nodes do not fit
        with pytest.raises(ValueError, match="does not fit"):
            optimal_static_tree(acc, n, max_depth)
        return
    tree = optimal_static_tree(acc, n, max_depth)
    assert tree.num_nodes == n and tree.max_depth <= max_depth and tree.max_children <= ranks
    assert expected_accepted_length(tree, acc) == pytest.approx(best, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(acceptances(monotone=True), st.integers(1, 30), st.integers(1, 8))
def test_sequoia_dp_matches_greedy_when_acceptance_decreases_with_rank(acc, n, max_depth):
    ranks = acceptance_table(acc, 1).shape[1]
    if n > sum(ranks**d for d in range(1, max_depth + 1)):
        return
    dp = expected_accepted_length(optimal_static_tree(acc, n, max_depth), acc)
    greedy = expected_accepted_length(greedy_tree(acc, n, max_depth), acc)
    assert dp == pytest.approx(greedy, abs=1e-12)


def test_sequoia_beats_greedy_when_a_later_rank_is_better():
    # Rank 2 is the likeliest child but needs ranks 0 and 1 as elder siblings.
    # Greedy never pays for the weak rank 1 and goes deep instead:
    # 1 + 0.4 + 0.16 + 0.064; the DP takes all three root children: 1 + 0.4 + 0.05 + 0.5.
    acc = [0.4, 0.05, 0.5]
    assert expected_accepted_length(greedy_tree(acc, 3, 3), acc) == pytest.approx(1.624)
    tree = optimal_static_tree(acc, 3, 3)
    assert tree.to_paths() == [(0,), (1,), (2,)]
    assert expected_accepted_length(tree, acc) == pytest.approx(1.95)


def test_optimal_trees_improve_with_budget_and_depth():
    acc = [[0.7, 0.15, 0.05], [0.6, 0.15, 0.05], [0.5, 0.1, 0.05]]
    prev = 1.0
    for n, tree in enumerate(optimal_static_trees(acc, 20, 3)):
        e = expected_accepted_length(tree, acc)
        assert tree.num_nodes == n and e >= prev - 1e-12
        prev = e
    shallow = expected_accepted_length(optimal_static_tree(acc, 12, 2), acc)
    deep = expected_accepted_length(optimal_static_tree(acc, 12, 6), acc)
    assert deep > shallow
    # one rank, depth L: the only tree is the chain
    assert optimal_static_tree([0.9], 5).is_chain()


def test_optimal_tree_capacity_error():
    assert optimal_static_trees([0.5], 3, 2)[3] is None
    with pytest.raises(ValueError, match="capacity 2"):
        optimal_static_tree([0.5], 3, 2)
