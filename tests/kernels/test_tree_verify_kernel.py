"""The Triton tree-verification kernel against `verify_batch`, integer outputs bit for bit.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py), so the
sizes are small; on a CUDA machine the same tests run natively.

Exactness contract (docs/kernels.md, "Tree verification"): every mode equals
`verify_batch` bit for bit (both reduce residual / without-replacement masses
with the order-independent fixed-point `row_sum` of verify/rules.py), `walked`
included. The serving path's form (lazy coins, stop-id lists, greedy from an
argmax) is tested in tests/integration/test_verify_kernel_path.py.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_tree_spec.tree import Tree, TreeBatch  # noqa: E402
from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402
from vllm_tree_spec.verify import Mode, VerifyCoins, row_sum, verify_batch, verify_tree_with_coins  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

load_kernels_package()
from vllm_tree_spec.kernels.tree_verify_launch import (  # noqa: E402
    TreeVerifyConfig,
    tree_verify_inputs,
    tree_verify_triton,
    verify_batch_triton,
)

MODES = ["greedy", "deterministic", "sampled", "sampled_without_replacement"]
SMALL = TreeVerifyConfig(block_v=16, num_warps=1)  # many vocabulary tiles on tiny vocabularies


# ---------------------------------------------------------------------------
# Inputs


def random_tree(rng: random.Random, vocab: int, n: int, distinct: bool = True, max_children: int = 4) -> Tree:
    parents, nch = [], {-1: 0}
    max_children = min(max_children, vocab) if distinct else max_children
    for i in range(n):
        cands = [c for c in [-1] + list(range(i)) if nch.get(c, 0) < max_children]
        p = rng.choice(cands)
        parents.append(p)
        nch[p] = nch.get(p, 0) + 1
    tree = Tree(torch.tensor(parents, dtype=torch.long))
    tokens = [0] * n
    for ch in tree.children:
        picks = rng.sample(range(vocab), len(ch)) if distinct else [rng.randrange(min(vocab, 3)) for _ in ch]
        for i, x in zip(ch, picks):
            tokens[i] = x
    return Tree(tree.parents, torch.tensor(tokens, dtype=torch.long))


def random_case(rng, vocab, batch_size, max_nodes, dtype, *, distinct=True, sharp=2.0, empty=False):
    trees = [random_tree(rng, vocab, 0 if empty else rng.randint(0, max_nodes), distinct) for _ in range(batch_size)]
    batch = TreeBatch.from_trees(trees)
    rows = int(batch.cu_num_rows[-1])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * sharp
    for b, t in enumerate(trees):  # make a child the target's favourite at half the rows: deeper walks
        for r, ch in enumerate(t.children):
            if ch and rng.random() < 0.5:
                logits[int(batch.cu_num_rows[b]) + r, int(t.tokens[rng.choice(ch)])] += 3 * sharp
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * sharp, -1)
    same = torch.rand(rows, generator=g) < 0.3  # drafts that sometimes agree with the target
    q[same] = p[same]
    q = (q + 1e-3) / (1 + 1e-3 * vocab)  # every drafted token has q > 0
    return trees, batch, p.to(dtype).to(DEVICE), q.to(dtype).to(DEVICE)


def outputs(o):
    return (o.output_token_ids, o.num_accepted, o.accepted_nodes, o.next_token, o.walked)


def assert_same(out, ref, msg=""):
    for name, a, b in zip(("output_token_ids", "num_accepted", "accepted_nodes", "next_token", "walked"),
                          outputs(out), outputs(ref)):  # fmt: skip
        assert a.dtype == torch.int64 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape, msg)
        assert torch.equal(a.cpu(), b.cpu()), (name, a.tolist(), b.tolist(), msg)


def extras(rng, batch_size, vocab):
    eos = torch.tensor([rng.choice([-1, -1, rng.randrange(vocab)]) for _ in range(batch_size)], device=DEVICE)
    max_tokens = torch.tensor([rng.choice([1, 2, 3, 100]) for _ in range(batch_size)], device=DEVICE)
    return dict(eos_token_id=eos, max_tokens=max_tokens)


# ---------------------------------------------------------------------------
# Random batches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_and_deterministic_equal_verify_batch(dtype):
    """No float reductions but argmax: bit-identical to verify_batch, duplicates included."""
    rng = random.Random(11)
    for trial in range(14):
        vocab = rng.choice([5, 37, 61, 250])
        bs = rng.randint(1, 6)
        trees, batch, p, q = random_case(rng, vocab, bs, rng.choice([3, 9, 14]), dtype,
                                         distinct=rng.random() < 0.6, sharp=rng.choice([0.5, 2.0, 6.0]))
        modes = [rng.choice(MODES[:2]) for _ in trees]
        coins = VerifyCoins.draw(bs, batch.max_depth, batch.max_children, vocab, dtype=dtype, device=DEVICE)
        kw = extras(rng, bs, vocab) if trial % 2 else {}
        ref = verify_batch(batch, p, None, modes, coins, **kw)
        cfg = SMALL if trial % 3 else None
        assert_same(verify_batch_triton(batch, p, None, modes, coins, config=cfg, **kw), ref, (trial, modes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_modes_equal_verify_batch(dtype):
    """Mixed modes, EOS / max_tokens cuts, duplicates (greedy / sampled), odd vocabularies: bit-identical."""
    rng = random.Random(5 if dtype == torch.float64 else 6)
    for trial in range(16):
        vocab = rng.choice([3, 17, 61, 129])
        bs = rng.randint(1, 6)
        distinct = rng.random() < 0.7
        trees, batch, p, q = random_case(rng, vocab, bs, rng.choice([4, 10, 14]), dtype, distinct=distinct)
        modes = [rng.choice(MODES if distinct else ["greedy", "sampled"]) for _ in trees]
        coins = VerifyCoins.draw(bs, batch.max_depth, batch.max_children, vocab, dtype=dtype, device=DEVICE)
        kw = extras(rng, bs, vocab) if trial % 2 else {}
        ref = verify_batch(batch, p, q, modes, coins, **kw)
        out = verify_batch_triton(batch, p, q, modes, coins, config=SMALL if trial % 2 else None, **kw)
        assert_same(out, ref, (trial, modes))


def test_matches_reference_walk_per_request():
    """The kernel also equals the one-request reference walk (verify_tree_with_coins) on its own slice."""
    rng = random.Random(3)
    trees, batch, p, q = random_case(rng, 23, 5, 10, torch.float64)
    modes = ["greedy", "deterministic", "sampled", "sampled_without_replacement", "sampled"]
    coins = VerifyCoins.draw(5, batch.max_depth, batch.max_children, 23, dtype=torch.float64, device=DEVICE)
    out = verify_batch_triton(batch, p, q, modes, coins, config=SMALL)
    for b, tree in enumerate(trees):
        s, e = int(batch.cu_num_rows[b]), int(batch.cu_num_rows[b + 1])
        acc, nxt = verify_tree_with_coins(tree.parents, tree.tokens, p[s:e].cpu(), q[s:e].cpu(), modes[b],
                                          VerifyCoins(coins.uniform.cpu(), coins.exponential.cpu()), b=b)  # fmt: skip
        assert (out.accepted(b), int(out.next_token[b])) == (acc, nxt)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.sampled_from([2, 9, 33, 100]),
       dtype=st.sampled_from([torch.float32, torch.float64]), block_v=st.sampled_from([16, 64, None]))
def test_property_random_batches(seed, vocab, dtype, block_v):
    rng = random.Random(seed)
    bs = rng.randint(1, 5)
    distinct = rng.random() < 0.7
    trees, batch, p, q = random_case(rng, vocab, bs, 11, dtype, distinct=distinct, sharp=rng.choice([0.3, 2.0, 8.0]))
    modes = [rng.choice(MODES if distinct else ["greedy", "sampled"]) for _ in trees]
    coins = VerifyCoins.draw(bs, batch.max_depth, batch.max_children, vocab, dtype=dtype, device=DEVICE)
    kw = extras(rng, bs, vocab) if rng.random() < 0.5 else {}
    cfg = None if block_v is None else TreeVerifyConfig(block_v, 1)
    assert_same(verify_batch_triton(batch, p, q, modes, coins, config=cfg, **kw),
                verify_batch(batch, p, q, modes, coins, **kw), (seed, modes))


# ---------------------------------------------------------------------------
# Structure edge cases


@pytest.mark.parametrize("mode", MODES)
def test_empty_trees(mode):
    """Root-only requests (D = 0): one token each, outputs [B, 1] and [B, 0]."""
    rng = random.Random(1)
    trees, batch, p, q = random_case(rng, 19, 3, 0, torch.float32, empty=True)
    coins = VerifyCoins.draw(3, 0, 0, 19, device=DEVICE)
    out = verify_batch_triton(batch, p, q, mode, coins, config=SMALL)
    assert out.output_token_ids.shape == (3, 1) and out.accepted_nodes.shape == (3, 0)
    assert_same(out, verify_batch(batch, p, q, mode, coins))


def test_duplicate_siblings_sampled_and_greedy():
    """i.i.d. children may repeat: every duplicate is processed (sampled) or the first match wins (greedy)."""
    rng = random.Random(8)
    for trial in range(6):
        trees, batch, p, q = random_case(rng, 3, 4, 8, torch.float64, distinct=False)
        coins = VerifyCoins.draw(4, batch.max_depth, batch.max_children, 3, dtype=torch.float64, device=DEVICE)
        for mode in ("greedy", "sampled"):
            ref = verify_batch(batch, p, q, mode, coins)
            assert_same(verify_batch_triton(batch, p, q, mode, coins), ref)


def test_greedy_full_acceptance_and_cuts():
    """A chain whose tokens are the target argmax is accepted whole; EOS / max_tokens cut it exactly."""
    vocab, k = 11, 4
    toks = [3, 7, 1, 9]
    p = torch.full((k + 1, vocab), 0.01, dtype=torch.float64)
    for r, t in enumerate(toks + [5]):
        p[r, t] = 1.0
    p = (p / p.sum(-1, keepdim=True)).to(DEVICE)
    batch = TreeBatch.from_trees([Tree.chain(k, toks)] * 3)
    p3 = p.repeat(3, 1)
    out = verify_batch_triton(batch, p3, None, "greedy")
    assert out.output_token_ids.tolist() == [[3, 7, 1, 9, 5]] * 3 and out.num_accepted.tolist() == [4] * 3
    eos = torch.tensor([1, -1, 5], device=DEVICE)
    mt = torch.tensor([100, 2, 100], device=DEVICE)
    out = verify_batch_triton(batch, p3, None, "greedy", eos_token_id=eos, max_tokens=mt)
    assert out.output_token_ids.tolist() == [[3, 7, 1, -1, -1], [3, 7, -1, -1, -1], [3, 7, 1, 9, 5]]
    assert out.num_accepted.tolist() == [2, 1, 4]
    assert out.accepted_nodes.tolist() == [[0, 1, -1, -1], [0, -1, -1, -1], [0, 1, 2, 3]]
    assert out.next_token.tolist() == [1, 7, 5]
    assert_same(out, verify_batch(batch, p3, None, "greedy", eos_token_id=eos, max_tokens=mt))


def test_argmax_ties_keep_first_index_across_tiles():
    vocab = 50
    p = torch.full((2, vocab), 1.0 / vocab, dtype=torch.float32)  # row 0: all tied -> 0
    p[1] = 0.0
    p[1, [21, 37]] = 0.5  # tie in different 16-wide tiles -> 21
    batch = TreeBatch.from_trees([Tree.chain(0), Tree.chain(0)])
    out = verify_batch_triton(batch, p.to(DEVICE), None, "greedy", config=SMALL)
    assert out.next_token.tolist() == [0, 21]
    assert_same(out, verify_batch(batch, p.to(DEVICE), None, "greedy"))


# ---------------------------------------------------------------------------
# Coin boundaries and degenerate residuals (SGLang #35771: strict <, reject p = 0)


def _one_child_case(p_row, q_row, x, mode, u):
    batch = TreeBatch.from_trees([Tree(torch.tensor([-1]), torch.tensor([x]))])
    p = torch.stack([p_row, p_row]).to(DEVICE)
    q = torch.stack([q_row, q_row]).to(DEVICE)
    coins = VerifyCoins.draw(1, 1, 1, p.shape[1], dtype=p.dtype, device=DEVICE)
    coins.uniform[0, 0, 0] = u
    return batch, p, q, coins


@pytest.mark.parametrize("mode", ["sampled", "sampled_without_replacement"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coin_at_ratio_rejects_just_below_accepts(mode, dtype):
    p_row = torch.tensor([0.1, 0.3, 0.6], dtype=dtype)
    q_row = torch.tensor([0.2, 0.7, 0.1], dtype=dtype)
    ratio = float(p_row[1] / q_row[1])  # the kernel forms it in the probability dtype, like verify_batch
    for u, accepted in ((ratio, 0), (math.nextafter(ratio, 0.0), 1), (0.0, 1)):
        batch, p, q, coins = _one_child_case(p_row, q_row, 1, mode, u)
        out = verify_batch_triton(batch, p, q, mode, coins)
        assert int(out.num_accepted[0]) == accepted, (u, ratio)
        assert_same(out, verify_batch(batch, p, q, mode, coins))


@pytest.mark.parametrize("mode", ["sampled", "sampled_without_replacement"])
def test_zero_probability_never_accepted_even_at_coin_zero(mode):
    p_row = torch.tensor([0.0, 0.4, 0.6], dtype=torch.float64)
    q_row = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    batch, p, q, coins = _one_child_case(p_row, q_row, 0, mode, 0.0)  # p(x) = 0
    out = verify_batch_triton(batch, p, q, mode, coins)
    assert int(out.num_accepted[0]) == 0 and int(out.next_token[0]) != 0
    q_row = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)  # q(x) = 0: reject, no division by zero
    batch, p, q, coins = _one_child_case(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), q_row, 0, mode, 0.0)
    out = verify_batch_triton(batch, p, q, mode, coins)
    assert int(out.num_accepted[0]) == 0
    assert_same(out, verify_batch(batch, p, q, mode, coins))


def test_all_zero_residual_keeps_p():
    """p <= q everywhere (possible only through rounding): the residual mass is 0 and p is kept."""
    q_row = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    p_row = q_row * (1 - 1e-3)  # unnormalised on purpose
    batch = TreeBatch.from_trees([Tree(torch.tensor([-1, -1]), torch.tensor([0, 1]))])
    p = torch.stack([p_row] * 3).to(DEVICE)
    q = torch.stack([q_row] * 3).to(DEVICE)
    for mode in ("sampled", "sampled_without_replacement"):
        coins = VerifyCoins.draw(1, 1, 2, 3, dtype=torch.float64, device=DEVICE)
        coins.uniform[0, 0] = 0.9999  # above both ratios (0.999): reject, reject
        ref = verify_batch(batch, p, q, mode, coins)
        assert int(ref.num_accepted[0]) == 0
        assert_same(verify_batch_triton(batch, p, q, mode, coins), ref)


def test_without_replacement_q_mass_exhausted():
    """q supported exactly on the drafted children: after rejecting both, q's mass is 0 (clamped to tiny)."""
    p_row = torch.tensor([0.05, 0.05, 0.3, 0.6], dtype=torch.float64)
    q_row = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    batch = TreeBatch.from_trees([Tree(torch.tensor([-1, -1]), torch.tensor([0, 1]))])
    p, q = torch.stack([p_row] * 3).to(DEVICE), torch.stack([q_row] * 3).to(DEVICE)
    coins = VerifyCoins.draw(1, 1, 2, 4, dtype=torch.float64, device=DEVICE)
    coins.uniform[0, 0] = 0.99
    mode = "sampled_without_replacement"
    ref = verify_batch(batch, p, q, mode, coins)
    assert int(ref.num_accepted[0]) == 0 and int(ref.next_token[0]) in (2, 3)
    assert_same(verify_batch_triton(batch, p, q, mode, coins), ref)


# ---------------------------------------------------------------------------
# The fixed-point row sum the kernel reproduces


def test_row_sum_is_order_independent():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.softmax(torch.randn(4, 1001, generator=g, dtype=torch.float64) * 4, -1).to(dtype)
        s = row_sum(x)
        perm = torch.randperm(1001, generator=g)
        assert torch.equal(row_sum(x[:, perm]), s)  # any order, same bits
        assert torch.equal(row_sum(x.flip(-1)), s)
        err = (s.double() - x.double().sum(-1, keepdim=True)).abs().max()
        assert err <= 1001 * 2.0**-60 + 4 * torch.finfo(dtype).eps
    assert float(row_sum(torch.tensor([0.19999999999999998, 0.0], dtype=torch.float64))) == 0.19999999999999998


# ---------------------------------------------------------------------------
# Launcher


def test_low_level_launcher_reuses_buffers_and_int64_inputs():
    """Preallocated outputs / workspace (CUDA-graph style) and int64 tree tensors give the same result."""
    rng = random.Random(4)
    trees, batch, p, q = random_case(rng, 33, 4, 9, torch.float32)
    modes = torch.tensor([0, 1, 2, 3], dtype=torch.int64, device=DEVICE)
    coins = VerifyCoins.draw(4, batch.max_depth, batch.max_children, 33, device=DEVICE)
    ref = verify_batch(batch, p, q, modes.cpu(), coins)
    tin = tree_verify_inputs(batch, DEVICE, dtype=torch.int64)
    d = tin.max_depth
    i64 = dict(dtype=torch.int64, device=DEVICE)
    out = (torch.full((4, d + 1), 7, **i64), torch.empty(4, **i64), torch.full((4, d), 7, **i64), torch.empty(4, **i64),
           torch.empty(4, **i64))
    ws = (torch.empty(4, 2, 33, device=DEVICE), torch.empty(4, 2, 33, device=DEVICE))
    for _ in range(2):
        res = tree_verify_triton(tin.cu_num_rows, tin.node_tokens, tin.first_child, tin.next_sibling, p, q, modes,
                                 coins.uniform, coins.exponential, max_depth=d, out=out, workspace=ws, config=SMALL)
        assert all(a is b for a, b in zip(res, out))
        assert_same(type(ref)(res[2], res[1], res[3], res[0], res[4]), ref)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="inspects compiled PTX (the interpreter divides with numpy)")
def test_compiled_kernel_divides_exactly():
    """Triton's fp32 `/` is div.full.f32 (approximate); the kernel must use IEEE division, no flush-to-zero."""
    from vllm_tree_spec.kernels.tree_verify import tree_verify_kernel

    rng = random.Random(0)
    trees, batch, p, q = random_case(rng, 64, 3, 6, torch.float32)
    verify_batch_triton(batch, p, q, ["greedy", "deterministic", "sampled_without_replacement"])
    ptxs = [k.asm["ptx"] for caches in tree_verify_kernel.device_caches.values() for k in caches[0].values()]
    assert ptxs
    for ptx in ptxs:
        assert "div.full" not in ptx and "div.approx" not in ptx and ".ftz" not in ptx
        assert "div.rn.f32" in ptx or "div.rn.f64" in ptx


def test_launcher_errors():
    rng = random.Random(0)
    trees, batch, p, q = random_case(rng, 9, 2, 4, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        verify_batch_triton(batch, p.half(), None, "greedy")
    with pytest.raises(ValueError, match="draft_probs"):
        verify_batch_triton(batch, p, None, "sampled")
    with pytest.raises(ValueError, match="must match"):
        verify_batch_triton(batch, p, q.double(), "sampled")
    with pytest.raises(ValueError, match="max_tokens"):
        verify_batch_triton(batch, p, None, "greedy", max_tokens=torch.tensor([0, 3]))
    small = VerifyCoins(torch.rand(2, 1, 1, dtype=torch.float64, device=DEVICE), torch.ones(2, 1, 9, device=DEVICE))
    if batch.max_depth >= 1:
        with pytest.raises(ValueError, match="cover"):
            verify_batch_triton(batch, p, q, "sampled", small)
    assert Mode.parse("greedy") == Mode.GREEDY


def test_bench_verify_commit_quick(tmp_path, monkeypatch):
    """The benchmark's quick mode runs end to end and its correctness gate passes."""
    import json
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
    monkeypatch.syspath_prepend(str(bench_dir))
    import run_all

    assert run_all.main(["--quick", "--only", "bench_verify_commit", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_verify_commit.json").read_text())
    assert report["correctness"] and all(c["ok"] for c in report["correctness"])
    assert any(r["provider"] == "verify_triton" and r["ms"] for r in report["results"])
    assert any(r["provider"] == "commit_triton" and r["ms"] for r in report["results"])
    assert any(r["provider"] == "verify_served" and r["ms"] for r in report["results"])
    assert any(r["provider"] == "verify_served_triton" and r["ms"] for r in report["results"])
    import bench_verify_commit as bench

    for mode in ("greedy", "deterministic", "sampled_without_replacement"):  # both served calls verify the same
        case = bench.make_verify_case(3, 4, 257, mode, torch.device("cpu"), seed=11)
        provs = bench.verify_providers(case, mode)
        ref = provs["verify_torch"]()
        assert_same(type(ref)(*(provs["verify_triton"]()[i] for i in (2, 1, 3, 0, 4))), ref)
        served = []
        for name in ("verify_served", "verify_served_triton"):
            torch.manual_seed(3)  # the same lazy coins for both
            served.append(provs[name]())
        assert_same(served[1], served[0], mode)
    sys.modules.pop("run_all", None)
    sys.modules.pop("bench_verify_commit", None)


@pytest.mark.parametrize("mode", ["sampled", "sampled_without_replacement"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coin_on_residual_boundary(mode, dtype):
    """After a rejection the next ratio depends on the residual mass to the last bit: put the coin exactly on it.

    The expected ratio is computed with the PyTorch twin (`row_sum`); u == ratio must reject and
    u == nextafter(ratio, 0) accept, in the kernel and in `verify_batch`. A kernel summing in a
    different float order (or dividing approximately) fails this on most seeds.
    """
    vocab = 4099
    g = torch.Generator().manual_seed(17)
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, -1).to(dtype)
    q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, -1).to(dtype)
    x1 = int(torch.argmin(p.double() / q.double()))  # p(x1) << q(x1): rejected at u = 0.9999
    r = (p - q).clamp(min=0)
    p1 = r / row_sum(r)
    q1 = q
    if mode == "sampled_without_replacement":
        q1 = q.scatter(0, torch.tensor([x1]), 0.0)
        q1 = q1 / row_sum(q1).clamp(min=torch.finfo(dtype).tiny)
    ratios = p1 / q1
    cands = ((ratios > 0.05) & (ratios < 0.95)).nonzero().flatten()
    x2 = int(cands[len(cands) // 2])
    ratio = float(ratios[x2])
    assert 0 < ratio < 1
    batch = TreeBatch.from_trees([Tree(torch.tensor([-1, -1]), torch.tensor([x1, x2]))])
    pp, qq = torch.stack([p] * 3).to(DEVICE), torch.stack([q] * 3).to(DEVICE)
    for u, accepted in ((ratio, 0), (math.nextafter(ratio, 0.0), 1)):
        coins = VerifyCoins.draw(1, 1, 2, vocab, dtype=dtype, device=DEVICE)
        coins.uniform[0, 0, 0] = 0.9999
        coins.uniform[0, 0, 1] = u
        ref = verify_batch(batch, pp, qq, mode, coins)
        out = verify_batch_triton(batch, pp, qq, mode, coins)
        assert int(ref.num_accepted[0]) == accepted
        assert_same(out, ref, (u, ratio))
