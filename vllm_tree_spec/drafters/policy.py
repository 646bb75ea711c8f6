"""Tree policies: which tree a model drafter (draft LM, MTP head) builds from its q.

Policy is kept apart from the drafter (a lesson from EAGLE#234 and TRT-LLM's
review history): the drafter only answers "q at these rows", the policy
decides which rows to expand and which children to keep, through the
builders in `build.py`.

    StaticPolicy(paths)          fixed shape; the node with child-rank path (r_1, .., r_k)
                                 gets the r_k-th most likely token of q at its parent
                                 (deterministic: verify with q := 1)
    DynamicPolicy(TreeShape)     EAGLE-2 / SGLang `s{steps}_k{topk}_d{draft_tokens}`:
                                 beam expansion by cumulative log q, global rerank to
                                 d - 1 nodes (deterministic)
    SampledPolicy(paths, repl.)  fixed shape whose children are drawn from q, i.i.d.
                                 (SAMPLED) or without replacement in draw order
                                 (SAMPLED_WITHOUT_REPLACEMENT); verification needs q

Per-request node budgets shrink a policy with `for_budget`: a static or
sampled shape keeps the first `budget` nodes of its priority order (a
topological prefix, so still a tree; `Tree.from_paths` order is by depth,
then rank, so pass a Tree in your own best-first order if depth is not the
priority you want), or, for `StaticPolicy.from_trees`, switches to the listed
shape for that budget (Sequoia's optimal tree per node count); a dynamic
shape keeps its rerank and just verifies fewer nodes (d - 1 = budget, and no
more steps than budget).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

from vllm_tree_spec.build import budget_shape
from vllm_tree_spec.drafters.base import DrafterError
from vllm_tree_spec.tree import Tree, TreeShape

RankPath = tuple[int, ...]


def _normalise_paths(shape: Tree | str | Iterable[Sequence[int] | int]) -> tuple[RankPath, ...]:
    """Child-rank paths in priority order (validated through Tree.from_paths)."""
    if isinstance(shape, Tree):
        return tuple(shape.to_paths())  # the tree's own node order is its priority
    paths = list(shape) if not isinstance(shape, str) else shape  # an iterator is read once
    Tree.from_paths(paths)  # validates: a literal, prefix-closed, no duplicates, ranks >= 0
    if isinstance(paths, str):
        paths = ast.literal_eval(paths)
    norm = ((p,) if isinstance(p, int) else tuple(p) for p in paths)
    return tuple(sorted(norm, key=lambda t: (len(t), t)))  # the order Tree.from_paths numbers nodes in


def _prefix(paths: tuple[RankPath, ...], budget: int) -> tuple[RankPath, ...]:
    if budget < 0:
        raise DrafterError(f"budget = {budget} must be >= 0")
    return paths[:budget]


@dataclass(frozen=True)
class StaticPolicy:
    """A fixed shape filled with the top-ranked tokens of q.

    Attributes:
        paths: child-rank paths, prefix-closed, in priority order. Build with
            `StaticPolicy.of(shape)` from a shape-only Tree, a path list or its string.
        by_budget: optional shape per budget (index = node count, None = no tree of
            that size), e.g. Sequoia's `build.optimal_static_trees`; a budget then
            gets the largest listed shape that fits instead of a prefix of `paths`.
            Build with `StaticPolicy.from_trees`.
    """

    paths: tuple[RankPath, ...]
    by_budget: tuple[tuple[RankPath, ...] | None, ...] = ()

    @staticmethod
    def of(shape: Tree | str | Iterable[Sequence[int] | int]) -> "StaticPolicy":
        return StaticPolicy(_normalise_paths(shape))

    @staticmethod
    def from_trees(trees: Sequence[Tree | None]) -> "StaticPolicy":
        """One shape per budget: trees[n] is the n-node shape (or None); the largest is the default."""
        by_budget = tuple(None if t is None else _normalise_paths(t) for t in trees)
        for n, paths in enumerate(by_budget):
            if paths is not None and len(paths) != n:
                raise DrafterError(f"trees[{n}] has {len(paths)} nodes; trees[n] must be the n-node shape (or None)")
        sizes = [n for n, paths in enumerate(by_budget) if paths is not None]
        if not sizes:
            raise DrafterError("trees lists no shape; pass e.g. build.optimal_static_trees(acceptance, n, depth)")
        return StaticPolicy(by_budget[sizes[-1]], by_budget)

    @property
    def max_nodes(self) -> int:
        return len(self.paths)

    def for_budget(self, budget: int) -> "StaticPolicy":
        if not self.by_budget:
            return StaticPolicy(_prefix(self.paths, budget))
        if budget < 0:
            raise DrafterError(f"budget = {budget} must be >= 0")
        fits = [n for n in range(min(budget, len(self.by_budget) - 1) + 1) if self.by_budget[n] is not None]
        return StaticPolicy(self.by_budget[fits[-1]] if fits else ())


@dataclass(frozen=True)
class DynamicPolicy:
    """EAGLE-2 / SGLang dynamic tree (`TreeShape` semantics, see tree.py)."""

    shape: TreeShape

    @staticmethod
    def of(shape: TreeShape | str) -> "DynamicPolicy":
        return DynamicPolicy(TreeShape.parse(shape) if isinstance(shape, str) else shape)

    @staticmethod
    def from_budget(depth: int, topk: int, budget: int) -> "DynamicPolicy":
        """EAGLE-2's parameters: `depth` levels, top-`topk` beams, `budget` draft nodes kept."""
        return DynamicPolicy(budget_shape(depth, topk, budget))

    @property
    def max_nodes(self) -> int:
        return self.shape.num_nodes

    def for_budget(self, budget: int) -> "DynamicPolicy | None":
        """The shape verifying at most `budget` nodes (None for budget 0)."""
        if budget < 0:
            raise DrafterError(f"budget = {budget} must be >= 0")
        if budget == 0:
            return None
        keep = min(budget, self.shape.num_nodes)
        # A kept node sits at depth <= keep, so steps beyond that are wasted drafting.
        steps = min(self.shape.steps, keep)
        return DynamicPolicy(TreeShape(steps, self.shape.topk, keep + 1))


@dataclass(frozen=True)
class SampledPolicy:
    """A fixed shape whose children are sampled from q at the request's temperature.

    Attributes:
        paths: as in StaticPolicy; a node's rank is its draw index among its siblings.
        replacement: True: i.i.d. children (mode SAMPLED, duplicate siblings allowed);
            False: distinct children in draw order (mode SAMPLED_WITHOUT_REPLACEMENT).
    """

    paths: tuple[RankPath, ...]
    replacement: bool = False

    @staticmethod
    def of(shape: Tree | str | Iterable[Sequence[int] | int], *, replacement: bool = False) -> "SampledPolicy":
        return SampledPolicy(_normalise_paths(shape), replacement)

    @property
    def max_nodes(self) -> int:
        return len(self.paths)

    def for_budget(self, budget: int) -> "SampledPolicy":
        return SampledPolicy(_prefix(self.paths, budget), self.replacement)

    def as_static(self) -> StaticPolicy:
        """The same shape filled by rank: what a greedy (T = 0) request gets instead of samples."""
        return StaticPolicy(self.paths)


TreePolicy = Union[StaticPolicy, DynamicPolicy, SampledPolicy]


def parse_policy(spec: "TreePolicy | TreeShape | Tree | str | Iterable[Sequence[int] | int]") -> TreePolicy:
    """A policy from a shape: a TreeShape or "s3_k2_d6" -> dynamic; a Tree or rank paths -> static."""
    if isinstance(spec, (StaticPolicy, DynamicPolicy, SampledPolicy)):
        return spec
    if isinstance(spec, TreeShape):
        return DynamicPolicy(spec)
    if isinstance(spec, str) and spec.strip().startswith("s"):
        return DynamicPolicy.of(spec)
    return StaticPolicy.of(spec)
