"""Random paged-KV tree-attention inputs shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_tree_spec.tree import Tree, TreeBatch
from vllm_tree_spec.tree_attention import tree_batch_kernel_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances of kernel vs reference (fp32 math in both, output rounded to dtype).
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}


def random_tree(n: int, gen: torch.Generator) -> Tree:
    """A random parent array over n nodes (parent of node i uniform in {-1, 0, .., i-1})."""
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
    return Tree(torch.tensor(parents, dtype=torch.long))


def mixed_trees(gen: torch.Generator) -> list[Tree]:
    """A batch with a branching tree, a chain, a root-only request and a wide (all depth-1) tree."""
    return [
        Tree(torch.tensor([-1, -1, 0, 0, 3])),  # the example tree of tree.py
        Tree.chain(4),
        Tree.chain(0),
        Tree(torch.full((9,), -1)),
        random_tree(11, gen),
    ]


@dataclass
class Case:
    trees: list[Tree]
    q: torch.Tensor  # [T_q, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, page, H_kv, D]
    value_cache: torch.Tensor  # [num_blocks, page, H_kv, D]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    cu_num_nodes: torch.Tensor  # [B + 1] int32
    packed_mask: torch.Tensor  # [T_nodes, W] int32
    depth: torch.Tensor  # [T_nodes] int32
    kw: dict = field(default_factory=dict)

    @property
    def args(self) -> tuple:
        return (
            self.q, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
            self.query_start_loc, self.cu_num_nodes, self.packed_mask, self.depth,
        )  # fmt: skip

    @property
    def oracle_args(self) -> tuple:
        return (
            self.q, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
            self.query_start_loc, self.trees,
        )  # fmt: skip


def make_case(
    trees: list[Tree],
    context_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    prefill_rows: list[int] | None = None,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> Case:
    """Request b: context_lens[b] committed tokens, then the root, then its tree.

    prefill_rows[b] (<= context_lens[b]) extra causal query rows precede the
    root (a chunked prefill that ends in a tree). Blocks are a shuffled
    permutation of a pool with spare blocks, so block ids are not in order.
    """
    gen = torch.Generator().manual_seed(seed)
    b = len(trees)
    prefill_rows = prefill_rows or [0] * b
    assert all(p <= c for p, c in zip(prefill_rows, context_lens))
    q_lens = [p + 1 + t.num_nodes for p, t in zip(prefill_rows, trees)]
    seq_lens = [c + 1 + t.num_nodes for c, t in zip(context_lens, trees)]
    blocks = [-(-s // page_size) for s in seq_lens]
    pool = sum(blocks) + 3
    perm = torch.randperm(pool, generator=gen)
    block_table = torch.full((b, max(blocks) + 2), pool - 1, dtype=torch.int32)  # spare columns point anywhere
    off = 0
    for i, nb in enumerate(blocks):
        block_table[i, :nb] = perm[off : off + nb].to(torch.int32)
        off += nb
    kc = torch.randn(pool, page_size, num_kv_heads, head_dim, generator=gen)
    vc = torch.randn(pool, page_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    tin = tree_batch_kernel_inputs(TreeBatch.from_trees(trees))
    return Case(
        trees=trees,
        q=q.to(device=device, dtype=dtype),
        key_cache=kc.to(device=device, dtype=dtype),
        value_cache=vc.to(device=device, dtype=dtype),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        cu_num_nodes=tin["cu_num_nodes"].to(device),
        packed_mask=tin["packed_mask"].to(device),
        depth=tin["depth"].to(device),
    )
