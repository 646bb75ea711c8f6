"""Verifier unit tests: worked example, edge cases, validation, batched == reference, statistics."""

import math
import random

import pytest
import torch
from scipy import stats

from vllm_tree_spec.reference.exact import enumerate_law
from vllm_tree_spec.tree import Tree, TreeBatch
from vllm_tree_spec.verify import (
    Mode,
    VerifyCoins,
    exponential,
    race,
    verify_batch,
    verify_tree,
    verify_tree_with_coins,
)

MODES = ["greedy", "deterministic", "sampled", "sampled_without_replacement"]
A, B, C = 0, 1, 2


class ScriptedCoins:
    """Uniforms from a list; draws by inverse CDF from a list (the textbook presentation)."""

    def __init__(self, uniforms, draws):
        self.u, self.d = list(uniforms), list(draws)

    def accept(self, ratio, depth, rank):
        return self.u.pop(0) < ratio

    def draw(self, p, depth):
        cdf = torch.cumsum(p / p.sum(), 0)
        return int((cdf <= self.d.pop(0)).sum())


def test_worked_example():
    """p = (.5, .3, .2), q = (.6, .1, .3); draft chain [A, C, B]; coins 0.7, 0.9, final 0.2 -> emits [A, B]."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    chain = Tree.chain(3, [A, C, B])
    target, draft = p.repeat(4, 1), q.repeat(4, 1)
    acc, nxt = verify_tree_with_coins(chain.parents, chain.tokens, target, draft, "sampled",
                                      ScriptedCoins([0.7, 0.9], [0.2]))
    assert acc == [0] and nxt == B  # emits [A, B]; discards [C, B]
    # 0.7 < 5/6 accepts A; 0.9 >= 2/3 rejects C; the residual is all on B, whatever the final draw
    coins = VerifyCoins.draw(1, 3, 1, 3, dtype=torch.float64)
    coins.uniform[0, 0, 0], coins.uniform[0, 1, 0] = 0.7, 0.9
    out = verify_batch(TreeBatch.from_trees([chain]), target, draft, "sampled", coins)
    assert out.accepted(0) == [0] and int(out.next_token[0]) == B
    assert out.output_token_ids[0].tolist() == [A, B, -1, -1]


# -- edge cases --------------------------------------------------------------------------------


def _coins(u_value, vocab=4, depth=3, k=3, favour=None):
    coins = VerifyCoins.draw(1, depth, k, vocab, dtype=torch.float64)
    coins.uniform.fill_(u_value)
    if favour is not None:  # make the race pick `favour` unless its probability is zero
        coins.exponential.fill_(1.0)
        coins.exponential[..., favour] = torch.finfo(torch.float64).tiny
    return coins


@pytest.mark.parametrize("mode", ["sampled", "sampled_without_replacement"])
def test_zero_probability_target_token_never_accepted(mode):
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 2, dtype=torch.float64)
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 2, dtype=torch.float64)
    tree = Tree([-1], [0])  # draft token 0 has p = 0
    coins = _coins(0.0)  # u = 0: the most accepting coin there is
    assert verify_tree_with_coins(tree.parents, tree.tokens, p, q, mode, coins)[0] == []
    out = verify_batch(TreeBatch.from_trees([tree]), p, q, mode, coins)
    assert int(out.num_accepted[0]) == 0 and int(out.next_token[0]) in (1, 2)


def test_zero_probability_token_never_drawn():
    p = torch.tensor([[0.0, 0.6, 0.4, 0.0]] * 2, dtype=torch.float64)
    tree = Tree([-1], [1])
    coins = _coins(0.5, favour=3)  # the race favours token 3, which has p = 0
    for mode in ["deterministic", "sampled"]:
        acc, nxt = verify_tree_with_coins(tree.parents, tree.tokens, p, p, mode, coins)
        assert nxt != 3 and nxt != 0
        out = verify_batch(TreeBatch.from_trees([tree]), p, p, mode, coins)
        assert int(out.next_token[0]) not in (0, 3)


def test_u_just_below_one():
    below_one = math.nextafter(1.0, 0.0)
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25]] * 2, dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    tree = Tree([-1], [2])
    coins = _coins(below_one)
    # ratio exactly 1 accepts even at u just below 1
    assert verify_tree_with_coins(tree.parents, tree.tokens, p, q, "sampled", coins)[0] == [0]
    assert verify_batch(TreeBatch.from_trees([tree]), p, q, "sampled", coins).accepted(0) == [0]
    # ratio just below 1 rejects at u just below 1
    q2 = q.clone()
    q2[0] = torch.tensor([0.25 - 1e-9, 0.25 - 1e-9, 0.25 + 2e-9, 0.25], dtype=torch.float64)
    assert verify_tree_with_coins(tree.parents, tree.tokens, p, q2, "sampled", coins)[0] == []
    assert verify_batch(TreeBatch.from_trees([tree]), p, q2, "sampled", coins).accepted(0) == []


@pytest.mark.parametrize("mode", MODES)
def test_root_only_tree(mode):
    p = torch.tensor([[0.1, 0.7, 0.2]], dtype=torch.float64)
    acc, nxt = verify_tree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), p, p, mode,
                           torch.Generator().manual_seed(0))
    assert acc == [] and nxt in (0, 1, 2)
    if mode == "greedy":
        assert nxt == 1
    empty = Tree([], [])
    two = Tree([-1, 0], [1, 1])
    batch = TreeBatch.from_trees([empty, two, empty])
    rows = torch.tensor([[0.1, 0.7, 0.2]] * 5, dtype=torch.float64)
    out = verify_batch(batch, rows, rows, mode)
    assert out.num_accepted[0] == 0 and out.num_accepted[2] == 0
    only_empty = verify_batch(TreeBatch.from_trees([empty, empty]), rows[:2], rows[:2], mode)
    assert only_empty.output_token_ids.shape == (2, 1)


def test_greedy_draft_equal_to_target_accepts_whole_path():
    torch.manual_seed(0)
    vocab, k = 7, 5
    logits = torch.randn(k + 1, vocab, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    chain = Tree.chain(k, p[:k].argmax(-1))
    acc, nxt = verify_tree(chain.parents, chain.tokens, p, None, "greedy", None)
    assert acc == list(range(k)) and nxt == int(p[k].argmax())


# -- validation -------------------------------------------------------------------------------


def test_validation_errors():
    p = torch.full((3, 4), 0.25, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    par, tok = torch.tensor([-1, 0]), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="earlier node"):
        verify_tree(torch.tensor([1, -1]), tok, p, None, "greedy", g)
    with pytest.raises(ValueError, match="not normalised"):
        verify_tree(par, tok, p * 2, None, "greedy", g)
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(par, tok, p, None, "sampled", g)
    with pytest.raises(ValueError, match="duplicate sibling"):
        verify_tree(torch.tensor([-1, -1]), torch.tensor([1, 1]), p, None, "deterministic", g)
    with pytest.raises(ValueError, match="duplicate sibling"):
        verify_tree(torch.tensor([-1, -1]), torch.tensor([1, 1]), p, p, "sampled_without_replacement", g)
    with pytest.raises(ValueError, match=r"\[N \+ 1, V\]"):
        verify_tree(par, tok, p[:2], None, "greedy", g)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_tree(par, torch.tensor([1, 9]), p, None, "greedy", g)
    with pytest.raises(ValueError, match="not one of"):
        verify_tree(par, tok, p, None, "typical", g)
    with pytest.raises(ValueError, match="negative"):
        verify_tree(par, tok, torch.log(p), None, "greedy", g)
    q = p.clone()
    q[0] = torch.tensor([0.5, 0.0, 0.25, 0.25])
    with pytest.raises(ValueError, match="zero probability under draft_probs"):
        verify_tree(par, tok, p, q, "sampled", g)
    with pytest.raises(ValueError, match="max_tokens"):
        verify_tree(par, tok, p, None, "greedy", g, max_tokens=0)
    # duplicates are legal for i.i.d. children and greedy
    verify_tree(torch.tensor([-1, -1]), torch.tensor([1, 1]), p, p, "sampled", g)
    verify_tree(torch.tensor([-1, -1]), torch.tensor([1, 1]), p, None, "greedy", g)


# -- batched == reference, bit for bit given the same coins ----------------------------------------


def random_tree(rng: random.Random, vocab: int, n: int, distinct=True) -> Tree:
    parents, nch = [], {}
    for i in range(n):
        ok = [c for c in range(-1, i) if nch.get(c, 0) < vocab]  # room for distinct siblings
        parents.append(rng.choice(ok))
        nch[parents[-1]] = nch.get(parents[-1], 0) + 1
    tree = Tree(torch.tensor(parents, dtype=torch.long))
    tokens = [0] * n
    for ch in tree.children:
        picks = rng.sample(range(vocab), len(ch)) if distinct else [rng.randrange(vocab) for _ in ch]
        for i, x in zip(ch, picks):
            tokens[i] = x
    return Tree(tree.parents, tokens)


def random_batch(rng, vocab, batch_size, max_nodes, dtype, sharp=2.0, distinct=True):
    trees = [random_tree(rng, vocab, rng.randint(0, max_nodes), distinct) for _ in range(batch_size)]
    batch = TreeBatch.from_trees(trees)
    rows = int(batch.cu_num_rows[-1])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    p = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * sharp, -1).to(dtype)
    q = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * sharp, -1).to(dtype)
    # a draft that sometimes agrees with the target: make some q rows equal to p
    same = torch.rand(rows, generator=g) < 0.3
    q[same] = p[same]
    # sampled modes need q > 0 on every drafted child
    q = (q + 1e-3) / (1 + 1e-3 * vocab)
    return trees, batch, p, q


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_equals_reference_with_same_coins(dtype):
    rng = random.Random(1234)
    for trial in range(40):
        vocab = rng.choice([3, 5, 17, 64])
        trees, batch, p, q = random_batch(rng, vocab, rng.randint(1, 6), rng.choice([1, 4, 12]), dtype)
        modes = [rng.choice(MODES) for _ in trees]
        eos = torch.tensor([rng.choice([-1, -1, rng.randrange(vocab)]) for _ in trees])
        max_tokens = torch.tensor([rng.choice([1, 2, 3, 100]) for _ in trees])
        coins = VerifyCoins.draw(len(trees), batch.max_depth, batch.max_children, vocab, dtype=dtype)
        out = verify_batch(batch, p, q, modes, coins, eos_token_id=eos, max_tokens=max_tokens)
        for b, tree in enumerate(trees):
            s, e = int(batch.cu_num_rows[b]), int(batch.cu_num_rows[b + 1])
            ref = verify_tree_with_coins(tree.parents, tree.tokens, p[s:e], q[s:e], modes[b], coins, b=b,
                                         eos_token_id=None if eos[b] < 0 else int(eos[b]),
                                         max_tokens=int(max_tokens[b]))
            assert (out.accepted(b), int(out.next_token[b])) == ref, (trial, b, modes[b], tree)
            emitted = [int(tree.tokens[i]) for i in ref[0]] + [ref[1]]
            assert out.output_token_ids[b, : len(emitted)].tolist() == emitted
            assert (out.output_token_ids[b, len(emitted):] == -1).all()
        again = verify_batch(batch, p, q, modes, coins, eos_token_id=eos, max_tokens=max_tokens)
        assert torch.equal(again.output_token_ids, out.output_token_ids)


def test_duplicate_siblings_in_sampled_mode_batched_equals_reference():
    rng = random.Random(99)
    for trial in range(20):
        trees, batch, p, q = random_batch(rng, 3, 4, 8, torch.float64, distinct=False)
        coins = VerifyCoins.draw(4, batch.max_depth, batch.max_children, 3, dtype=torch.float64)
        for mode in ["greedy", "sampled"]:
            out = verify_batch(batch, p, q, mode, coins)
            for b, tree in enumerate(trees):
                s, e = int(batch.cu_num_rows[b]), int(batch.cu_num_rows[b + 1])
                ref = verify_tree_with_coins(tree.parents, tree.tokens, p[s:e], q[s:e], mode, coins, b=b)
                assert (out.accepted(b), int(out.next_token[b])) == ref


def test_seeded_generators_are_reproducible():
    gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
    a = VerifyCoins.draw(3, 2, 2, 11, generators=gens)
    gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
    b = VerifyCoins.draw(3, 2, 2, 11, generators=gens)
    assert torch.equal(a.uniform[0], b.uniform[0]) and torch.equal(a.exponential[2], b.exponential[2])
    assert not torch.equal(a.uniform[1], b.uniform[1])
    assert (a.exponential > 0).all() and ((a.uniform >= 0) & (a.uniform < 1)).all()
    # a seeded request's coins do not depend on the rest of the batch
    alone = VerifyCoins.draw(1, 2, 2, 11, generators=[torch.Generator().manual_seed(8)])
    assert torch.equal(alone.uniform[0], a.uniform[2]) and torch.equal(alone.exponential[0], a.exponential[2])


def test_exponential_noise_is_exp1():
    g = torch.Generator().manual_seed(0)
    e = exponential((200_000,), dtype=torch.float64, generator=g)
    assert (e >= 0).all()
    assert stats.kstest(e.numpy(), "expon").pvalue > 1e-3
    # the race argmax(p / E) draws from p (chi-square over 20k draws)
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], dtype=torch.float64)
    draws = race(p.expand(20_000, -1), exponential((20_000, 6), dtype=torch.float32, generator=g))
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[5] == 0  # p = 0 is never drawn
    assert stats.chisquare(counts[:5].numpy(), (20_000 * p[:5]).numpy()).pvalue > 1e-3


# -- a chain is ordinary linear speculative sampling ---------------------------------------------


def linear_speculative_sampling(drafts, p, q, u, e):
    """Leviathan et al. Alg. 1, written independently.

    drafts [k]; p, q [k + 1, V]; u [k] uniforms; e [k + 1, V] exponentials for the
    final draw at the position where the round stops.
    """
    for i, x in enumerate(drafts):
        if not u[i] < min(1.0, float(p[i, x]) / float(q[i, x])):
            r = torch.clamp(p[i] - q[i], min=0)
            return drafts[:i], int((r / r.sum() / e[i]).argmax())
    k = len(drafts)
    return drafts, int((p[k] / e[k]).argmax())


def test_chain_is_linear_speculative_sampling():
    for trial in range(200):
        g = torch.Generator().manual_seed(trial)
        vocab, k = [4, 9, 50][trial % 3], 1 + trial % 6
        p = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
        q = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        coins = VerifyCoins.draw(1, k, 1, vocab, dtype=torch.float64)
        acc, nxt = linear_speculative_sampling(drafts, p, q, coins.uniform[0, :, 0].tolist(), coins.exponential[0])
        out = verify_batch(TreeBatch.from_trees([Tree.chain(k, drafts)]), p, q, "sampled", coins)
        assert out.output_token_ids[0, : len(acc) + 1].tolist() == acc + [nxt]
        assert int(out.num_accepted[0]) == len(acc)


# -- statistics: batched and generator-driven reference against the exact law --------------------


def _chi_square(counts: dict, law: dict, n: int) -> float:
    """Goodness-of-fit p-value; categories with expected count < 5 are pooled."""
    keys = sorted(law, key=lambda k: -law[k])
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for k in keys:
        if law[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(law[k] * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += law[k] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert sum(obs) == n
    return float(stats.chisquare(obs, exp).pvalue)


STAT_TREE = Tree([-1, -1, 0, 0, 2, 1], [0, 1, 2, 0, 1, 3])


def _check_batched_law(mode: str, n: int, seed: int, seeded: bool) -> None:
    """n copies of STAT_TREE through verify_batch; outcome counts against the exact law (chi-square)."""
    vocab = 5
    g = torch.Generator().manual_seed(seed)
    rows = STAT_TREE.num_nodes + 1
    p = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)
    law = enumerate_law(lambda c: (lambda r: (tuple(r[0]), r[1]))(
        verify_tree_with_coins(STAT_TREE.parents, STAT_TREE.tokens, p, q, mode, c)))
    batch = TreeBatch.from_trees([STAT_TREE] * n)
    coins = None  # default: lazy coins from the global RNG
    if seeded:  # per-request generators with lazily drawn exponential rows (the engine's coins)
        gens = [torch.Generator().manual_seed(10_000 + b) for b in range(n)]
        coins = VerifyCoins.draw(n, batch.max_depth, batch.max_children, vocab, generators=gens,
                                 dtype=torch.float64, lazy=True)
        assert coins.exponential is None
    torch.manual_seed(2024)
    out = verify_batch(batch, p.repeat(n, 1), q.repeat(n, 1), mode, coins)
    counts: dict = {}
    for b in range(n):
        key = (tuple(out.accepted_nodes[b, : int(out.num_accepted[b])].tolist()), int(out.next_token[b]))
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= {k for k, v in law.items() if v > 0}, "an impossible outcome was produced"
    assert _chi_square(counts, law, n) > 1e-3


@pytest.mark.stats
@pytest.mark.parametrize("mode", ["deterministic", "sampled", "sampled_without_replacement"])
def test_batched_matches_exact_law_chi_square(mode):
    _check_batched_law(mode, n=20000, seed=42, seeded=False)


@pytest.mark.stats
@pytest.mark.parametrize("mode", ["deterministic", "sampled_without_replacement"])
def test_lazy_seeded_coins_match_exact_law_chi_square(mode):
    _check_batched_law(mode, n=4000, seed=7, seeded=True)


@pytest.mark.stats
def test_generator_reference_matches_exact_law_chi_square():
    vocab, n = 4, 3000
    g0 = torch.Generator().manual_seed(5)
    rows = STAT_TREE.num_nodes + 1
    tokens = STAT_TREE.tokens % vocab
    tree = Tree(STAT_TREE.parents, [0, 1, 2, 0, 1, 3])
    p = torch.softmax(torch.randn(rows, vocab, generator=g0, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=g0, dtype=torch.float64), -1)
    law = enumerate_law(lambda c: (lambda r: (tuple(r[0]), r[1]))(
        verify_tree_with_coins(tree.parents, tree.tokens, p, q, "sampled", c)))
    g = torch.Generator().manual_seed(77)
    counts: dict = {}
    for _ in range(n):
        acc, nxt = verify_tree(tree.parents, tree.tokens, p, q, "sampled", g)
        counts[(tuple(acc), nxt)] = counts.get((tuple(acc), nxt), 0) + 1
    assert tokens.numel() == tree.num_nodes
    assert _chi_square(counts, law, n) > 1e-3


def test_all_greedy_target_probs_shortcut_equals_the_mixed_path():
    """`target_probs` skips the softmax when every row is greedy; rows must equal the general path's."""
    from vllm_tree_spec.sampling import target_probs

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    fast = target_probs(logits, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)
    mixed = target_probs(torch.cat([logits, logits[:1]]), temperature=torch.tensor([0.0] * 5 + [0.7]),
                         top_k=3, top_p=0.5, min_p=0.2)
    assert torch.equal(fast, mixed[:5])
    assert torch.equal(fast.argmax(-1), logits.argmax(-1)) and torch.equal(fast.sum(-1), torch.ones(5, dtype=fast.dtype))


def test_greedy_batch_from_argmax_rows_equals_the_distribution_path():
    """`target_argmax` (all-greedy batches skip the [R, V] p rows) gives the same result, EOS/budget cuts too."""
    rng = random.Random(21)
    for _ in range(30):
        vocab = rng.randint(2, 6)
        trees, batch, p, _ = random_batch(rng, vocab, rng.randint(1, 5), 8, torch.float64, sharp=4.0, distinct=False)
        eos = torch.tensor([rng.choice([-1, 0, 1]) for _ in trees])
        budget = torch.tensor([rng.randint(1, 6) for _ in trees])
        full = verify_batch(batch, p, None, "greedy", eos_token_id=eos, max_tokens=budget)
        fast = verify_batch(batch, None, None, "greedy", eos_token_id=eos, max_tokens=budget,
                            target_argmax=p.argmax(-1))
        for name in ("accepted_nodes", "num_accepted", "next_token", "output_token_ids"):
            assert torch.equal(getattr(full, name), getattr(fast, name)), name
    with pytest.raises(ValueError, match="target_probs is required"):
        verify_batch(batch, None, None, "sampled", target_argmax=p.argmax(-1))


def test_greedy_host_walk_equals_the_tensor_walk():
    """CPU all-greedy batches are walked on host lists; every output field equals the tensor walk's (and the
    sync-free one's) with duplicate siblings, stop-id lists, budgets and draftless requests, and the reference."""
    rng = random.Random(77)
    fields = ("accepted_nodes", "num_accepted", "next_token", "output_token_ids", "walked")
    for trial in range(60):
        vocab = rng.randint(2, 7)
        trees, batch, p, q = random_batch(rng, vocab, rng.randint(1, 6), rng.choice([0, 3, 9]), torch.float64,
                                          sharp=4.0, distinct=rng.random() < 0.5)
        stops = torch.tensor([[rng.choice([-1, -1, rng.randrange(vocab)]) for _ in range(2)] for _ in trees])
        budget = torch.tensor([rng.choice([1, 2, 3, 100]) for _ in trees])
        y = p.argmax(-1)
        kw = dict(eos_token_id=stops, max_tokens=budget, target_argmax=y)
        host = verify_batch(batch, None, None, "greedy", **kw)
        tensor = verify_batch(batch, None, None, "greedy", host_greedy=False, **kw)
        free = verify_batch(batch, None, None, "greedy", sync_free=True, **kw)
        for name in fields:
            assert torch.equal(getattr(host, name), getattr(tensor, name)), (trial, name)
            assert torch.equal(getattr(host, name), getattr(free, name)), (trial, name)
        coins = VerifyCoins.draw(len(trees), batch.max_depth, batch.max_children, vocab, dtype=torch.float64)
        for b, tree in enumerate(trees):
            s, e = int(batch.cu_num_rows[b]), int(batch.cu_num_rows[b + 1])
            ids = [int(t) for t in stops[b] if t >= 0]
            ref = verify_tree_with_coins(tree.parents, tree.tokens, p[s:e], q[s:e], "greedy", coins, b=b,
                                         eos_token_id=ids or None, max_tokens=int(budget[b]))
            assert (host.accepted(b), int(host.next_token[b])) == ref, (trial, b, tree)
    # root-only trees without tokens (every request draftless): the next token is each root row's argmax
    batch = TreeBatch.from_trees([Tree([]), Tree([])])
    y = torch.tensor([3, 5])
    host = verify_batch(batch, None, None, "greedy", target_argmax=y)
    tensor = verify_batch(batch, None, None, "greedy", target_argmax=y, host_greedy=False)
    for name in fields:
        assert torch.equal(getattr(host, name), getattr(tensor, name)), name
    assert host.next_token.tolist() == [3, 5]
