"""Sequoia: the optimal static tree for a node budget (arXiv 2402.12374).

From a measured acceptance table a[d][r] = P(the rank-r child of a node at depth d - 1 is the
accepted one | that node was accepted), the expected number of tokens a step emits is

    E[tree] = 1 + sum over nodes v of prod_{u on root->v} a[depth(u)][rank(u)]

(the 1 is the bonus/correction token), and a dynamic programme over (nodes, depth, number of
children) finds the tree maximising it. The trees are shape-only: the builders (`build.py`) fill
them with tokens; `planner.py` prices them per batch size, and the online shape policy re-plans on
them while serving.

Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm_tree_spec.tree import Tree

ACCEPTANCE_SUM_TOL = 1e-6  # slack on sum_r a[d][r] <= 1

# A child-rank path: the sibling ranks from the root's child down to a node (the root's is empty).
RankPath = tuple[int, ...]


def acceptance_table(acceptance: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor, depth: int) -> np.ndarray:
    """Normalise an acceptance vector/table to [depth, R] float64.

    acceptance[r] (same at every depth) or acceptance[d][r] (row d = depth d + 1):
    the probability that the rank-r child is the accepted one, given its
    parent was accepted. Each row sums to at most 1. A measured table rarely
    reaches the deepest levels, so its last row stands in for deeper ones.
    """
    a = np.asarray(torch.as_tensor(acceptance, dtype=torch.float64).cpu())
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] == 0 or a.shape[0] == 0:
        raise ValueError(
            f"acceptance has shape {a.shape}; give a per-rank vector a[r] or a per-depth table a[d][r]"
        )
    if not np.isfinite(a).all() or (a < 0).any() or (a > 1).any():
        raise ValueError("acceptance values must be probabilities in [0, 1]")
    sums = a.sum(1)
    if (sums > 1 + ACCEPTANCE_SUM_TOL).any():
        d = int(np.argmax(sums > 1 + ACCEPTANCE_SUM_TOL))
        raise ValueError(
            f"acceptance row {d} sums to {sums[d]:.6g} > 1; a[r] is the probability that the rank-r "
            f"child is THE accepted one (unconditional over siblings), so the ranks of a row sum to <= 1"
        )
    if depth > a.shape[0]:
        a = np.concatenate([a, np.repeat(a[-1:], depth - a.shape[0], axis=0)])
    return a[: max(depth, 1)].copy()


def expected_accepted_length(tree: Tree, acceptance) -> float:
    """E[tokens per step] = 1 + sum over nodes of the product of a along the node's path.

    Counts the bonus/correction token (a chain of k nodes with a = [alpha]
    gives 1 + alpha + ... + alpha^k). Ranks beyond the table have a = 0.
    """
    a = acceptance_table(acceptance, max(tree.max_depth, 1))
    reach = [1.0] * (tree.num_nodes + 1)  # by row: P(row accepted), root = 1
    for i, (p, d, r) in enumerate(zip(tree.parents.tolist(), tree.depth.tolist(), tree.sibling_rank.tolist())):
        reach[i + 1] = reach[p + 1] * (a[d - 1, r] if r < a.shape[1] else 0.0)
    return 1.0 + math.fsum(reach[1:])


@dataclass(frozen=True)
class _SequoiaTables:
    """Solved DP for one depth limit L (index d = depth of the forest's roots, 1..L + 1).

    value[d, m]       best sum of path products of an m-node forest hanging below a
                      depth d - 1 node (-inf: infeasible)
    num_children[d, m] roots of that best forest
    split[d, b, m]    nodes in the subtree of the rank b - 1 root when the forest
                      has b roots and m nodes (the rest form the first b - 1 subtrees)
    """

    value: np.ndarray  # [L + 2, n + 1]
    num_children: np.ndarray  # [L + 2, n + 1]
    split: np.ndarray  # [L + 2, R + 1, n + 1]


def _solve_sequoia(a: np.ndarray, max_nodes: int) -> _SequoiaTables:
    """Sequoia's DP (arXiv 2402.12374, §3.2) with per-depth acceptance.

    Forests of the children of one node, whose children sit at depth d:

        F[d][0][0] = 0,  F[d][0][m > 0] = -inf
        F[d][b][m] = max_{1 <= s <= m} F[d][b-1][m-s] + a[d][b-1] * (1 + G[d+1][s-1])
        G[d][m]    = max_b F[d][b][m],   G[L+1][0] = 0, G[L+1][m > 0] = -inf

    The rank b-1 child takes s nodes (itself plus an (s-1)-node forest one level
    down); children use contiguous ranks 0..b-1 because a Tree's sibling rank
    is the child's index. E[best n-node tree of depth <= L] = 1 + G[1][n].
    """
    L, R = a.shape
    n = max_nodes
    neg = -np.inf
    value = np.full((L + 2, n + 1), neg)
    value[L + 1, 0] = 0.0
    num_children = np.zeros((L + 2, n + 1), dtype=np.int64)
    split = np.zeros((L + 2, R + 1, n + 1), dtype=np.int64)
    m_idx = np.arange(n + 1)[:, None]  # [n + 1, 1]
    s_idx = np.arange(n + 1)[None, :]  # [1, n + 1]
    valid = (s_idx >= 1) & (s_idx <= m_idx)  # [n + 1, n + 1]: subtree size s fits in m
    rest = np.where(valid, m_idx - s_idx, 0)  # nodes left for the first b - 1 subtrees
    for d in range(L, 0, -1):
        below = value[d + 1]  # [n + 1] best forest one level down
        forest = np.full((R + 1, n + 1), neg)
        forest[0, 0] = 0.0
        for b in range(1, R + 1):
            # child[s]: value of a rank b-1 child whose subtree has s nodes
            child = np.full(n + 1, neg)
            fin = np.isfinite(below[:-1])
            child[1:] = np.where(fin, a[d - 1, b - 1] * (1.0 + np.where(fin, below[:-1], 0.0)), neg)
            cand = np.where(valid, forest[b - 1][rest] + child[None, :], neg)  # [m, s]
            s_best = cand.argmax(1)  # ties toward the smaller subtree
            forest[b] = cand[np.arange(n + 1), s_best]
            split[d, b] = s_best
        num_children[d] = forest.argmax(0)  # ties toward fewer children
        value[d] = forest.max(0)
    return _SequoiaTables(value, num_children, split)


def _sequoia_paths(t: _SequoiaTables, n: int) -> list[RankPath]:
    """Child-rank paths of the best n-node tree in solved tables."""
    out: list[RankPath] = []

    def forest(d: int, m: int, prefix: RankPath) -> None:
        b = int(t.num_children[d, m]) if m else 0
        sizes = []
        for bb in range(b, 0, -1):  # peel subtrees from the last rank down
            s = int(t.split[d, bb, m])
            sizes.append(s)
            m -= s
        for r, s in enumerate(reversed(sizes)):
            out.append(prefix + (r,))
            forest(d + 1, s - 1, prefix + (r,))

    forest(1, n, ())
    return out


def _tree_from_rank_paths(paths: list[RankPath]) -> Tree:
    return Tree.from_paths(paths) if paths else Tree.chain(0)


def optimal_static_trees(acceptance, max_nodes: int, max_depth: int) -> list[Tree | None]:
    """Sequoia-optimal trees for every budget 0..max_nodes at depth <= max_depth.

    Returns a list indexed by node count; None where the budget cannot be placed
    (more nodes than max_depth levels of R ranks hold). Ties between equally good
    trees go to fewer children per node.
    """
    if max_nodes < 0 or max_depth < 1:
        raise ValueError(f"max_nodes = {max_nodes}, max_depth = {max_depth}: need max_nodes >= 0, max_depth >= 1")
    a = acceptance_table(acceptance, max_depth)
    tables = _solve_sequoia(a, max_nodes)
    return [
        _tree_from_rank_paths(_sequoia_paths(tables, n)) if np.isfinite(tables.value[1, n]) else None
        for n in range(max_nodes + 1)
    ]


def optimal_static_tree(acceptance, num_nodes: int, max_depth: int | None = None) -> Tree:
    """The n-node tree of depth <= max_depth maximising `expected_accepted_length`.

    Args:
        acceptance: a[r] or a[d][r] (see `acceptance_table`).
        num_nodes: draft nodes (excluding the root).
        max_depth: levels below the root; default num_nodes (unbounded).
    """
    depth = num_nodes if max_depth is None else max_depth
    tree = optimal_static_trees(acceptance, num_nodes, max(depth, 1))[num_nodes]
    if tree is None:
        r = acceptance_table(acceptance, 1).shape[1]
        cap = sum(r**d for d in range(1, depth + 1))
        raise ValueError(
            f"num_nodes = {num_nodes} does not fit in max_depth = {depth} levels of {r} ranks "
            f"(capacity {cap}); raise max_depth or measure more ranks"
        )
    return tree
