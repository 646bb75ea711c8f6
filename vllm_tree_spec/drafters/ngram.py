"""Model-free tree drafts from n-gram matches in the request's own context (prompt lookup, as a tree).

vLLM's `ngram` method finds one earlier occurrence of the context's last n
tokens and proposes the tokens that followed it as a chain. A tree can keep
*every* occurrence: their continuations, merged into a trie, share common
prefixes and branch where the occurrences disagree.

For a context t[0..L-1] (t[L-1] is the root):

1. Matches. For each earlier end position i (i <= L - 2) let l(i) be the
   length of the longest common suffix of t[..i] and t[..L-1], capped at
   max_n. Positions with l(i) >= min_n are matches; their continuation is
   t[i+1 : i+1+max_depth] (cut at the end of the context; it may overlap the
   matched suffix, which is what makes runs like "a a a" predict "a").
   One vectorised pass computes l for all positions: O(L * max_n) numpy.
2. Selection. The `max_matches` best matches by (l desc, i desc): longest
   first, then most recent.
3. Trie. Each selected match adds its weight w = length_weight ** (l - min_n)
   to every node on its continuation path (an integer, so sums are exact):
   longer matches count more, `length_weight = 1` is a plain count. A node
   also records its most recent match.
4. Ranking. Nodes are ranked by (weight desc, recency desc, depth asc). A
   child's matches are a subset of its parent's, so the child never ranks
   before its parent: the top `budget` nodes form a tree, listed best-first
   (a topological order, so any prefix is again the best smaller tree).
   Siblings are distinct by construction (trie) and appear best first.

Scores are weight / total selected weight: the path's estimated probability.
Children are chosen from counts, so proposals use the deterministic rule
(q := 1) and carry no q. The drafter is stateless: every call reads the
context it is given, so rollback needs no handling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_tree_spec.drafters.base import (
    DraftRequest,
    DrafterError,
    TreeDrafter,
    TreeProposal,
    deterministic_mode,
)
from vllm_tree_spec.tree import NO_PARENT, Tree
from vllm_tree_spec.verify import Mode


@dataclass
class _TrieNode:
    token: int
    parent: int  # trie node index or NO_PARENT
    depth: int
    weight: int = 0
    recency: int = -1  # end position of the most recent match through this node
    children: dict[int, int] = field(default_factory=dict)  # token -> trie node index


def match_lengths(tokens: np.ndarray, max_n: int) -> np.ndarray:
    """l[i] = longest common suffix of tokens[..i] and tokens[..L-1], capped at max_n, for i < L - 1.

    tokens: [L] int -> [L - 1] int64.
    """
    n_pos = tokens.shape[0] - 1
    length = np.zeros(max(n_pos, 0), dtype=np.int64)
    alive = np.ones(max(n_pos, 0), dtype=bool)
    ends = np.arange(max(n_pos, 0))
    for k in range(min(max_n, n_pos)):
        # Compare tokens[i - k] with tokens[L - 1 - k]; positions with i - k < 0 stop matching.
        idx = ends - k
        alive &= (idx >= 0) & (tokens[np.maximum(idx, 0)] == tokens[n_pos - k])
        if not alive.any():
            break
        length += alive
    return length


class NgramTreeDrafter(TreeDrafter):
    """Trees of continuations of every earlier occurrence of the context's last n tokens.

    Args:
        min_n, max_n: match lengths considered (1 <= min_n <= max_n).
        max_depth: longest continuation taken from a match (tree depth).
        max_matches: matches merged per call (longest, then most recent, first).
        length_weight: integer >= 1; a match of length l weighs length_weight ** (l - min_n).
        window: search only the last `window` tokens of the context (None = all).
        validate_proposals: see `TreeDrafter`.
    """

    def __init__(
        self,
        *,
        min_n: int = 1,
        max_n: int = 4,
        max_depth: int = 8,
        max_matches: int = 64,
        length_weight: int = 4,
        window: int | None = None,
        validate_proposals: bool = True,
    ) -> None:
        super().__init__(validate_proposals=validate_proposals)
        if not 1 <= min_n <= max_n:
            raise DrafterError(f"min_n = {min_n}, max_n = {max_n}: need 1 <= min_n <= max_n")
        if max_depth < 1 or max_matches < 1:
            raise DrafterError(f"max_depth = {max_depth}, max_matches = {max_matches}: both must be >= 1")
        if not isinstance(length_weight, int) or length_weight < 1:
            raise DrafterError(
                f"length_weight = {length_weight!r} must be an int >= 1 (integer weights keep the ranking exact)"
            )
        if window is not None and window < 2:
            raise DrafterError(f"window = {window} must be >= 2 or None (a match needs an earlier position)")
        self.min_n, self.max_n = min_n, max_n
        self.max_depth, self.max_matches = max_depth, max_matches
        self.length_weight, self.window = length_weight, window

    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        return [self.draft(r.token_ids, b, deterministic_mode(r.temperature)) for r, b in zip(requests, budgets)]

    def draft(self, token_ids, budget: int, mode: Mode = Mode.DETERMINISTIC) -> TreeProposal:
        """The tree for one context [L] (list, tensor or array; usable without the request lifecycle)."""
        if budget <= 0:
            return TreeProposal.empty(mode)
        ctx = token_ids if self.window is None else token_ids[-self.window :]
        if isinstance(ctx, torch.Tensor):
            ctx = ctx.cpu().numpy()
        tokens = np.asarray(ctx, dtype=np.int64)  # [L]
        length = match_lengths(tokens, self.max_n)  # [L - 1]
        ends = np.nonzero(length >= self.min_n)[0]
        if ends.size == 0:
            return TreeProposal.empty(mode)
        # Longest first, then most recent: lexsort sorts by the last key first.
        order = np.lexsort((-ends, -length[ends]))[: self.max_matches]
        chosen = ends[order]

        nodes: list[_TrieNode] = []
        roots: dict[int, int] = {}  # token -> trie node index of a child of the root
        total = 0
        last = tokens.shape[0]
        for i in chosen.tolist():
            w = self.length_weight ** (int(length[i]) - self.min_n)
            total += w
            level, parent = roots, NO_PARENT
            for depth, tok in enumerate(tokens[i + 1 : min(i + 1 + self.max_depth, last)].tolist(), start=1):
                j = level.get(tok)
                if j is None:
                    j = level[tok] = len(nodes)
                    nodes.append(_TrieNode(tok, parent, depth))
                node = nodes[j]
                node.weight += w
                node.recency = max(node.recency, i)
                level, parent = node.children, j

        ranked = sorted(range(len(nodes)), key=lambda j: (-nodes[j].weight, -nodes[j].recency, nodes[j].depth, j))
        keep = ranked[:budget]
        new_index = {j: k for k, j in enumerate(keep)}
        # Parents rank before children (see the module docstring), so new_index has them.
        parents = [NO_PARENT if nodes[j].parent == NO_PARENT else new_index[nodes[j].parent] for j in keep]
        tree = Tree(torch.tensor(parents, dtype=torch.long), torch.tensor([nodes[j].token for j in keep]))
        scores = torch.tensor([nodes[j].weight / total for j in keep], dtype=torch.float64)
        return TreeProposal(tree, mode, scores=scores)
