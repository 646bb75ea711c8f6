"""A draft network's attention with its committed entries read in place from the pages
(`integration/v2/draft_attention.py`), against plain attention over the same keys gathered densely.

Three requests (no committed entry, 21, 40), scattered block ids, a cache in each layout the store reads
(CPU_ATTN's vec packing, the GPU backends' [blocks, H_kv, block_size, 2D]); own columns with a tree's
ancestor mask; holes in one request. The blockwise path runs on every layout; the tree kernel's path (the
CUDA path for FLASH_ATTN / TRITON_ATTN pages) runs under Triton's interpreter. Row chunking gives the same
rows. A planted control: the same rows without the committed part's weight in the merge are far off.
"""

import math
import random

import pytest
import torch

from vllm_tree_spec.integration import kv_layout
from vllm_tree_spec.integration.v2 import draft_attention
from vllm_tree_spec.integration.v2.draft_attention import Committed, PagedLayerKV

BS = 16
NUM_BLOCKS = 24
HKV, G, D = 2, 3, 16
LENGTHS = [0, 21, 40]
OWN = 5  # own columns: a tree of 5 nodes
PARENTS = [-1, -1, 0, 0, 2]


def ancestors() -> torch.Tensor:
    anc = torch.zeros(OWN, OWN, dtype=torch.bool)
    for i, p in enumerate(PARENTS):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def setup_case(layout: str, holes: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, HKV, BS, 2 * D, generator=gen)  # random: stale content of earlier owners
    free = list(range(1, NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    ids = [[free.pop() for _ in range(-(-(n + OWN) // BS))] for n in LENGTHS]
    table = torch.tensor([row + [row[0]] * (4 - len(row)) for row in ids], dtype=torch.int32)
    k = torch.randn(sum(LENGTHS), HKV, D, generator=gen)
    v = torch.randn(sum(LENGTHS), HKV, D, generator=gen)
    slots = torch.cat([torch.tensor(row)[torch.arange(n) // BS] * BS + torch.arange(n) % BS
                       for row, n in zip(ids, LENGTHS)])
    if layout == "cpu_attn":
        kv_layout.cpu_write(cache, slots, k, v, D, "vec")
    else:
        kv_layout.paged_write(cache, slots, k, v)
    valid = None
    if holes:
        valid = torch.ones(len(LENGTHS), max(LENGTHS), dtype=torch.bool)
        valid[2, 16:32] = False  # a block no record vouched for
        valid[1, 20] = False  # a dropped last entry
    committed = Committed(table, list(LENGTHS), BS, valid)
    q = torch.randn(len(LENGTHS), OWN, HKV * G, D, generator=gen)
    kn = torch.randn(len(LENGTHS), OWN, HKV, D, generator=gen)
    vn = torch.randn(len(LENGTHS), OWN, HKV, D, generator=gen)
    keys = (k.split(LENGTHS), v.split(LENGTHS))
    return cache, committed, q, kn, vn, keys


def dense_reference(q, kn, vn, keys, valid) -> torch.Tensor:
    """Plain attention per request over [committed entries (holes masked) | own columns (ancestors)]."""
    out = []
    for b, n in enumerate(LENGTHS):
        kk = torch.cat([keys[0][b], kn[b]]).transpose(0, 1)  # [Hkv, n + OWN, D]
        vv = torch.cat([keys[1][b], vn[b]]).transpose(0, 1)
        seen = torch.ones(n, dtype=torch.bool) if valid is None else valid[b, :n]
        mask = torch.cat([seen[None].expand(OWN, n), ancestors()], 1)  # [OWN, n + OWN]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), kk.repeat_interleave(G, 0), vv.repeat_interleave(G, 0), attn_mask=mask)
        out.append(o.transpose(0, 1).reshape(OWN, -1))
    return torch.stack(out)  # [B, OWN, H * D]


def run(cache, committed, q, kn, vn, layout) -> torch.Tensor:
    own = torch.zeros(len(LENGTHS), HKV, OWN, D, dtype=q.dtype)
    layer = PagedLayerKV(committed, cache, layout, "vec" if layout == "cpu_attn" else None, own, own.clone())
    cols = torch.arange(OWN).expand(len(LENGTHS), OWN)
    return layer.attend(q, kn, vn, ancestors().expand(len(LENGTHS), -1, -1), cols, D ** -0.5)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("layout", ["cpu_attn", "paged"])
def test_in_place_attention_equals_attention_over_gathered_keys(layout, holes):
    cache, committed, q, kn, vn, keys = setup_case(layout, holes)
    got = run(cache, committed, q, kn, vn, layout)
    torch.testing.assert_close(got, dense_reference(q, kn, vn, keys, committed.valid), atol=2e-6, rtol=2e-6)


def test_row_chunks_give_the_same_rows(monkeypatch):
    cache, committed, q, kn, vn, _ = setup_case("cpu_attn", True)
    whole = run(cache, committed, q, kn, vn, "cpu_attn")
    monkeypatch.setattr(draft_attention, "SCORE_ELEMENTS", 1)  # one row per chunk
    cache, committed, q, kn, vn, _ = setup_case("cpu_attn", True)
    torch.testing.assert_close(run(cache, committed, q, kn, vn, "cpu_attn"), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tree_kernel_reads_the_committed_entries_as_the_blockwise_path(monkeypatch, dtype):
    """The CUDA path (Triton tree kernel, every row a node seeing no tree key) on the interpreter."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    cache, committed, q, kn, vn, keys = setup_case("paged", False, seed=1)
    cache, q, kn, vn = (t.to(dtype) for t in (cache, q, kn, vn))
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # the kernel's output is in the cache dtype
    o_k, lse_k = committed.attend(q, cache, "paged", None, D ** -0.5, backend="triton")
    o_t, lse_t = committed.attend(q, cache, "paged", None, D ** -0.5, backend="torch")
    assert torch.isinf(lse_k[0]).all() and (lse_k[0] < 0).all()  # no committed entry: nothing visible
    torch.testing.assert_close(lse_k, lse_t, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(o_k, o_t, atol=tol, rtol=tol)
    monkeypatch.setattr(Committed, "backend", "triton")
    got = run(cache, committed, q, kn, vn, "paged").float()
    keys = tuple(tuple(t.to(dtype).float() for t in part) for part in keys)
    want = dense_reference(q.float(), kn.float(), vn.float(), keys, None)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="without holes"):
        _, holed, *_ = setup_case("paged", True)
        holed.attend(q, cache, "paged", None, 1.0, backend="triton")


def test_control_without_the_committed_part_is_far_off():
    cache, committed, q, kn, vn, keys = setup_case("paged", False)
    alone = Committed(committed.block_table, [0] * len(LENGTHS), BS)  # planted: the committed entries dropped
    got = run(cache, alone, q, kn, vn, "paged")
    want = dense_reference(q, kn, vn, keys, None)
    assert torch.equal(got[0], run(cache, committed, q, kn, vn, "paged")[0])  # request 0 has none anyway
    assert (got[1:] - want[1:]).abs().max() > 0.1
    assert math.isfinite(float(got.abs().max()))
