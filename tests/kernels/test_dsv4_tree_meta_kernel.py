"""DeepSeek-V4 tree index lists: twins vs the reference model, kernels vs twins (exact).

Three layers of checks:
  1. the PyTorch twins (`dsv4_tree_meta_reference.*_reference`) produce exactly the
     reference model's tree plan (`reference/dsv4_plan.py::build_plan`, policy
     "tree"): window, pooling gathers, entry write slots and visible entries,
     in the reference's virtual slot space (the accepted-path commit on vLLM's layout is
     `dsv4_refresh_launch.refresh_triton`, tested in test_dsv4_refresh_kernel.py);
  2. the Triton kernels equal the twins exactly on random batches with paged,
     shuffled block tables, permuted row slots, both window alignments, CSA / HCA
     ratios, with and without the root's entry committed;
  3. alignment with the vLLM integration (`integration/dsv4/plan.py`): the
     kernels reproduce its stock-list-then-remap results in vLLM's layout.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py).
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from vllm_tree_spec.reference.dsv4_cache import DSV4Cache  # noqa: E402
from vllm_tree_spec.reference.dsv4_config import DSV4Config  # noqa: E402
from vllm_tree_spec.reference.dsv4_plan import Segment, build_plan  # noqa: E402
from vllm_tree_spec.tree import Tree  # noqa: E402
from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

load_kernels_package()
from vllm_tree_spec.kernels.dsv4_tree_meta_launch import (  # noqa: E402
    tree_entry_slots_triton,
    tree_topk_slots_triton,
    tree_window_slots_triton,
)
from vllm_tree_spec.kernels.dsv4_tree_meta_reference import (  # noqa: E402
    DSV4TreeRows,
    tree_entry_slots_reference,
    tree_topk_slots_reference,
    tree_window_slots_reference,
)

CFG = DSV4Config()  # layers [SWA, CSA 4, HCA 8, CSA 4], W = 8
MAX_LEN = 64
ENTRY_FIELDS = ("tail", "lens", "committed", "write")


def random_parents(rng: random.Random, n: int, max_depth: int = 8) -> list[int]:
    """Local row parents (row 0 = root), biased towards deep branches."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        if depth[i - 1] < max_depth and rng.random() < 0.6:
            p = i - 1
        else:
            p = rng.choice([j for j in range(i) if depth[j] < max_depth])
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


# A hand-made tree over P = 5 (reference test_dsv4_tree.py): siblings n1, n2 and cousin n10 complete
# CSA w = 1 and HCA w = 0 with different windows; n6 at depth 6 pools committed rows, the root and n0, n1.
HAND_ROWS = [-1] + [p + 1 for p in [-1, 0, 0, 1, 3, 4, 5, 6, 7, -1, 9, 10]]


def to_dev(rows: DSV4TreeRows) -> DSV4TreeRows:
    return DSV4TreeRows(*(t.to(DEVICE) for t in (rows.row_req, rows.parent_rows, rows.depth, rows.start,
                                                    rows.cu_num_rows)), rows.max_depth)  # fmt: skip


def virtual_spaces(batch: int, rows: int, ratio: int = 1):
    """The reference model's slot space: (block table [[b]], block size S // m, row-owned slots)."""
    s = MAX_LEN // ratio
    return torch.arange(batch)[:, None], s, batch * s + torch.arange(rows)


# ---------------------------------------------------------------------------
# 1. twins == the reference model's tree plan


def check_twins_against_plan(starts: list[int], parents: list[list[int]]) -> None:
    cache = DSV4Cache.empty(CFG, len(starts), MAX_LEN)
    cache.lengths[:] = torch.tensor(starts)
    plan = build_plan(cache, [Segment(b, p, tuple(par)) for b, (p, par) in enumerate(zip(starts, parents))], "tree")
    rows = DSV4TreeRows.from_parents(parents, starts, dtype=torch.int64)
    b, r = len(starts), rows.num_rows
    assert torch.equal(rows.positions, plan.positions)
    bt, bs, row_slots = virtual_spaces(b, r)
    window, lens = tree_window_slots_reference(rows, row_slots, bt, bs, CFG.sliding_window, align="position",
                                               out_dtype=torch.int64)  # fmt: skip
    assert torch.equal(window, plan.window)
    assert torch.equal(lens.long(), (plan.window >= 0).sum(1))
    assert torch.equal(row_slots, plan.kv_write) and torch.equal(row_slots, plan.state_write)
    for m, rp in plan.ratios.items():
        coff = 2 if m == 4 else 1
        gather, _ = tree_window_slots_reference(rows, row_slots, bt, bs, coff * m, align="position",
                                                out_dtype=torch.int64)  # fmt: skip
        assert torch.equal(gather[rp.emit_rows], rp.gather), m
        ebt, epb, entry_slots = virtual_spaces(b, r, m)
        e = tree_entry_slots_reference(rows, entry_slots, ebt, epb, m, dense_width=rp.entries.shape[1],
                                       out_dtype=torch.int64)  # fmt: skip
        assert torch.equal(e.dense, rp.entries), m
        emit = (e.write >= 0).nonzero().flatten()
        assert torch.equal(emit, rp.emit_rows) and torch.equal(e.write[emit], rp.entry_write), m
        assert torch.equal(e.lens.long(), (rp.entries >= 0).sum(1))
        # the tail is the path part of the dense list
        for i in range(r):
            c, nv = int(e.committed[i]), int(e.lens[i])
            assert torch.equal(e.tail[i, : nv - c], e.dense[i, c:nv]) and bool((e.tail[i, nv - c :] == -1).all())


@st.composite
def plan_cases(draw):
    k = draw(st.integers(1, 3))
    starts = [draw(st.integers(0, 40)) for _ in range(k)]
    parents = []
    for _ in range(k):
        n = draw(st.integers(1, 13))
        par, depth = [-1], [0]
        for i in range(1, n):
            deep = i > 1 and depth[i - 1] < 8 and draw(st.booleans())
            p = i - 1 if deep else draw(st.sampled_from([j for j in range(i) if depth[j] < 8]))
            par.append(p)
            depth.append(depth[p] + 1)
        parents.append(par)
    return starts, parents


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan_cases())
def test_twins_equal_reference_plan(case):
    check_twins_against_plan(*case)


@pytest.mark.parametrize("P", [0, 3, 5, 9, 30])
def test_twins_equal_reference_plan_hand_tree(P):
    check_twins_against_plan([P, 40, 2], [HAND_ROWS, [-1, 0, 1, 2, 3, 4, 5, 6, 7], [-1]])


# ---------------------------------------------------------------------------
# 2. kernels == twins


def paged_case(rng: random.Random, starts: list[int], parents: list[list[int]], block_size: int, linear: bool):
    """vLLM-like spaces: shuffled block tables for committed positions; rows at linear slots P + i or permuted."""
    rows = DSV4TreeRows.from_parents(parents, starts, dtype=rng.choice([torch.int32, torch.int64]))
    b = len(starts)
    need = max(p + len(par) for p, par in zip(starts, parents))
    nb = -(-need // block_size) + 1
    perm = torch.randperm(b * nb, generator=torch.Generator().manual_seed(rng.randrange(1 << 20)))
    bt = perm.view(b, nb).to(torch.int32)
    if linear:  # vLLM: the tree rows take the slots of positions P .. P + N (query order)
        row_slots = torch.cat([bt[i, (p + torch.arange(len(par))) // block_size].long() * block_size
                               + (p + torch.arange(len(par))) % block_size
                               for i, (p, par) in enumerate(zip(starts, parents))])  # fmt: skip
    else:
        row_slots = b * nb * block_size + torch.randperm(rows.num_rows)
    return rows, bt, row_slots


def random_batch(rng: random.Random, max_requests: int = 4, max_start: int = 300):
    k = rng.randint(1, max_requests)
    starts = [rng.choice([0, 1, 3, rng.randint(0, max_start)]) for _ in range(k)]
    parents = []
    for _ in range(k):
        if rng.random() < 0.2:  # a chain (prefill / decode rows in the same step)
            parents.append(list(range(-1, rng.randint(1, 20) - 1)))
        else:
            parents.append(random_parents(rng, rng.randint(1, 14), max_depth=rng.choice([3, 8])))
    return starts, parents


@pytest.mark.parametrize("seed", range(4))
def test_window_kernel_matches_twin(seed):
    rng = random.Random(seed)
    for trial in range(3):
        starts, parents = random_batch(rng)
        bs = rng.choice([1, 4, 16, 64])
        rows, bt, row_slots = paged_case(rng, starts, parents, bs, linear=trial % 2 == 0)
        window = rng.choice([1, 5, 8, 16, 128])
        align = rng.choice(["left", "position"])
        width = window + rng.choice([0, 0, 3])
        out_dtype = rng.choice([torch.int32, torch.int64])
        want = tree_window_slots_reference(rows, row_slots, bt, bs, window, align=align, out_width=width,
                                           out_dtype=out_dtype)  # fmt: skip
        got = tree_window_slots_triton(to_dev(rows), row_slots.to(DEVICE), bt.to(DEVICE), bs, window, align=align,
                                       out_width=width, out_dtype=out_dtype)  # fmt: skip
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w), (seed, trial, window, align)


@pytest.mark.parametrize("seed", range(4))
def test_entry_kernel_matches_twin(seed):
    rng = random.Random(100 + seed)
    for trial in range(3):
        starts, parents = random_batch(rng)
        m = rng.choice([4, 8, 128])
        epb = rng.choice([1, 2, 64])
        rows = DSV4TreeRows.from_parents(parents, starts, dtype=torch.int64)
        need = max(p + len(par) for p, par in zip(starts, parents)) // m + 1
        nb = -(-need // epb) + 1
        bt = torch.randperm(len(starts) * nb, generator=torch.Generator().manual_seed(seed)).view(len(starts), nb)
        own = 10_000 + torch.randperm(rows.num_rows)
        nv_max = int(((rows.positions + 1) // m).max())
        dense = rng.choice([None, nv_max + 1, max(1, nv_max // 2), 300])
        rc = rng.random() < 0.5
        want = tree_entry_slots_reference(rows, own, bt, epb, m, root_committed=rc, dense_width=dense)
        got = tree_entry_slots_triton(to_dev(rows), own.to(DEVICE), bt.to(DEVICE), epb, m, root_committed=rc,
                                      dense_width=dense)  # fmt: skip
        for f in ENTRY_FIELDS + (("dense",) if dense else ()):
            assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), (seed, trial, f, m, rc)
        assert got.dense is None if dense is None else True
        # top-k ids -> slots, tree-aware
        k = rng.choice([1, 5, 16])
        lens = want.lens.long()
        ids = (torch.rand(rows.num_rows, k) * (lens[:, None] + 1)).long() - 1  # -1 .. nv - 1
        ids = ids.to(rng.choice([torch.int32, torch.int64]))
        ws, wl = tree_topk_slots_reference(rows, ids, want, bt, epb)
        gs, gl = tree_topk_slots_triton(to_dev(rows), ids.to(DEVICE), got, bt.to(DEVICE), epb)
        assert torch.equal(gs.cpu(), ws) and torch.equal(gl.cpu(), wl)
        if dense:  # the top-k map is the dense list gathered at the ids
            ok = (ids >= 0) & (ids < dense)
            ref = want.dense.long().gather(1, ids.long().clamp(0, dense - 1))
            assert torch.equal(torch.where(ok, ws.long(), 0), torch.where(ok, ref, 0))


def test_kernels_on_hand_tree_and_edges():
    """The hand tree at P around both boundaries, a root-only request, and window 1."""
    starts = [3, 5, 6, 7, 0]
    parents = [HAND_ROWS, HAND_ROWS, HAND_ROWS, [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8], [-1]]
    rows = DSV4TreeRows.from_parents(parents, starts, dtype=torch.int64)
    bt, bs, slots = virtual_spaces(5, rows.num_rows)
    for window, align in ((8, "position"), (8, "left"), (1, "left"), (16, "position")):
        want = tree_window_slots_reference(rows, slots, bt, bs, window, align=align)
        got = tree_window_slots_triton(to_dev(rows), slots.to(DEVICE), bt.to(DEVICE), bs, window, align=align)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), (window, align)
    for m in (4, 8):
        ebt, epb, own = virtual_spaces(5, rows.num_rows, m)
        for rc in (False, True):
            want = tree_entry_slots_reference(rows, own, ebt, epb, m, root_committed=rc, dense_width=6)
            got = tree_entry_slots_triton(to_dev(rows), own.to(DEVICE), ebt.to(DEVICE), epb, m, root_committed=rc,
                                          dense_width=6)  # fmt: skip
            for f in ENTRY_FIELDS + ("dense",):
                assert torch.equal(getattr(got, f).cpu(), getattr(want, f)), (m, rc, f)


# ---------------------------------------------------------------------------
# 3. alignment with the vLLM integration's PyTorch plan (integration/dsv4/plan.py)


def _map_local(local: torch.Tensor, req: torch.Tensor, bt: torch.Tensor, bs: int) -> torch.Tensor:
    """vLLM's `map_local_to_global_slots_cpu` (models/deepseek_v4/cpu/cpu_utils.py)."""
    valid = local >= 0
    safe = local.clamp(min=0)
    blk = bt.long()[req.long()[:, None].expand_as(local), safe // bs]
    return torch.where(valid, blk * bs + safe % bs, -1)


def test_matches_integration_plan():
    iplan = pytest.importorskip("vllm_tree_spec.integration.dsv4.plan")
    rng = random.Random(7)
    starts = [130, 5, 254, 0]
    parents = [HAND_ROWS, random_parents(rng, 9), random_parents(rng, 12), [-1, 0, 0]]
    bs, W = 16, 8
    rows, bt, row_slots = paged_case(rng, starts, parents, bs, linear=True)
    cu = rows.cu_num_rows.tolist()
    reqs = [SimpleNamespace(root_row=cu[b], root_pos=starts[b], req_index=b, num_nodes=len(par) - 1,
                            tree=Tree(torch.tensor(par[1:], dtype=torch.long) - 1))
            for b, par in enumerate(parents)]  # fmt: skip
    ratios, epb = [4, 128], {4: 64, 128: 2}
    next_block = [10_000]

    def take(n):
        next_block[0] += n
        return list(range(next_block[0] - n, next_block[0]))

    plan = iplan.build_plan(reqs, rows.num_rows, ratios, epb, take, None, False)
    pos, req = rows.positions, rows.row_req.long()

    # SWA window: vLLM's stock left-aligned list, then the plan's remap == the window kernel
    start = (pos - W + 1).clamp(min=0)
    local = start[:, None] + torch.arange(W)
    local = torch.where(local <= pos[:, None], local, -1)
    stock = _map_local(local, req, bt, bs)
    plan.remap_window_slots(stock, local, row_slots)
    drows, dslots, dbt = to_dev(rows), row_slots.to(DEVICE), bt.to(DEVICE)
    got, lens = tree_window_slots_triton(drows, dslots, dbt, bs, W, align="left", out_dtype=torch.int64)
    assert torch.equal(got.cpu(), stock) and torch.equal(lens.long().cpu(), (stock >= 0).sum(1))
    for m in ratios:
        coff = 2 if m == 4 else 1
        # compressor gather (state group; reuse the same tables): stock by position, then remapped
        gl = pos[:, None] - coff * m + 1 + torch.arange(coff * m)
        gstock = _map_local(gl, req, bt, bs)
        plan.remap_window_slots(gstock, gl, row_slots)
        g, _ = tree_window_slots_triton(drows, dslots, dbt, bs, coff * m, align="position", out_dtype=torch.int64)
        assert torch.equal(g.cpu(), gstock), m
        # entries: canonical (root included) by block table, path entries from the plan's scratch slots
        e_bt = torch.arange(len(starts) * 64).view(len(starts), 64)
        ep = plan.entries[m]
        width = int(((pos + 1) // m).max()) + 2
        lt = torch.arange(width)[None, :].expand(rows.num_rows, -1)
        lt = torch.where(lt < ((pos + 1) // m)[:, None], lt, -1)
        estock = _map_local(lt, req, e_bt, epb[m])
        plan.remap_entry_slots(estock, lt, m)
        e = tree_entry_slots_triton(drows, ep.slot_by_row.to(DEVICE), e_bt.to(DEVICE), epb[m], m,
                                    root_committed=True, dense_width=width, out_dtype=torch.int64)  # fmt: skip
        assert torch.equal(e.dense.cpu(), estock), m
        # compressor output slot mapping: stock (query order) for roots, the plan's scratch slots for nodes
        stock_write = torch.where((pos + 1) % m == 0, _map_local(((pos + 1) // m - 1)[:, None], req, e_bt,
                                                                 epb[m])[:, 0], -1)  # fmt: skip
        stock_write[plan.rows] = ep.slot_by_row[plan.rows]
        assert torch.equal(e.write.cpu(), stock_write), m


# ---------------------------------------------------------------------------
# Errors


def test_errors():
    rows = DSV4TreeRows.from_parents([[-1, 0]], [4], device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="align"):
        tree_window_slots_triton(rows, slots, bt, 16, 8, align="middle")
    with pytest.raises(ValueError, match="out_width"):
        tree_window_slots_triton(rows, slots, bt, 16, 8, out_width=4)
    with pytest.raises(TypeError, match="int32/int64"):
        tree_window_slots_triton(rows, slots.float(), bt, 16, 8)
    with pytest.raises(ValueError, match="tail_width"):
        tree_entry_slots_triton(rows, slots, bt, 2, 1, tail_width=1)
    with pytest.raises(ValueError, match="local parents"):
        DSV4TreeRows.from_parents([[0, -1]], [0])
