"""The accepted-path KV commit kernel against the `compaction_pairs` reference, bit for bit.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from vllm_tree_spec.tree import Tree, TreeBatch  # noqa: E402
from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402
from vllm_tree_spec.verify import VerifyCoins  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

load_kernels_package()
from vllm_tree_spec.kernels.kv_commit_launch import (  # noqa: E402
    commit_pairs,
    kv_commit_reference,
    kv_commit_rows_reference,
    kv_commit_rows_triton,
    kv_commit_torch,
    kv_commit_triton,
)
from vllm_tree_spec.kernels.tree_verify_launch import verify_batch_triton  # noqa: E402

CACHE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def random_caches(gen, layers, num_blocks, block_size, hkv, head_dim, dtype):
    """Random raw bits (NaN / inf patterns included): the commit must move bits, not values."""
    nbytes = torch.empty(0, dtype=dtype).element_size()
    shape = (2, num_blocks, block_size, hkv, head_dim * nbytes)
    return [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype).to(DEVICE)
            for _ in range(layers)]  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu() if t.dtype != torch.uint8 else t.cpu()


def random_paths(rng, trees):
    """A random accepted path per request (prefix of a root-to-leaf path), in the verifier's output layout."""
    d = max(1, max(t.max_depth for t in trees))
    acc = torch.full((len(trees), d), -1, dtype=torch.long)
    num = torch.zeros(len(trees), dtype=torch.long)
    for b, t in enumerate(trees):
        if t.num_nodes:
            path = t.path_to(rng.randrange(t.num_nodes))[: rng.randint(0, t.max_depth)]
            acc[b, : len(path)] = torch.tensor(path, dtype=torch.long)
            num[b] = len(path)
    return acc, num


def random_trees(rng, batch_size, max_nodes):
    return [Tree(torch.tensor([rng.randrange(-1, i) for i in range(rng.randint(0, max_nodes))], dtype=torch.long))
            for _ in range(batch_size)]  # fmt: skip


def row_slots_for(rng, rows, num_slots, linear):
    """Linear slots (vLLM's usual allocation: rows overlap as they shift) or a random permutation."""
    if linear:
        start = rng.randrange(num_slots - rows + 1)
        return torch.arange(start, start + rows)
    return torch.randperm(num_slots, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))[:rows]


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_matches_reference_random(dtype):
    rng = random.Random(hash(str(dtype)) & 0xFFFF)
    gen = torch.Generator().manual_seed(1)
    for trial in range(6):
        trees = random_trees(rng, rng.randint(1, 5), 14)
        batch = TreeBatch.from_trees(trees)
        rows = int(batch.cu_num_rows[-1])
        block_size = rng.choice([1, 4, 16])
        num_blocks = -(-(rows + 8) // block_size)
        hkv, head_dim = rng.choice([(2, 8), (1, 6), (4, 16), (3, 5)])
        caches = random_caches(gen, rng.randint(1, 3), num_blocks, block_size, hkv, head_dim, dtype)
        slots = row_slots_for(rng, rows, num_blocks * block_size, linear=trial % 2 == 0)
        acc, num = random_paths(rng, trees)
        args = (slots.to(DEVICE), batch.cu_num_rows.to(DEVICE), acc.to(DEVICE), num.to(DEVICE))
        ref = [c.clone() for c in caches]
        kv_commit_reference(ref, *args)
        kv_commit_triton(caches, *args, block=rng.choice([None, 4]))
        for r, c in zip(ref, caches):
            assert torch.equal(bits(c), bits(r)), (trial, dtype)


def test_overlapping_shift_reads_before_writes():
    """Rows 2, 3, 4 -> 1, 2, 3 on linear slots: every destination but the first is also a source."""
    tree = Tree(torch.tensor([-1, -1, 1, 2]))  # n0, n1 under the root; n1 -> n2 -> n3
    batch = TreeBatch.from_trees([tree])
    cache = torch.arange(2 * 8 * 4, dtype=torch.float32).view(2, 8, 1, 1, 4).to(DEVICE)
    orig = cache.clone()
    slots = torch.arange(2, 7, device=DEVICE)  # rows 0..4 at slots 2..6
    acc, num = torch.tensor([[1, 2, 3]], device=DEVICE), torch.tensor([3], device=DEVICE)
    kv_commit_triton(cache, slots, batch.cu_num_rows.to(DEVICE), acc, num)
    assert torch.equal(cache[:, 3:6], orig[:, 4:7])  # rows 1..3 now hold rows 2..4
    assert torch.equal(cache[:, :3], orig[:, :3]) and torch.equal(cache[:, 6:], orig[:, 6:])
    assert commit_pairs(slots.cpu(), batch.cu_num_rows, acc.cpu(), num.cpu()) == ([4, 5, 6], [3, 4, 5])


def test_in_place_paths_and_empty_batches_do_nothing():
    gen = torch.Generator().manual_seed(0)
    (cache,) = random_caches(gen, 1, 6, 4, 2, 8, torch.bfloat16)
    orig = cache.clone()
    batch = TreeBatch.from_trees([Tree.chain(3), Tree.chain(0)])
    cu = batch.cu_num_rows.to(DEVICE)
    slots = torch.arange(6, device=DEVICE)
    kv_commit_triton(cache, slots, cu, torch.tensor([[0, 1, 2], [-1, -1, -1]], device=DEVICE),
                     torch.tensor([3, 0], device=DEVICE))  # the chain's path is already in place
    kv_commit_triton(cache, slots, cu, torch.zeros(2, 0, dtype=torch.long, device=DEVICE),
                     torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert torch.equal(bits(cache), bits(orig))


@pytest.mark.parametrize("shape_dtype", [((37,), torch.uint8), ((2, 8), torch.bfloat16), ((12,), torch.float32)])
def test_rows_variant(shape_dtype):
    """Generic [num_slots, row] caches (e.g. a byte view, MLA's one latent row per slot)."""
    row_shape, dtype = shape_dtype
    rng = random.Random(9)
    gen = torch.Generator().manual_seed(2)
    for trial in range(4):
        trees = random_trees(rng, 3, 10)
        batch = TreeBatch.from_trees(trees)
        rows = int(batch.cu_num_rows[-1])
        nbytes = torch.empty(0, dtype=dtype).element_size()
        caches = [torch.randint(0, 256, (rows + 9, *row_shape[:-1], row_shape[-1] * nbytes), generator=gen,
                                dtype=torch.uint8).view(dtype).to(DEVICE) for _ in range(2)]  # fmt: skip
        slots = row_slots_for(rng, rows, rows + 9, linear=trial % 2 == 0).to(DEVICE)
        acc, num = random_paths(rng, trees)
        args = (slots, batch.cu_num_rows.to(DEVICE), acc.to(DEVICE), num.to(DEVICE))
        ref = [c.clone() for c in caches]
        kv_commit_rows_reference(ref, *args)
        kv_commit_rows_triton(caches, *args)
        for r, c in zip(ref, caches):
            assert torch.equal(bits(c), bits(r))


def test_torch_device_path_and_layer_table():
    """kv_commit_torch (no host sync) equals the reference; an explicit, reused layer table works."""
    rng = random.Random(12)
    gen = torch.Generator().manual_seed(3)
    trees = random_trees(rng, 4, 12)
    batch = TreeBatch.from_trees(trees)
    rows = int(batch.cu_num_rows[-1])
    caches = random_caches(gen, 3, rows // 4 + 3, 4, 2, 8, torch.float16)
    table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=DEVICE)
    for linear in (True, False):
        slots = row_slots_for(rng, rows, (rows // 4 + 3) * 4, linear).to(DEVICE)
        acc, num = random_paths(rng, trees)
        args = (slots, batch.cu_num_rows.to(DEVICE), acc.to(DEVICE), num.to(DEVICE))
        ref = [c.clone() for c in caches]
        kv_commit_reference(ref, *args)
        tc = [c.clone() for c in caches]
        kv_commit_torch(tc, *args)
        kv_commit_triton(caches, *args, layer_table=table)
        for r, t, c in zip(ref, tc, caches):
            assert torch.equal(bits(t), bits(r)) and torch.equal(bits(c), bits(r))


def test_verify_then_commit():
    """End to end on the device: the verification kernel's outputs feed the commit kernel directly."""
    rng = random.Random(5)
    vocab = 29
    trees = []
    for _ in range(4):
        t = random_trees(rng, 1, 10)[0]
        trees.append(t.with_tokens(torch.tensor([rng.randrange(vocab) for _ in range(t.num_nodes)])))
    batch = TreeBatch.from_trees(trees)
    rows = int(batch.cu_num_rows[-1])
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(rows, vocab, generator=g) * 0.2, -1).to(DEVICE)  # flat p: some acceptances
    coins = VerifyCoins.draw(4, batch.max_depth, batch.max_children, vocab, device=DEVICE)
    out = verify_batch_triton(batch, p, None, "deterministic", coins)
    (cache,) = random_caches(torch.Generator().manual_seed(1), 1, rows + 2, 1, 2, 4, torch.bfloat16)
    slots = torch.arange(rows, device=DEVICE) + 1
    ref = cache.clone()
    args = (slots, batch.cu_num_rows.to(DEVICE), out.accepted_nodes, out.num_accepted)
    kv_commit_reference(ref, *args)
    kv_commit_triton(cache, *args)
    assert torch.equal(bits(cache), bits(ref))


def test_errors():
    cu = torch.tensor([0, 2], device=DEVICE)
    acc, num = torch.tensor([[1]], device=DEVICE), torch.tensor([1], device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="GPU layout"):
        kv_commit_triton(torch.zeros(4, 4, 2, 8, device=DEVICE), slots, cu, acc, num)
    with pytest.raises(ValueError, match="share"):
        kv_commit_triton([torch.zeros(2, 4, 2, 1, 8, device=DEVICE), torch.zeros(2, 5, 2, 1, 8, device=DEVICE)],
                         slots, cu, acc, num)  # fmt: skip
    strided = torch.zeros(2, 4, 2, 8, 2, device=DEVICE).transpose(3, 4)  # [.., Hkv=2, D=8] not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        kv_commit_triton(strided, slots, cu, acc, num)
    with pytest.raises(TypeError, match="int32/int64"):
        kv_commit_triton(torch.zeros(2, 4, 2, 1, 8, device=DEVICE), slots.float(), cu, acc, num)


def test_a_strided_num_accepted_is_refused():
    """The TP broadcast packs the verifier's outputs into one tensor; a column of it has stride != 1, which the
    kernel would read as other requests' values (it indexes num_accepted with stride 1)."""
    cu = torch.tensor([0, 2, 4], device=DEVICE)
    packed = torch.tensor([[1, 1, 7], [1, 1, 9]], device=DEVICE)  # [B, D + 2]: accepted, num_accepted, token
    acc, num = packed[:, :1], packed[:, 1]
    assert num.stride(0) != 1
    with pytest.raises(ValueError, match="contiguous"):
        kv_commit_triton(torch.zeros(2, 4, 2, 1, 8, device=DEVICE), torch.arange(4, device=DEVICE), cu, acc, num)
