"""Plans and how a plan is applied: a proposal pruned to the plan's child-rank paths, or gated by confidence.

The drafter always proposes at the engine's budget; a `tree` plan keeps a node iff its child-rank
path is in the plan (`prune_to_shape`), a `linear` plan keeps the drafter's linear draft
(`prune_to_linear`), and the score gate drops the nodes whose confidence is below the bucket's
break-even, with their subtrees (`gate_by_confidence`). Every result is an ancestor-closed subset of
the proposal in the same order: ranks stay contiguous, so a kept node keeps its rank and draw order,
and verification of the result is as lossless as of the whole tree. A plan changes which rows are
verified, never the output's law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from vllm_tree_spec.drafters.base import TreeProposal
from vllm_tree_spec.planner import describe_tree
from vllm_tree_spec.tree import NO_PARENT, Tree, long_tensor


@dataclass(frozen=True)
class Plan:
    """What a bucket drafts: `full` (the drafter's own tree), `linear` (its linear draft: what the linear
    method of the same drafter verifies), `tree` (pruned to `shape`) or `none`."""

    kind: str  # "full" | "linear" | "tree" | "none"
    shape: Tree | None = None  # shape-only tree (kind "tree")

    def __post_init__(self) -> None:
        if (self.kind == "tree") != (self.shape is not None):
            raise ValueError("a 'tree' plan needs its shape; 'full' and 'none' have none")

    @staticmethod
    def of(shape: Tree | None) -> "Plan":
        return Plan("none") if shape is None or shape.num_nodes == 0 else Plan("tree", shape)

    def __str__(self) -> str:
        return self.kind if self.kind in ("full", "linear") else describe_tree(self.shape)

    @property
    def key(self) -> tuple:
        return (self.kind, () if self.shape is None else tuple(self.shape.parents.tolist()))

    @property
    def num_nodes(self) -> int:
        return 0 if self.shape is None else self.shape.num_nodes

    @property
    def depth(self) -> int:
        return 0 if self.shape is None else self.shape.max_depth

    @cached_property
    def path_set(self) -> frozenset:
        """The shape's child-rank paths (what pruning keeps)."""
        return frozenset(structure(self.shape.parents.tolist())[2]) if self.shape is not None else frozenset()

    @cached_property
    def fanout(self) -> dict[tuple[int, ...], int]:
        """Children per node of the shape, keyed by the node's child-rank path (the root is ())."""
        out: dict[tuple[int, ...], int] = {}
        for p in self.path_set:
            out[p[:-1]] = out.get(p[:-1], 0) + 1
        return out

    @property
    def width(self) -> int:
        """Most nodes on one level."""
        if self.shape is None or self.shape.num_nodes == 0:
            return 0
        return int(torch.bincount(self.shape.depth).max())


FULL = Plan("full")
LINEAR = Plan("linear")
NONE = Plan("none")


def structure(parents: Sequence[int]) -> tuple[list[int], list[int], list[tuple[int, ...]], list[list[int]]]:
    """One pass over a parent array: sibling ranks [N], depths [N], child-rank paths [N], children by row [N + 1].

    (Tree's cached properties give the same; a fresh proposal per request per step would compute each
    with its own loop and tensor ops, this is the policy's hot path.)
    """
    ranks, depths, paths, children = [], [], [], [[]]
    for i, p in enumerate(parents):
        kids = children[p + 1]
        ranks.append(len(kids))
        kids.append(i)
        children.append([])
        depths.append(1 if p < 0 else depths[p] + 1)
        paths.append((() if p < 0 else paths[p]) + (ranks[i],))
    return ranks, depths, paths, children


def prune_to_shape(proposal: TreeProposal, plan: "Plan") -> TreeProposal:
    """The nodes of `proposal` whose child-rank path is in the plan (an ancestor-closed subset, same order).

    Ranks are contiguous, so a kept node keeps its rank and draw order; q rows (sampled trees) follow
    their nodes. Verification of the result is as lossless as of the whole tree.
    """
    tree = proposal.tree
    if tree.num_nodes == 0:
        return proposal
    allowed = plan.path_set
    parents = tree.parents.tolist()
    _, _, paths, _ = structure(parents)
    return _keep_nodes(proposal, [i for i, p in enumerate(paths) if p in allowed])


def linear_nodes(proposal: TreeProposal, children: list[list[int]] | None = None) -> list[int]:
    """The nodes of the drafter's linear draft: its first `linear_len` nodes, else the rank-0 path
    (`children`: by row, from `structure`, if the caller has it)."""
    if proposal.linear_len is not None:
        return list(range(proposal.linear_len))
    children = children if children is not None else structure(proposal.tree.parents.tolist())[3]
    out, row = [], 0
    while children[row]:
        out.append(children[row][0])
        row = out[-1] + 1
    return out


def prune_to_linear(proposal: TreeProposal) -> TreeProposal:
    """The proposal's linear draft (a chain from the root; the same lossless rule verifies it)."""
    if proposal.tree.num_nodes == 0:
        return proposal
    return _keep_nodes(proposal, linear_nodes(proposal))


def confidence(scores: torch.Tensor, scores_are_probs: bool) -> list[float]:
    """[N] log confidence of a proposal's nodes: log of a path frequency, or the log q it already is (a list: a
    few nodes per request per step, where tensor or array ops cost more than the arithmetic)."""
    s = scores.tolist()
    return [math.log(max(x, 1e-300)) for x in s] if scores_are_probs else s


def gate_by_confidence(proposal: TreeProposal, conf: Sequence[float], min_conf: float) -> TreeProposal:
    """The nodes of `proposal` whose log confidence is >= min_conf and whose parent is kept (ancestor-closed,
    same order; verification of the result is as lossless as of the whole tree)."""
    if all(c >= min_conf for c in conf):  # the common case where rows are cheap: nothing to cut
        return proposal
    parents = proposal.tree.parents.tolist()
    kept = [False] * len(parents)
    for i, p in enumerate(parents):  # topological order: a parent is decided before its children
        kept[i] = conf[i] >= min_conf and (p < 0 or kept[p])
    return _keep_nodes(proposal, [i for i, k in enumerate(kept) if k])


def _keep_nodes(proposal: TreeProposal, keep: list[int]) -> TreeProposal:
    """The proposal restricted to the ancestor-closed node list `keep` (ascending)."""
    tree = proposal.tree
    k = len(keep)
    if k == tree.num_nodes:
        return proposal
    if k == 0 or keep[-1] == k - 1:  # a prefix (chains, score-ordered trees, nothing): slices, no re-indexing
        q, scores = proposal.draft_probs, proposal.scores
        return TreeProposal(Tree(tree.parents[:k], tree.tokens[:k]), proposal.mode, None if q is None else q[: k + 1],
                            None if scores is None else scores[:k])
    parents = tree.parents.tolist()
    new_index = {j: i for i, j in enumerate(keep)}
    kept_parents = [NO_PARENT if parents[j] < 0 else new_index[parents[j]] for j in keep]  # parents are kept too
    idx = long_tensor(keep)
    q = proposal.draft_probs
    if q is not None:
        q = q[torch.tensor([0] + [j + 1 for j in keep], device=q.device)]  # [n' + 1, V] root row + kept rows
    scores = None if proposal.scores is None else proposal.scores[idx]
    return TreeProposal(Tree(long_tensor(kept_parents), tree.tokens[idx]), proposal.mode, q, scores)
