"""DeepSeek-V4 slot-row copies on vLLM's pooled, padded page layout: Triton kernels vs their PyTorch twins.

The caches here are views into one pooled byte allocation laid out as vLLM 0.32 lays out DeepSeek-V4 on the
NVIDIA path: every block holds one page of each layer, fp8_ds_mla pages padded to a multiple of 576 bytes, so
a layer's page stride is the pooled block, not bs * 584. Checked: the refresh (accepted paths, in-place
compaction of per-token rows, scratch -> canonical entries, several slot spaces and planes in one launch) and
the pair copy (a pooling window into a separate scratch tensor) equal the twins byte for byte, touch nothing
else, and the twins equal the semantics written out per row; planes built with the unpadded stride
(bs * 584) address other bytes (the commit-stride negative control).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

load_kernels_package()
from vllm_tree_spec.kernels.dsv4_refresh_launch import (  # noqa: E402
    Plane,
    build_copy_plan,
    copy_rows_reference,
    copy_rows_triton,
    fp8_ds_mla_planes,
    index_key_planes,
    refresh_reference,
    refresh_triton,
    state_plane,
)

BS = 4  # rows per fp8_ds_mla / key page
PAGE = 576 * ((BS * 584 + 575) // 576)  # padded fp8_ds_mla page (2880 bytes for 4 rows)
KEY_PAGE = 576 * ((BS * 132 + 575) // 576)
STATE_BS, STATE_W = 2, 16
BLOCK = 2 * PAGE + KEY_PAGE + STATE_BS * STATE_W * 4  # one pooled block: two fp8 layers, keys, a state layer
NB = 64


def pooled(seed: int):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (NB * BLOCK,), generator=g, dtype=torch.uint8).to(DEVICE)
    fp8 = [torch.as_strided(pool, (NB, BS, 584), (BLOCK, 584, 1), i * PAGE) for i in range(2)]
    keys = torch.as_strided(pool, (NB, BS, 132), (BLOCK, 132, 1), 2 * PAGE)
    f32 = pool.view(torch.float32)
    state = torch.as_strided(f32, (NB, STATE_BS, STATE_W), (BLOCK // 4, STATE_W, 1), (2 * PAGE + KEY_PAGE) // 4)
    return pool, fp8, keys, state


def semantic_rows(view: torch.Tensor, kind: str, slots: list[int]) -> torch.Tensor:
    """The bytes of each slot's row read per the documented layout (independent of Plane)."""
    out = []
    raw = view.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=view.device).set_(raw)
    base = view.storage_offset() * view.element_size()
    stride = view.stride(0) * view.element_size()
    for s in slots:
        page, off = divmod(s, view.shape[1])
        p = base + page * stride
        if kind == "fp8":
            out.append(torch.cat([flat[p + off * 576: p + off * 576 + 576],
                                  flat[p + BS * 576 + off * 8: p + BS * 576 + off * 8 + 8]]))
        elif kind == "key":
            out.append(torch.cat([flat[p + off * 128: p + off * 128 + 128],
                                  flat[p + BS * 128 + off * 4: p + BS * 128 + off * 4 + 4]]))
        else:
            q = p + off * STATE_W * 4
            out.append(flat[q: q + STATE_W * 4])
    return torch.stack(out).cpu()


def random_step(rng: random.Random, nb_slots: int):
    """B requests with trees; per-token rows at distinct slots; entry scratch / canonical slots."""
    b = rng.randint(1, 4)
    cu, acc, num = [0], [], []
    d = 6
    for _ in range(b):
        n = rng.randint(0, 6)
        cu.append(cu[-1] + n + 1)
        path, node = [], -1
        for _ in range(rng.randint(0, min(n, d))):
            node = rng.randint(node + 1, n - 1) if node + 1 <= n - 1 else None
            if node is None:
                break
            path.append(node)
        acc.append(path + [-1] * (d - len(path)))
        num.append(len(path))
    r = cu[-1]
    slots = rng.sample(range(nb_slots), 3 * r)
    row_slots = slots[:r]
    # space 0: per-token rows compact in place (dst = the row at depth k of the linear layout)
    dst0 = [0] * r
    for bi in range(b):
        for local in range(cu[bi + 1] - cu[bi]):
            dst0[cu[bi] + local] = row_slots[cu[bi] + min(local, cu[bi + 1] - cu[bi] - 1)]
    for bi in range(b):
        for k, node in enumerate(acc[bi][: num[bi]], start=1):
            dst0[cu[bi] + node + 1] = row_slots[cu[bi] + k]
    # space 1: entries (some rows emit into scratch, each has a canonical destination)
    src1 = [s if rng.random() < 0.5 else -1 for s in slots[r: 2 * r]]
    dst1 = slots[2 * r: 3 * r]
    src = torch.tensor([row_slots, src1], dtype=torch.int64)
    dst = torch.tensor([dst0, dst1], dtype=torch.int64)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return src, dst, t(cu), t(acc).view(b, d), t(num)


@pytest.mark.parametrize("seed", range(4))
def test_refresh_equals_twin_on_padded_pooled_pages(seed):
    """Random accepted paths over two slot spaces (per-token rows compacted in place; entries scratch ->
    canonical), every plane of two fp8_ds_mla layers, a state layer and the key planes in one launch."""
    rng = random.Random(seed)
    pool, fp8, keys, state = pooled(seed)
    planes = [(p, p, 0) for layer in fp8 for p in fp8_ds_mla_planes(layer)]
    planes += [(state_plane(state), state_plane(state), 0)]
    planes += [(p, p, 1) for p in index_key_planes(keys)]
    plan = build_copy_plan(planes, DEVICE, block=8)  # small blocks: several work items per row
    src, dst, cu, acc, num = random_step(rng, NB * STATE_BS)
    ref_pool = ref = pool.clone()  # the twin works on the same layout over a copy of the allocation
    ref_fp8 = [torch.as_strided(ref_pool, v.shape, v.stride(), v.storage_offset()) for v in fp8]
    ref_keys = torch.as_strided(ref_pool, keys.shape, keys.stride(), keys.storage_offset())
    ref_state = torch.as_strided(ref_pool.view(torch.float32), state.shape, state.stride(), state.storage_offset())
    ref_planes = [(p, p, 0) for layer in ref_fp8 for p in fp8_ds_mla_planes(layer)]
    ref_planes += [(state_plane(ref_state), state_plane(ref_state), 0)]
    ref_planes += [(p, p, 1) for p in index_key_planes(ref_keys)]
    ref_plan = build_copy_plan(ref_planes, "cpu" if DEVICE.type == "cpu" else DEVICE, block=8)
    # the semantics, per row
    expect_moves = []
    for bi in range(num.numel()):
        for k in range(1, int(num[bi]) + 1):
            r = int(cu[bi]) + int(acc[bi, k - 1]) + 1
            for space in (0, 1):
                s, d = int(src[space, r]), int(dst[space, r])
                if s >= 0 and s != d:
                    expect_moves.append((space, s, d))
    n_ref = refresh_reference(ref_plan, src, dst, cu, acc, num)
    refresh_triton(plan, src.to(DEVICE), dst.to(DEVICE), cu.to(DEVICE), acc.to(DEVICE), num.to(DEVICE))
    assert torch.equal(pool.cpu(), ref.cpu()), "kernel and twin differ"
    assert n_ref == sum(len([1 for p in planes if p[2] == sp]) for sp, _, _ in expect_moves)
    # untouched bytes stay untouched: only destination rows of the copies changed
    fresh = pooled(seed)[0]
    changed = (fresh.cpu() != pool.cpu()).nonzero().flatten()
    allowed = set()
    for space, _, d in expect_moves:
        views = ([("fp8", v) for v in fp8] + [("state", state)]) if space == 0 else [("key", keys)]
        for kind, v in views:
            page, off = divmod(d, v.shape[1])
            p = v.storage_offset() * v.element_size() + page * v.stride(0) * v.element_size()
            if kind == "fp8":
                allowed.update(range(p + off * 576, p + off * 576 + 576))
                allowed.update(range(p + BS * 576 + off * 8, p + BS * 576 + off * 8 + 8))
            elif kind == "key":
                allowed.update(range(p + off * 128, p + off * 128 + 128))
                allowed.update(range(p + BS * 128 + off * 4, p + BS * 128 + off * 4 + 4))
            else:
                allowed.update(range(p + off * STATE_W * 4, p + (off + 1) * STATE_W * 4))
    assert set(changed.tolist()) <= allowed
    assert bool(expect_moves) == (changed.numel() > 0)


def test_the_random_steps_move_rows():
    """The seeds above are not vacuous: their steps copy rows in both slot spaces."""
    spaces = set()
    for seed in range(4):
        src, dst, cu, acc, num = random_step(random.Random(seed), NB * STATE_BS)
        for bi in range(num.numel()):
            for k in range(1, int(num[bi]) + 1):
                r = int(cu[bi]) + int(acc[bi, k - 1]) + 1
                spaces |= {sp for sp in (0, 1) if int(src[sp, r]) >= 0 and int(src[sp, r]) != int(dst[sp, r])}
    assert spaces == {0, 1}


def test_pair_copy_into_separate_scratch_tensor():
    pool, fp8, keys, state = pooled(7)
    scratch = torch.zeros(5, STATE_BS, STATE_W, dtype=torch.float32, device=DEVICE)
    plan = build_copy_plan([(state_plane(state), state_plane(scratch), 0)], DEVICE)
    src = torch.tensor([3, -1, 17, 8, 0], dtype=torch.int64)
    dst = torch.tensor([0, 1, 2, 9, 5], dtype=torch.int64)
    ref = scratch.clone().cpu()
    ref_plan = build_copy_plan([(state_plane(state.cpu() if DEVICE.type == "cpu" else state), state_plane(ref), 0)],
                               "cpu")
    if DEVICE.type == "cpu":
        copy_rows_reference(ref_plan, src, dst)
    copy_rows_triton(plan, src.to(DEVICE), dst.to(DEVICE))
    want = semantic_rows(state, "state", [3, 17, 8, 0])
    got = scratch.view(-1, STATE_W)[[0, 2, 9, 5]].contiguous().view(torch.uint8).view(4, -1).cpu()
    assert torch.equal(got, want)
    assert bool((scratch.view(-1, STATE_W)[1] == 0).all())  # the -1 pair copied nothing
    if DEVICE.type == "cpu":
        assert torch.equal(ref, scratch.cpu())


def test_unpadded_page_stride_addresses_other_bytes():
    """A commit that assumes pages of bs * 584 bytes (the CPU path's layout) reads and writes wrong rows."""
    pool, fp8, keys, state = pooled(3)
    good = fp8_ds_mla_planes(fp8[1])
    bad = tuple(Plane(p.owner, p.base, BS * 584, p.slot_stride, p.page_slots, p.row_bytes) for p in good)
    slots = [5, 9, 14]
    want = semantic_rows(fp8[1], "fp8", slots)
    s = torch.tensor(slots)

    def read(planes):
        parts = []
        for p in planes:
            v = p.byte_view()
            parts.append(v[s // p.page_slots, s % p.page_slots].cpu())
        return torch.cat(parts, dim=1)

    assert torch.equal(read(good), want)
    assert not torch.equal(read(bad), want)


def test_a_strided_num_accepted_is_refused():
    """A column of the TP broadcast's packed tensor (stride != 1) would be read as other requests' counts."""
    _, fp8, _, _ = pooled(0)
    plan = build_copy_plan([(p, p, 0) for p in fp8_ds_mla_planes(fp8[0])], DEVICE, block=8)
    src = torch.arange(4, dtype=torch.int64, device=DEVICE)[None]
    packed = torch.tensor([[0, 1, 7], [0, 1, 9]], dtype=torch.int64, device=DEVICE)
    acc, num = packed[:, :1], packed[:, 1]
    cu = torch.tensor([0, 2, 4], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        refresh_triton(plan, src, src.clone(), cu, acc, num)
    refresh_triton(plan, src, src.clone(), cu, acc, num.contiguous())  # the same step, contiguous: runs
