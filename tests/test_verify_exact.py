"""Exact-enumeration tests: every verification mode is lossless, the known-lossy rules are not.

The law of one round (drafting + verification with the real `verify.node_step`)
is computed exactly in float64 over small vocabularies and random tree shapes,
then compared with sequential sampling from the target (TV < 1e-12).
"""

import random
import zlib

import pytest
import torch

from vllm_tree_spec.reference.exact import (
    ToyLM,
    enumerate_law,
    extend_law,
    residual_rule_skip_duplicates,
    round_tv,
    sequential_law,
    total_variation,
)
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import Mode, node_step, residual, verify_tree_with_coins

TV_LOSSLESS = 1e-12
LOSSY_MIN_TV = 1e-3

# (drafting scheme, verification mode) pairs that must be lossless
LOSSLESS = [
    ("topk", "deterministic"),
    ("iid", "sampled"),
    ("wor", "sampled_without_replacement"),
    # deterministic verification ignores q, so it is lossless for *any* candidate set
    ("iid", "deterministic_dedup"),
    ("wor", "deterministic"),
]

SAMPLING = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=2, min_p=0.05),
]


def random_shape(rng: random.Random, n: int, max_depth: int = 4, max_children: int = 3) -> Tree:
    parents, depth, nch = [], [], {-1: 0}
    for i in range(n):
        cands = [c for c in [-1] + [j for j in range(i) if depth[j] < max_depth] if nch.get(c, 0) < max_children]
        p = rng.choice(cands)
        parents.append(p)
        depth.append(1 if p == -1 else depth[p] + 1)
        nch[p] = nch.get(p, 0) + 1
        nch[i] = 0
    return Tree(torch.tensor(parents, dtype=torch.long))


def dedup_rule(p, q, child_tokens, mode, coins, depth):
    """Deterministic verification on a candidate list with duplicates removed (order kept)."""
    seen = []
    for x in child_tokens:
        if x not in seen:
            seen.append(x)
    rank, y = node_step(p, q, seen, Mode.DETERMINISTIC, coins, depth)
    return (None if rank is None else child_tokens.index(seen[rank])), y


def stable_seed(*parts: str) -> int:
    """A per-case seed that is the same in every process (hash() of a str is salted per process)."""
    return zlib.crc32("/".join(parts).encode()) & 0xFFFF


def cases(num: int, seed: int):
    rng = random.Random(seed)
    for i in range(num):
        vocab = rng.randint(3, 6)
        # Keep the exact iid/wor enumeration small: fewer children on bigger vocabularies.
        max_children = 3 if vocab <= 4 else 2
        tree = random_shape(rng, rng.randint(1, 10 if vocab <= 4 else 7), 4, max_children)
        yield i, vocab, tree, SAMPLING[i % len(SAMPLING)], rng.choice([0.0, 0.5, 0.9])


@pytest.mark.parametrize("scheme,mode", LOSSLESS)
def test_lossless_modes_exact(scheme, mode):
    seed = stable_seed(scheme, mode)
    for i, vocab, tree, sp, closeness in cases(12, seed=seed):
        p = ToyLM(vocab, seed=1000 + i, **sp)
        q = ToyLM(vocab, seed=2000 + i, mix_with=p, mix=closeness)  # q from far to close to p
        rule = dedup_rule if mode == "deterministic_dedup" else node_step
        m = "deterministic" if mode == "deterministic_dedup" else mode
        tv = round_tv(tree, (i % vocab,), p, q, scheme, m, rule)
        assert tv < TV_LOSSLESS, (f"cases(12, seed={seed}) case {i}", scheme, mode, vocab, tree, sp, tv)


def test_greedy_exact():
    for i, vocab, tree, _, _ in cases(12, seed=7):
        p = ToyLM(vocab, seed=3000 + i, temperature=0.0)
        q = ToyLM(vocab, seed=4000 + i)
        assert round_tv(tree, (0,), p, q, "topk", "greedy") == 0.0
        # a draft equal to the target accepts a full root-to-leaf path whenever its first child is argmax
        assert round_tv(tree, (0,), p, p, "topk", "greedy") == 0.0


# -- the checker must be able to fail -------------------------------------------------------------


def _branching_shape() -> Tree:
    # root with 3 children, the first with 2 children: enough siblings to expose lossy rules
    return Tree(torch.tensor([-1, -1, -1, 0, 0]))


@pytest.mark.parametrize(
    "scheme,mode,rule,name",
    [
        ("topk", "sampled", node_step, "top-k children verified with the draft's real q"),
        ("iid", "sampled", residual_rule_skip_duplicates, "i.i.d. children with duplicates skipped"),
        ("iid", "sampled_without_replacement", node_step, "i.i.d. children verified with q renormalised"),
        ("wor", "sampled", node_step, "without-replacement children verified with q fixed"),
    ],
)
def test_checker_flags_lossy_rules(scheme, mode, rule, name):
    tree = _branching_shape()
    worst = 0.0
    for i in range(6):
        vocab = 3 + i % 3
        p = ToyLM(vocab, seed=50 + i, temperature=1.0)
        q = ToyLM(vocab, seed=90 + i, mix_with=p, mix=0.3)
        worst = max(worst, round_tv(tree, (1,), p, q, scheme, mode, rule))
    assert worst > LOSSY_MIN_TV, f"checker failed to flag: {name} (max TV {worst:.2e})"


# -- the whole reference entry point, drafting included, with EOS and max_tokens -------------------


def _stop_law(context, p_model, length, eos, max_tokens):
    """Target law of the next tokens, stopping at EOS or after max_tokens (and at `length`)."""
    out, frontier = {}, [((), 1.0)]
    while frontier:
        seq, w = frontier.pop()
        if len(seq) >= min(length, max_tokens) or (seq and seq[-1] == eos):
            out[seq] = out.get(seq, 0.0) + w
            continue
        pr = p_model(tuple(context) + seq)
        frontier += [(seq + (y,), w * float(pr[y])) for y in range(pr.numel()) if float(pr[y]) > 0]
    return out


def _draft_tree(shape: Tree, ctx, q_model, scheme, coins):
    tokens = [0] * shape.num_nodes
    q_rows = torch.zeros(shape.num_nodes + 1, q_model(ctx).numel(), dtype=torch.float64)

    def fill(row, c):
        q = q_model(c)
        q_rows[row] = q
        left = q.clone()
        for i in shape.children[row]:
            x = coins.draw(left if scheme == "wor" else q, 0)
            tokens[i] = x
            if scheme == "wor":
                left = left.clone()
                left[x] = 0
            fill(i + 1, c + (x,))

    fill(0, tuple(ctx))
    return torch.tensor(tokens, dtype=torch.long), q_rows


def _tree_rows(shape, tokens, ctx, p_model):
    rows = [p_model(tuple(ctx))]
    for i in range(shape.num_nodes):
        rows.append(p_model(tuple(ctx) + tuple(int(tokens[j]) for j in shape.path_to(i))))
    return torch.stack(rows)


@pytest.mark.parametrize("scheme,mode", [("iid", "sampled"), ("wor", "sampled_without_replacement")])
@pytest.mark.parametrize("eos,max_tokens", [(None, None), (1, None), (None, 2), (0, 3)])
def test_verify_tree_end_to_end_exact(scheme, mode, eos, max_tokens):
    """Drafting and `verify_tree_with_coins` under one enumerated coin stream (small trees)."""
    rng = random.Random(11)
    for trial in range(3):
        vocab = 3
        shape = random_shape(rng, rng.randint(1, 4), 3, 2)
        ctx = (trial,)
        p = ToyLM(vocab, seed=500 + trial, temperature=1.1)
        q = ToyLM(vocab, seed=600 + trial, mix_with=p, mix=0.4)

        def one_round(coins):
            tokens, q_rows = _draft_tree(shape, ctx, q, scheme, coins)
            target = _tree_rows(shape, tokens, ctx, p)
            acc, nxt = verify_tree_with_coins(shape.parents, tokens, target, q_rows, mode, coins,
                                              eos_token_id=eos, max_tokens=max_tokens)
            return tuple(int(tokens[a]) for a in acc) + (nxt,)

        law = enumerate_law(one_round)
        length = shape.max_depth + 1
        cap = max_tokens if max_tokens is not None else 10**9
        # continue unfinished sequences with the target, then compare with the stopped target law
        ext = {}
        for seq, w in law.items():
            done = (eos is not None and seq[-1] == eos) or len(seq) >= min(length, cap)
            tail = {(): 1.0} if done else _stop_law(ctx + seq, p, length - len(seq), eos, cap - len(seq))
            for t, w2 in tail.items():
                ext[seq + t] = ext.get(seq + t, 0.0) + w * w2
        ref = _stop_law(ctx, p, length, eos, cap)
        assert abs(sum(law.values()) - 1) < 1e-12
        assert total_variation(ext, ref) < TV_LOSSLESS, (shape, trial)
        if max_tokens is not None:
            assert max(len(s) for s in law) <= max_tokens
        if eos is not None:
            assert all(eos not in s[:-1] for s in law)


def test_deterministic_end_to_end_exact_with_real_walk():
    """Top-k trees (no drafting randomness): the law of the real walk on whole trees."""
    rng = random.Random(5)
    for trial in range(8):
        vocab = rng.randint(3, 6)
        shape = random_shape(rng, rng.randint(1, 9), 4, 3)
        ctx = (trial % vocab,)
        p = ToyLM(vocab, seed=700 + trial, temperature=0.8, top_p=0.95)
        q = ToyLM(vocab, seed=800 + trial)
        # static top-k expansion: child of rank r gets the r-th most likely draft token
        tokens = [0] * shape.num_nodes
        for row, ch in enumerate(shape.children):
            c = tuple(ctx) + (tuple(tokens[j] for j in shape.path_to(row - 1)) if row else ())
            order = sorted(range(vocab), key=lambda t: (-float(q(c)[t]), t))
            for r, i in enumerate(ch):
                tokens[i] = order[r]
        tokens = torch.tensor(tokens)
        target = _tree_rows(shape, tokens, ctx, p)
        law = enumerate_law(lambda coins: (lambda a: tuple(int(tokens[i]) for i in a[0]) + (a[1],))(
            verify_tree_with_coins(shape.parents, tokens, target, None, "deterministic", coins)))
        length = shape.max_depth + 1
        assert total_variation(extend_law(law, ctx, p, length), sequential_law(ctx, p, length)) < TV_LOSSLESS


def test_residual_matches_worked_example():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    acc = torch.minimum(torch.ones(3, dtype=torch.float64), p / q)
    assert torch.allclose(acc, torch.tensor([5 / 6, 1.0, 2 / 3], dtype=torch.float64), atol=1e-15)
    mass = q * acc
    assert torch.allclose(mass, torch.tensor([0.5, 0.1, 0.2], dtype=torch.float64), atol=1e-15)
    assert abs(float(mass.sum()) - 0.8) < 1e-15
    assert torch.equal(residual(p, q), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    # one child x ~ q: the emitted token has law p (A: 0.5 accepted; B: 0.1 accepted + 0.2 residual; C: 0.2)
    emitted = torch.zeros(3, dtype=torch.float64)
    for x in range(3):
        law = enumerate_law(lambda c: node_step(p, q, [x], Mode.SAMPLED, c, 0)[1])
        for t, w in law.items():
            emitted[t] += float(q[x]) * w
    assert torch.allclose(emitted, p, atol=1e-15)


def test_enumeration_is_exhaustive():
    # the enumerator sums to one and reproduces a known law on a two-coin program
    def prog(c):
        a = c.accept(0.25, 0, 0)
        b = c.draw(torch.tensor([0.2, 0.8], dtype=torch.float64), 0)
        return (a, b)

    law = enumerate_law(prog)
    expected = {(True, 0): 0.05, (True, 1): 0.2, (False, 0): 0.15, (False, 1): 0.6}
    assert set(law) == set(expected)
    assert all(abs(law[k] - v) < 1e-15 for k, v in expected.items())
