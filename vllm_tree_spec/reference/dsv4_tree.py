"""Decoding, tree verification and commit over the DeepSeek-V4 reference model.

A request's state is (cache rows for positions < P, pending root token). The
root is the last sampled token: its rows are not in the cache yet, so every
step processes it together with whatever follows it, like vLLM's 1 + N query
tokens:

    prefill(prompt)            chain of the prompt tokens at 0..T-1, committed
    decode(token)              one row at P, committed
    tree_forward(root, tree)   root at P + tree nodes at P + depth, into scratch only
    commit(step, accepted)     root + accepted path copied from scratch into the
                               cache at P, P+1, ..., P+a; P += a + 1
    commit_by_replay           the baseline: drop the scratch and recompute the
                               root + accepted tokens as a chain (one more forward)

The correction/bonus token returned by verification is *not* committed: it
is the next step's root (its KV is computed by the next forward, as in vLLM).

After `commit`, the cache equals what sequential decoding of root + accepted
path produces, buffer by buffer:

    per-token rows (window KV, compressor and indexer state rows):
        cache[b, P + j] = scratch[row of the j-th path node]
    entries / indexer keys, for path nodes whose position completes a block:
        cache[b, w] = scratch entry of that node,   w = (P + j + 1) / m - 1

Rows of rejected nodes are simply dropped; nothing persistent was written
during the tree forward, so there is nothing to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_tree_spec.reference.dsv4 import DSV4Model
from vllm_tree_spec.reference.dsv4_cache import ByteCount, DSV4Cache, LayerBuffers, buffer_layout, new_scratch
from vllm_tree_spec.reference.dsv4_plan import Segment, StepPlan, build_plan
from vllm_tree_spec.tree import NO_PARENT, Tree, TreeBatch


def _requests(requests: Sequence[int] | None, n: int) -> list[int]:
    return list(range(n)) if requests is None else [int(b) for b in requests]


# ---------------------------------------------------------------------------
# Linear (stock) forwards: prefill, decode, replay


def run_linear(
    model: DSV4Model, cache: DSV4Cache, token_lists: Sequence[Sequence[int]], requests: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Append token chains to requests, position-addressed, and commit them.

    Returns one logits tensor [T_j, V] per request (row j predicts token j + 1).
    """
    requests = _requests(requests, len(token_lists))
    segments = [Segment.chain(b, int(cache.lengths[b]), len(t)) for b, t in zip(requests, token_lists) if len(t)]
    if not segments:
        return [torch.zeros(0, model.cfg.vocab_size, dtype=model.dtype) for _ in token_lists]
    plan = build_plan(cache, segments, "linear")
    tokens = torch.tensor([x for t in token_lists for x in t], dtype=torch.long)
    # Linear writes go straight to the cache; the scratch exists only to satisfy the slot space.
    logits = model.forward_rows(tokens, plan, cache, new_scratch(model.cfg, 0, model.dtype))
    for b, t in zip(requests, token_lists):
        cache.lengths[b] += len(t)
    return list(logits.split([len(t) for t in token_lists]))


def prefill(model: DSV4Model, cache: DSV4Cache, prompts: Sequence[Sequence[int]], requests=None) -> list[torch.Tensor]:
    return run_linear(model, cache, prompts, requests)


def decode(model: DSV4Model, cache: DSV4Cache, tokens: Sequence[int], requests=None) -> torch.Tensor:
    """One token per request -> logits [B', V]."""
    return torch.cat(run_linear(model, cache, [[int(t)] for t in tokens], requests))


# ---------------------------------------------------------------------------
# Tree verification forward


@dataclass
class TreeStep:
    """One tree forward over B' requests: logits for every row plus the scratch to commit from.

    Rows are request-major; request j owns rows cu_num_rows[j] .. cu_num_rows[j+1]-1,
    its root first, then its nodes in tree order (row i + 1 = node i).
    """

    requests: list[int]
    starts: list[int]  # P per request: the root's position
    roots: list[int]
    trees: list[Tree]
    cu_num_rows: torch.Tensor  # [B' + 1]
    logits: torch.Tensor  # [R, V]
    plan: StepPlan
    scratch: list[LayerBuffers]

    def request_logits(self, j: int) -> torch.Tensor:
        """[1 + N_j, V]: row 0 after the root, row i + 1 after node i's path."""
        return self.logits[int(self.cu_num_rows[j]) : int(self.cu_num_rows[j + 1])]


def _tree_segments(cache: DSV4Cache, trees: Sequence[Tree], requests: list[int]) -> list[Segment]:
    return [Segment(b, int(cache.lengths[b]), (NO_PARENT,) + tuple(p + 1 for p in t.parents.tolist()))
            for b, t in zip(requests, trees)]


def _tree_tokens(roots: Sequence[int], trees: Sequence[Tree]) -> torch.Tensor:
    return torch.cat([torch.cat((torch.tensor([int(r)]), t.tokens)) for r, t in zip(roots, trees)])


def tree_forward(
    model: DSV4Model, cache: DSV4Cache, roots: Sequence[int], trees: Sequence[Tree], requests=None
) -> TreeStep:
    """Verify-forward root + tree for each request; the cache is only read."""
    requests = _requests(requests, len(trees))
    for t in trees:
        if t.tokens is None:
            raise ValueError("tree_forward needs trees with tokens")
    segments = _tree_segments(cache, trees, requests)
    plan = build_plan(cache, segments, "tree")
    scratch = new_scratch(model.cfg, plan.num_rows, model.dtype)
    logits = model.forward_rows(_tree_tokens(roots, trees), plan, cache, scratch)
    cu = TreeBatch.from_trees(trees).cu_num_rows  # [B' + 1], each request owns 1 + N_j rows
    return TreeStep(requests, [s.start for s in segments], [int(r) for r in roots], list(trees), cu, logits, plan,
                    scratch)


def naive_tree_forward(
    model: DSV4Model, cache: DSV4Cache, roots: Sequence[int], trees: Sequence[Tree], requests=None
) -> torch.Tensor:
    """The negative control: a plain tree mask over position-addressed compressor state.

    Returns logits [R, V]. It writes compressor rows and entries into the
    persistent cache by position, as the stock path would, so the cache is
    spoiled afterwards.
    """
    requests = _requests(requests, len(trees))
    plan = build_plan(cache, _tree_segments(cache, trees, requests), "naive")
    scratch = new_scratch(model.cfg, plan.num_rows, model.dtype)
    return model.forward_rows(_tree_tokens(roots, trees), plan, cache, scratch)


# ---------------------------------------------------------------------------
# Commit


def check_path(tree: Tree, accepted: Sequence[int]) -> None:
    """accepted must be a root-to-node path: accepted[0] a root child, each next one a child of the last."""
    parent = NO_PARENT
    for a in accepted:
        if not 0 <= a < tree.num_nodes or int(tree.parents[a]) != parent:
            raise ValueError(f"accepted {list(accepted)} is not a path from the root of {tree}")
        parent = a


def commit(cache: DSV4Cache, step: TreeStep, accepted: Sequence[Sequence[int]]) -> ByteCount:
    """Refresh the cache from scratch along each request's accepted path.

    accepted[j] lists request j's accepted node indices, root-to-deepest (as
    `verify_tree` returns them). Commits root + accepted nodes at positions
    P .. P + len(accepted[j]). Returns the bytes copied per buffer.
    """
    if len(accepted) != len(step.trees):
        raise ValueError(f"need one accepted path per request ({len(step.trees)}), got {len(accepted)}")
    src, dst_b, dst_p = [], [], []
    for j, (b, P, tree, acc) in enumerate(zip(step.requests, step.starts, step.trees, accepted)):
        if int(cache.lengths[b]) != P:
            raise ValueError(f"request {b} moved from length {P} to {int(cache.lengths[b])} since the tree forward")
        check_path(tree, acc)
        rows = [0] + [a + 1 for a in acc]  # local rows: root, then the accepted nodes
        src += [int(step.cu_num_rows[j]) + r for r in rows]
        dst_b += [b] * len(rows)
        dst_p += [P + k for k in range(len(rows))]
    src_t, b_t, p_t = (torch.tensor(x, dtype=torch.long) for x in (src, dst_b, dst_p))
    moved = ByteCount()
    for i, (layer, scratch) in enumerate(zip(cache.layers, step.scratch)):
        for name, spec in buffer_layout(cache.config, i).items():
            if spec.per == "token":
                rows = scratch.tensors[name][src_t]  # [n, width]
                layer.tensors[name][b_t, p_t] = rows
            else:  # only path nodes that completed a block carry an entry
                done = (p_t + 1) % spec.ratio == 0
                rows = scratch.tensors[name][src_t[done]]
                layer.tensors[name][b_t[done], (p_t[done] + 1) // spec.ratio - 1] = rows
            moved.add(name, rows)
    for b, P, acc in zip(step.requests, step.starts, accepted):
        cache.lengths[b] = P + 1 + len(acc)
    return moved


def commit_by_replay(model: DSV4Model, cache: DSV4Cache, step: TreeStep, accepted: Sequence[Sequence[int]]):
    """Baseline commit: discard the scratch, recompute root + accepted tokens as a chain.

    Returns the replay's logits per request (identical, up to rounding, to the
    tree rows of the accepted path).
    """
    for tree, acc in zip(step.trees, accepted):
        check_path(tree, acc)
    chains = [[root] + [int(tree.tokens[a]) for a in acc] for root, tree, acc in zip(step.roots, step.trees, accepted)]
    return run_linear(model, cache, chains, step.requests)


# ---------------------------------------------------------------------------
# Sequential reference


def sequential_tree_logits(model: DSV4Model, cache: DSV4Cache, request: int, root: int, tree: Tree) -> torch.Tensor:
    """[1 + N, V] logits of every tree row by plain one-token decoding along its path.

    Walks the tree depth first from a private copy of the request's state,
    copying the state at each branch, so row i + 1 = decode(root, path tokens of node i).
    """
    out: list[torch.Tensor | None] = [None] * (tree.num_nodes + 1)

    def visit(state: DSV4Cache, row: int, token: int) -> None:
        out[row] = decode(model, state, [token])[0]
        kids = tree.children[row]
        for k, child in enumerate(kids):
            visit(state if k == len(kids) - 1 else state.clone(), child + 1, int(tree.tokens[child]))

    visit(cache.select([request]), 0, root)
    return torch.stack(out)
