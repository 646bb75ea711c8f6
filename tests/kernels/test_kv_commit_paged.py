"""`kv_commit_paged_triton` (the serving commit on FLASH_ATTN / TRITON_ATTN caches) against its PyTorch
reference (`compaction_pairs` + `paged_copy_slots`), bit for bit, both physical orders of vLLM 0.32's
[num_blocks, Hkv, block_size, 2D] cache, several layers in one launch.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernel tests need it (interpreter on CPU)")

from vllm_tree_spec.integration.kv_layout import compaction_pairs, paged_copy_slots  # noqa: E402
from vllm_tree_spec.tree import Tree, TreeBatch  # noqa: E402
from vllm_tree_spec.tree_attention import load_kernels_package  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

load_kernels_package()
from vllm_tree_spec.kernels.kv_commit_launch import kv_commit_paged_triton  # noqa: E402


def paged_layers(gen, layers, nb, hkv, bs, two_d, dtype, physical_nhd):
    """Layers of one allocation, as vLLM 0.32 lays them out (logical [nb, Hkv, bs, 2D])."""
    if physical_nhd:
        buf = torch.randn(layers, nb, bs, hkv, two_d, generator=gen).to(dtype).to(DEVICE)
        return [buf[i].permute(0, 2, 1, 3) for i in range(layers)]
    buf = torch.randn(layers, nb, hkv, bs, two_d, generator=gen).to(dtype).to(DEVICE)
    return [buf[i] for i in range(layers)]


@pytest.mark.parametrize("physical_nhd", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_commit_matches_reference(physical_nhd, dtype):
    rng = random.Random(int(physical_nhd) * 7 + (dtype == torch.float32))
    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        trees = [Tree([rng.randrange(-1, i) for i in range(rng.randint(0, 9))]) for _ in range(rng.randint(1, 4))]
        batch = TreeBatch.from_trees(trees)
        rows = int(batch.cu_num_rows[-1])
        bs = rng.choice([1, 4, 16])
        nb = -(-(rows + 5) // bs)
        caches = paged_layers(gen, 3, nb, 2, bs, 2 * rng.choice([4, 6]), dtype, physical_nhd)
        slots = torch.arange(rows) + rng.randrange(nb * bs - rows + 1) if trial % 2 else torch.randperm(nb * bs)[:rows]
        d = max(1, batch.max_depth)
        acc = torch.full((len(trees), d), -1, dtype=torch.long)
        num = torch.zeros(len(trees), dtype=torch.long)
        for b, t in enumerate(trees):
            if t.num_nodes:
                path = t.path_to(rng.randrange(t.num_nodes))[: rng.randint(0, t.max_depth)]
                acc[b, : len(path)] = torch.tensor(path, dtype=torch.long)
                num[b] = len(path)
        want = [c.clone() for c in caches]
        cu = batch.cu_num_rows.tolist()
        src, dst = [], []
        for b in range(len(trees)):
            for s, t in compaction_pairs(slots[cu[b]: cu[b + 1]].tolist(), acc[b, : int(num[b])].tolist()):
                src.append(s)
                dst.append(t)
        if src:
            for w in want:
                paged_copy_slots(w, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
        kv_commit_paged_triton(caches, slots.to(DEVICE), batch.cu_num_rows.to(DEVICE), acc.to(DEVICE),
                               num.to(DEVICE))
        for c, w in zip(caches, want):
            assert torch.equal(c.cpu(), w.cpu()), (trial, physical_nhd)
