"""DeepSeek-V4 compressor pooling along tree paths: twin vs the reference model, kernel vs twin.

  * twin == `reference.dsv4.Compressor.pool` (float64, 1e-12) on random windows with masked slots,
    CSA (overlapped a/b halves) and HCA;
  * kernel == twin (float32 state, fp32 / bf16 entries) over block-completing rows of random
    trees, windows streamed in several BLOCK_T tiles, odd widths, rows that must stay untouched;
  * end to end: a tree forward of the tiny reference model writes branch-specific entries and
    indexer keys into scratch; the metadata kernels (pooling gather along the ancestor path,
    write slots) + this kernel recompute exactly those from the state rows (committed rows and
    the ancestors' scratch rows mixed), for every CSA / HCA layer.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from vllm_tree_spec.reference import dsv4_tree as dt  # noqa: E402
from vllm_tree_spec.reference.dsv4 import Compressor, DSV4Model, rope  # noqa: E402
from vllm_tree_spec.reference.dsv4_cache import DSV4Cache  # noqa: E402
from vllm_tree_spec.reference.dsv4_config import DSV4Config  # noqa: E402
from vllm_tree_spec.tree import Tree, TreeBatch  # noqa: E402
from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

load_kernels_package()
from vllm_tree_spec.kernels.dsv4_compress_launch import (  # noqa: E402
    dsv4_compress_reference,
    dsv4_compress_triton,
    rope_cos_sin_table,
)
from vllm_tree_spec.kernels.dsv4_tree_meta_launch import (  # noqa: E402
    DSV4TreeRows,
    tree_entry_slots_triton,
    tree_window_slots_triton,
)

EPS = 1e-6
THETA = 160000.0


def make_compressor(ratio: int, d: int, rope_dim: int, seed: int, dtype=torch.float64) -> Compressor:
    comp = Compressor(8, d, ratio, rope_dim, EPS).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g, dtype=dtype))
    return comp


def random_state(num_slots: int, width: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_slots, width, generator=g, dtype=dtype)
    score = 2 * torch.randn(num_slots, width, generator=g, dtype=dtype)  # spread gates: peaked softmaxes too
    return kv, score


def random_windows(rng: random.Random, rows: int, ratio: int, coff: int, num_slots: int):
    """positions, gather [R, coff*m] (some rows complete a block, CSA w = 0 rows have no a half), write slots."""
    g = coff * ratio
    pos, gather, write = [], [], []
    for i in range(rows):
        w = rng.choice([0, 1, 2, 37])
        t = (w + 1) * ratio - 1 if rng.random() < 0.7 else (w + 1) * ratio - 1 - rng.randint(1, ratio - 1)
        slots = rng.sample(range(num_slots), g)
        lo = t - g + 1
        slots = [s if lo + j >= 0 and rng.random() > 0.1 else -1 for j, s in enumerate(slots)]
        slots[-1] = rng.randrange(num_slots)  # the row itself is always there
        pos.append(t)
        gather.append(slots)
        write.append(i if rng.random() > 0.1 else -1)
    lt = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return lt(pos), lt(gather), lt(write)


# ---------------------------------------------------------------------------
# twin == reference pooling


@pytest.mark.parametrize("ratio,coff,d,rope_dim", [(4, 2, 16, 8), (8, 1, 16, 8), (128, 1, 32, 8), (4, 2, 24, 6)])
def test_twin_equals_reference_pool(ratio, coff, d, rope_dim):
    rng = random.Random(ratio + d)
    comp = make_compressor(ratio, d, rope_dim, seed=1)
    kv, score = random_state(300, coff * d, seed=2, dtype=torch.float64)
    pos, gather, write = random_windows(rng, 12, ratio, coff, 300)
    out = torch.full((12, d), float("nan"), dtype=torch.float64)
    table = rope_cos_sin_table(THETA, rope_dim, int(pos.max()) + 1, dtype=torch.float64)
    rows = dsv4_compress_reference(out, kv, score, gather, pos, write, comp.norm.weight, table, ratio=ratio, eps=EPS)
    assert rows.numel() > 0
    g = gather[rows]
    valid = g >= 0
    want = comp.pool(kv[g.clamp(min=0)] * valid[..., None], score[g.clamp(min=0)], valid, pos[rows] + 1 - ratio,
                     THETA)  # fmt: skip
    assert torch.allclose(out[write[rows]], want, atol=1e-12, rtol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[write[rows]] = False
    assert bool(out[untouched].isnan().all())


def test_rope_table_matches_reference_rope():
    x = torch.randn(5, 16, dtype=torch.float64)
    positions = torch.tensor([0, 4, 128, 4096, 1_000_000])
    table = rope_cos_sin_table(THETA, 8, 1_000_001, dtype=torch.float64)[positions]
    cos, sin = table[:, :4], table[:, 4:]
    ev, od = x[:, 8::2], x[:, 9::2]
    mine = torch.cat((x[:, :8], torch.stack((ev * cos - od * sin, ev * sin + od * cos), -1).flatten(-2)), -1)
    assert torch.allclose(mine, rope(x, positions, THETA, 8), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------
# kernel == twin


@pytest.mark.parametrize(
    "ratio,coff,d,rope_dim,block_t,out_dtype",
    [(4, 2, 16, 8, None, torch.float32), (4, 2, 16, 8, 2, torch.bfloat16), (8, 1, 32, 8, 4, torch.float32),
     (16, 1, 24, 6, None, torch.float32), (128, 1, 16, 4, 32, torch.float16), (4, 2, 128, 64, None, torch.float32)],
)  # fmt: skip
def test_kernel_matches_twin(ratio, coff, d, rope_dim, block_t, out_dtype):
    rng = random.Random(ratio * 1000 + d)
    n_slots, r = 400, 10
    kv, score = random_state(n_slots, coff * d, seed=ratio + d)
    pos, gather, write = random_windows(rng, r, ratio, coff, n_slots)
    weight = 1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(5))
    table = rope_cos_sin_table(THETA, rope_dim, int(pos.max()) + 1)
    want = torch.full((r + 3, d), float("nan"), dtype=out_dtype)
    emitted = dsv4_compress_reference(want, kv, score, gather, pos, write, weight, table, ratio=ratio, eps=EPS)
    got = torch.full((r + 3, d), float("nan"), dtype=out_dtype, device=DEVICE)
    dsv4_compress_triton(got, kv.to(DEVICE), score.to(DEVICE), gather.to(DEVICE), pos.to(DEVICE),
                         write.to(DEVICE), weight.to(DEVICE), table.to(DEVICE), ratio=ratio, eps=EPS,
                         block_t=block_t)  # fmt: skip
    got = got.cpu()
    assert emitted.numel() > 0
    tol = 1e-5 if out_dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol, equal_nan=True), (got - want).abs().max()


def test_state_as_views_of_one_cache_and_int32_indices():
    """vLLM keeps [kv | score] in one fp32 state row; column views of it work, int32 index tensors too."""
    rng = random.Random(3)
    d, ratio = 16, 4
    state = torch.randn(64, 4 * d, generator=torch.Generator().manual_seed(0))  # [slots, kv (2d) | score (2d)]
    kv, score = state[:, : 2 * d], state[:, 2 * d :]
    pos, gather, write = random_windows(rng, 6, ratio, 2, 64)
    weight, table = torch.ones(d), rope_cos_sin_table(THETA, 8, int(pos.max()) + 1)
    want = torch.zeros(6, d)
    dsv4_compress_reference(want, kv, score, gather, pos, write, weight, table, ratio=ratio, eps=EPS)
    got = torch.zeros(6, d, device=DEVICE)
    st = state.to(DEVICE)
    dsv4_compress_triton(got, st[:, : 2 * d], st[:, 2 * d :], gather.int().to(DEVICE), pos.int().to(DEVICE),
                         write.int().to(DEVICE), weight.to(DEVICE), table.to(DEVICE), ratio=ratio, eps=EPS)  # fmt: skip
    assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# end to end: the reference model's tree forward


def test_tree_forward_entries_recomputed_by_kernels():
    cfg = DSV4Config()  # [SWA, CSA 4, HCA 8, CSA 4], W = 8
    model = DSV4Model(cfg, torch.float32, seed=2)
    B, S = 3, 64
    starts = [3, 13, 30]
    cache = DSV4Cache.empty(cfg, B, S, torch.float32)
    g = torch.Generator().manual_seed(0)
    dt.prefill(model, cache, [torch.randint(0, 64, (n,), generator=g).tolist() for n in starts])
    cache.poison_uncommitted()
    # siblings and cousins completing the same CSA / HCA blocks, and deep branches
    parents = [[-1, 0, 0, 1, 3, 4, 5, 6, 7, -1, 9, 10], [-1, -1, 0, 1, 1, 2, 3, 5, 6], [-1, 0, 1, 2, 2, 4, 3]]
    trees = [Tree(torch.tensor(p), torch.randint(0, 64, (len(p),), generator=g)) for p in parents]
    step = dt.tree_forward(model, cache, [5, 6, 7], trees)
    rows = DSV4TreeRows.from_tree_batch(TreeBatch.from_trees(trees), starts, device=DEVICE)
    r = rows.num_rows
    pos = rows.positions.to(DEVICE)
    bt = torch.arange(B, device=DEVICE)[:, None]
    checked = set()
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if attn.compressor is None:
            continue
        m = attn.ratio
        coff = 2 if m == 4 else 1
        state_slots = B * S + torch.arange(r, device=DEVICE)
        gather, _ = tree_window_slots_triton(rows, state_slots, bt, S, coff * m, align="position")
        entry = tree_entry_slots_triton(rows, B * (S // m) + torch.arange(r, device=DEVICE), bt, S // m, m)
        comps = [(attn.compressor, "", "entries")]
        if attn.indexer is not None:
            comps.append((attn.indexer.compressor, "idx_", "idx_keys"))
        for comp, prefix, name in comps:
            layer, scratch = cache.layers[i].tensors, step.scratch[i].tensors
            kv, score = (torch.cat((layer[prefix + n].reshape(B * S, -1), scratch[prefix + n])).to(DEVICE)
                         for n in ("state_kv", "state_score"))  # fmt: skip
            out = torch.full((B * (S // m) + r, comp.head_dim), float("nan"), device=DEVICE)
            table = rope_cos_sin_table(attn.theta, comp.rope_dim, S, device=DEVICE)
            dsv4_compress_triton(out, kv, score, gather, pos, entry.write, comp.norm.weight.to(DEVICE), table,
                                 ratio=m, eps=cfg.rms_norm_eps)  # fmt: skip
            emit = (entry.write >= 0).nonzero().flatten().cpu()
            assert torch.equal(emit, step.plan.ratios[m].emit_rows)
            got = out[B * (S // m) + emit.to(DEVICE)].cpu()
            want = scratch[name][emit]
            assert torch.allclose(got, want, atol=2e-5, rtol=2e-5), (i, name, (got - want).abs().max())
            assert bool(out[: B * (S // m)].isnan().all())  # nothing persistent written
            checked.add((m, name, len(set(int(pos[e]) for e in emit)) < len(emit)))
    # both ratios, both entry kinds, and sibling entries of the same block were exercised
    assert {(4, "entries", True), (4, "idx_keys", True), (8, "entries", True)} <= checked


def test_errors():
    out = torch.zeros(4, 16, device=DEVICE)
    kv = torch.zeros(8, 32, device=DEVICE)
    idx = torch.zeros(2, 8, dtype=torch.long, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    table = torch.zeros(4, 8, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="ratio is 4"):
        dsv4_compress_triton(out, kv, kv, idx, pos, pos, w, table, ratio=8, eps=EPS)
    with pytest.raises(ValueError, match="gather"):
        dsv4_compress_triton(out, kv, kv, idx[:, :4], pos, pos, w, table, ratio=4, eps=EPS)
    with pytest.raises(ValueError, match="not 1 or 2"):
        dsv4_compress_triton(out, torch.zeros(8, 40, device=DEVICE), kv, idx, pos, pos, w, table, ratio=4, eps=EPS)
    with pytest.raises(TypeError, match="int32/int64"):
        dsv4_compress_triton(out, kv, kv, idx.float(), pos, pos, w, table, ratio=4, eps=EPS)
