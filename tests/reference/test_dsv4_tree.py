"""Tree verification over DeepSeek-V4 compressed attention: path and commit invariants.

Tiny model: layers [SWA, CSA m=4, HCA m'=8, CSA m=4], window W=8, indexer top-2.
Positions p with (p + 1) % 4 == 0 complete a CSA entry, (p + 1) % 8 == 0 an HCA
entry, so depth <= 8 trees over prefixes of 0..40 tokens cross both kinds of
boundary, with pooling windows and sliding windows reaching back into
committed rows.

Invariants (float64):
  path    every tree row's logits == one-token sequential decoding along its path
  commit  after committing an accepted path, every cache buffer == the state
          sequential decoding of root + path produces
  rounds  tree -> verify -> commit repeated == plain greedy decoding, token for token
and the negative control: a plain tree mask over position-addressed compressor
state (no scratch isolation) gets boundary-crossing branches wrong.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_tree_spec.reference import dsv4_tree as dt
from vllm_tree_spec.reference.dsv4 import DSV4Model
from vllm_tree_spec.reference.dsv4_cache import DSV4Cache
from vllm_tree_spec.tree import Tree
from vllm_tree_spec.verify import verify_tree

VOCAB = 64
MAX_LEN = 64
PATH_TOL = 1e-10
STATE_TOL = 1e-12

# random trees and batches per property: 20 in the default run, 60 in the extended set (docs/testing.md)
SETTINGS = settings(max_examples=60 if os.environ.get("VLLM_TREE_SPEC_EXTENDED") == "1" else 20, deadline=None,
                    derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# Helpers


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(model: DSV4Model, lengths: list[int], seed: int, dtype=torch.float64) -> DSV4Cache:
    cache = DSV4Cache.empty(model.cfg, len(lengths), MAX_LEN, dtype)
    dt.prefill(model, cache, [_tokens(n, seed + b) for b, n in enumerate(lengths)])
    return cache


def snapshot(cache: DSV4Cache) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in layer.tensors.items()} for layer in cache.layers]


def same_incl_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def assert_states_close(got: DSV4Cache, want: DSV4Cache, b_got: int, b_want: int, tol: float = STATE_TOL):
    assert int(got.lengths[b_got]) == int(want.lengths[b_want])
    g, w = got.committed(b_got), want.committed(b_want)
    assert g.keys() == w.keys()
    for key in w:
        assert g[key].shape == w[key].shape, key
        assert torch.allclose(g[key], w[key], atol=tol, rtol=0), (key, (g[key] - w[key]).abs().max())


def sequential_commit(model: DSV4Model, cache: DSV4Cache, b: int, chain: list[int]) -> None:
    for tok in chain:  # one token at a time: plain decoding
        dt.decode(model, cache, [tok], [b])


@st.composite
def trees(draw, max_nodes: int = 12, max_depth: int = 8) -> Tree:
    """Random parent arrays (0 nodes = a plain decode step), biased towards deep branches."""
    n = draw(st.integers(0, max_nodes))
    parents, depth = [], []
    for i in range(n):
        if i and depth[i - 1] < max_depth and draw(st.integers(0, 2)) > 0:
            p = i - 1  # extend the newest branch
        else:
            p = draw(st.sampled_from([-1] + [j for j in range(i) if depth[j] < max_depth]))
        parents.append(p)
        depth.append(1 if p == -1 else depth[p] + 1)
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return Tree(torch.tensor(parents, dtype=torch.long), torch.tensor(tokens, dtype=torch.long))


@st.composite
def batches(draw, max_requests: int = 3):
    """(prefix lengths, roots, trees) for 1..3 requests."""
    k = draw(st.integers(1, max_requests))
    lengths = [draw(st.integers(0, 40)) for _ in range(k)]
    roots = [draw(st.integers(0, VOCAB - 1)) for _ in range(k)]
    return lengths, roots, [draw(trees()) for _ in range(k)]


def describe(P: int, tree: Tree) -> None:
    """Record which boundaries a tree crosses (hypothesis statistics)."""
    pos = (P + tree.depth).tolist()
    for name, m in (("CSA", 4), ("HCA", 8)):
        done = [p for p in pos if (p + 1) % m == 0]
        if done:
            event(f"a node completes a {name} block")
        if len(set(done)) < len(done):
            event(f"two branches complete the same {name} block")
    if tree.num_nodes and tree.max_depth >= 6:
        event("depth >= 6")


# ---------------------------------------------------------------------------
# A hand-made tree that hits every case at once
#
#   P = 5 (root at 5):   positions 7, 11 complete CSA entries; 7 also the HCA entry w = 0
#
#   root(5) ── n0(6) ── n1(7)* ── n3(8) ── n4(9) ── n5(10) ── n6(11)* ── n7(12) ── n8(13)
#          │         └─ n2(7)*                                             (depth 8)
#          └─ n9(6) ── n10(7)* ── n11(8)
#
#   n1, n2 (siblings) and n10 (cousin) each complete CSA w=1 and HCA w=0 with a
#   different pooling window; n6's CSA w=2 pools a halves of 4..7 (committed 4,
#   root, n0, n1) and b halves of 8..11.

HAND_PARENTS = [-1, 0, 0, 1, 3, 4, 5, 6, 7, -1, 9, 10]


def hand_tree(seed: int = 0) -> Tree:
    return Tree(torch.tensor(HAND_PARENTS), torch.tensor(_tokens(len(HAND_PARENTS), seed)))


@pytest.mark.parametrize("P", [0, 5, 9, 30])
def test_hand_tree_rows_equal_sequential_decode(model, P):
    tree = hand_tree()
    cache = prefilled(model, [P], seed=P)
    cache.poison_uncommitted()  # any read of an uncommitted row would turn into NaN
    before = snapshot(cache)
    step = dt.tree_forward(model, cache, [7], [tree])
    want = dt.sequential_tree_logits(model, cache, 0, 7, tree)
    assert torch.allclose(step.request_logits(0), want, atol=PATH_TOL, rtol=0)
    # the tree forward writes nothing persistent
    for layer, snap in zip(cache.layers, before):
        assert all(same_incl_nan(layer.tensors[k], v) for k, v in snap.items())
    if P == 5:  # the case drawn above: siblings' entries are branch-specific
        entries = step.scratch[1].entries  # CSA layer, rows = 1 + node
        assert not torch.allclose(entries[1 + 1], entries[1 + 2]) and not torch.allclose(entries[2], entries[11])


def test_tree_rows_float32(cfg):
    model32 = DSV4Model(cfg, torch.float32, seed=0)
    cache = prefilled(model32, [5, 13], seed=3, dtype=torch.float32)
    trees_ = [hand_tree(1), hand_tree(2)]
    step = dt.tree_forward(model32, cache, [7, 8], trees_)
    for j, tree in enumerate(trees_):
        want = dt.sequential_tree_logits(model32, cache, j, [7, 8][j], tree)
        assert torch.allclose(step.request_logits(j), want, atol=2e-4, rtol=0)


# ---------------------------------------------------------------------------
# Path invariant, random trees and batches


@SETTINGS
@given(batch=batches(), seed=st.integers(0, 10_000))
def test_tree_rows_equal_sequential_decode(model, batch, seed):
    lengths, roots, trees_ = batch
    cache = prefilled(model, lengths, seed)
    cache.poison_uncommitted()
    step = dt.tree_forward(model, cache, roots, trees_)
    for j, (P, root, tree) in enumerate(zip(lengths, roots, trees_)):
        describe(P, tree)
        want = dt.sequential_tree_logits(model, cache, j, root, tree)
        err = (step.request_logits(j) - want).abs().max()
        assert err < PATH_TOL, (j, float(err))


# ---------------------------------------------------------------------------
# Commit invariant


def _expected_bytes(cfg, P: int, n: int, itemsize: int) -> int:
    """Commit copies n per-token rows of every buffer, plus the entries the path completes."""
    total = 0
    for i in range(cfg.num_hidden_layers):
        m = cfg.compress_ratio(i)
        c, ci = cfg.head_dim, cfg.index_head_dim
        total += n * c  # window KV row
        if cfg.layer_kind(i) != "swa":
            coff = 2 if m == 4 else 1
            total += n * 2 * coff * c + sum((P + k + 1) % m == 0 for k in range(n)) * c
        if cfg.layer_kind(i) == "csa":
            total += n * 2 * 2 * ci + sum((P + k + 1) % 4 == 0 for k in range(n)) * ci
    return total * itemsize


@SETTINGS
@given(batch=batches(), seed=st.integers(0, 10_000), picks=st.lists(st.integers(-1, 11), min_size=3, max_size=3))
def test_commit_equals_sequential_state(model, batch, seed, picks):
    lengths, roots, trees_ = batch
    cache = prefilled(model, lengths, seed)
    cache.poison_uncommitted()  # a row the commit forgets to write stays NaN and fails the comparison
    want, replay = cache.clone(), cache.clone()
    step = dt.tree_forward(model, cache, roots, trees_)
    # accepted path = root-to-node path of a random node (or none: only the root is committed)
    accepted = [tree.path_to(p % tree.num_nodes) if p >= 0 and tree.num_nodes else [] for p, tree in zip(picks, trees_)]
    moved = dt.commit(cache, step, accepted)

    for j, (root, tree, acc) in enumerate(zip(roots, trees_, accepted)):
        chain = [root] + [int(tree.tokens[a]) for a in acc]
        sequential_commit(model, want, j, chain)
        assert_states_close(cache, want, j, j)
    assert moved.written == sum(_expected_bytes(model.cfg, P, 1 + len(acc), 8) for P, acc in zip(lengths, accepted))

    # the replay baseline reaches the same state, and its logits are the tree rows of the path
    replay_logits = dt.commit_by_replay(model, replay, step, accepted)
    for j, acc in enumerate(accepted):
        assert_states_close(replay, want, j, j)
        rows = step.request_logits(j)[[0] + [a + 1 for a in acc]]
        assert torch.allclose(replay_logits[j], rows, atol=PATH_TOL, rtol=0)


def test_commit_rejects_a_non_path(model):
    cache = prefilled(model, [6], seed=0)
    step = dt.tree_forward(model, cache, [1], [hand_tree()])
    with pytest.raises(ValueError, match="not a path"):
        dt.commit(cache, step, [[0, 2, 3]])  # n3's parent is n1, not n2
    with pytest.raises(ValueError, match="not a path"):
        dt.commit(cache, step, [[1]])  # n1 is not a child of the root
    dt.commit(cache, step, [[0, 1, 3]])
    with pytest.raises(ValueError, match="moved from length 6"):
        dt.commit(cache, step, [[0]])  # a step can be committed once


# ---------------------------------------------------------------------------
# Several rounds: tree -> verify -> commit == greedy decoding


def greedy_reference(model, cache: DSV4Cache, b: int, first: int, n: int) -> list[int]:
    """n tokens after `first` (the pending root) by plain greedy decoding."""
    state, out, tok = cache.select([b]), [], first
    for _ in range(n):
        tok = int(dt.decode(model, state, [tok])[0].argmax())
        out.append(tok)
    return out


def draft_tree(gen: torch.Generator, emitted: list[int], target: list[int], max_nodes: int = 10) -> Tree:
    """A random tree that contains the true continuation along a random branch some of the time.

    `target` is the greedy continuation still to come; a node whose path so far
    matches it gets the right next token with probability 1/2, at a random
    sibling rank, so accepted paths are of every length and often off the first child.
    """
    n = int(torch.randint(1, max_nodes + 1, (1,), generator=gen))
    parents, tokens, on_track = [], [], []
    for i in range(n):
        p = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        depth = 0 if p == -1 else len(Tree(torch.tensor(parents[: p + 1])).path_to(p))
        good = (p == -1 or on_track[p]) and depth < len(target) and bool(torch.rand((), generator=gen) < 0.5)
        tokens.append(target[depth] if good else int(torch.randint(0, VOCAB, (1,), generator=gen)))
        parents.append(p)
        on_track.append((p == -1 or on_track[p]) and depth < len(target) and tokens[-1] == target[depth])
    return Tree(torch.tensor(parents), torch.tensor(tokens))


@pytest.mark.parametrize("lengths", [[3, 17, 29], [0, 7, 12]])
def test_rounds_reproduce_greedy_decoding(model, lengths):
    n_new = 26
    cache = prefilled(model, lengths, seed=sum(lengths))
    roots = [int(torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(b))) for b in range(3)]
    want = [greedy_reference(model, cache, b, roots[b], n_new) for b in range(3)]
    seq_final = cache.clone()
    for b in range(3):
        sequential_commit(model, seq_final, b, [roots[b]] + want[b][:-1])

    gen = torch.Generator().manual_seed(123)
    emitted: list[list[int]] = [[], [], []]
    accepted_lengths = []
    while min(len(e) for e in emitted) < n_new:
        live = [b for b in range(3) if len(emitted[b]) < n_new]  # finished requests sit the round out
        trees_ = [draft_tree(gen, emitted[b], want[b][len(emitted[b]):]) for b in live]
        step = dt.tree_forward(model, cache, [roots[b] for b in live], trees_, requests=live)
        accepted = []
        for j, (b, tree) in enumerate(zip(live, trees_)):
            probs = torch.softmax(step.request_logits(j), dim=-1)
            acc, nxt = verify_tree(tree.parents, tree.tokens, probs, None, "greedy", None)
            accepted.append(acc)
            accepted_lengths.append(len(acc))
            emitted[b] += [int(tree.tokens[a]) for a in acc] + [nxt]
            roots[b] = nxt
        dt.commit(cache, step, accepted)
    for b in range(3):
        assert emitted[b][:n_new] == want[b]
    assert max(accepted_lengths) >= 2 and 0 in accepted_lengths  # both long and empty acceptances happened
    # a request that emitted exactly n_new tokens has committed root + all but the last: compare its state
    for b in range(3):
        if len(emitted[b]) == n_new:
            assert_states_close(cache, seq_final, b, b)


def test_linear_speculation_rolls_back_by_length(model):
    """Chains need no scratch: stock position-addressed verify + rollback == greedy (note §4)."""
    cache = prefilled(model, [10, 3], seed=5)
    roots = [11, 12]
    want = [greedy_reference(model, cache, b, roots[b], 20) for b in range(2)]
    gen = torch.Generator().manual_seed(7)
    emitted = [[], []]
    while min(len(e) for e in emitted) < 20:
        for b in range(2):
            target = want[b][len(emitted[b]):]
            k = 5
            drafts = [target[i] if i < len(target) and torch.rand((), generator=gen) < 0.7
                      else int(torch.randint(0, VOCAB, (1,), generator=gen)) for i in range(k)]
            P = int(cache.lengths[b])
            logits = dt.run_linear(model, cache, [[roots[b]] + drafts], [b])[0]  # writes rows P .. P+k
            greedy = logits.argmax(-1).tolist()
            a = 0
            while a < k and drafts[a] == greedy[a]:
                a += 1
            emitted[b] += drafts[:a] + [greedy[a]]
            roots[b] = greedy[a]
            cache.lengths[b] = P + 1 + a  # roll back: the k - a rejected rows stay, stale, above the length
    for b in range(2):
        assert emitted[b][:20] == want[b]


# ---------------------------------------------------------------------------
# Negative control


def test_plain_tree_mask_without_scratch_isolation_is_wrong(model):
    P = 5
    tree = hand_tree()
    cache = prefilled(model, [P], seed=P)
    want = dt.sequential_tree_logits(model, cache, 0, 7, tree)
    naive = dt.naive_tree_forward(model, cache.clone(), [7], [tree])
    err = (naive - want).abs().amax(dim=-1)  # [1 + N] per row
    # Rows before any block completes are right; n1 completes CSA w=1 / HCA w=0 and is
    # overwritten by its sibling n2 and cousin n10 (same positions), so n1's subtree is wrong.
    assert float(err[: 1 + 1].max()) < PATH_TOL
    assert float(err[1 + 3 :].max()) > 1e-3, err
    # The same policy is exact on a chain (no two nodes share a position), so the
    # mismatch above comes from branching, not from a broken control.
    chain = Tree.chain(8, _tokens(8, 1))
    want_chain = dt.sequential_tree_logits(model, cache, 0, 7, chain)
    assert torch.allclose(dt.naive_tree_forward(model, cache.clone(), [7], [chain]), want_chain, atol=PATH_TOL, rtol=0)
