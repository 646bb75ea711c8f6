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
(q := 1) and carry no q.

Serving (`propose`) does not rescan the context: each started request keeps an
index (`NgramIndex`) from every n-gram (min_n <= n <= max_n) to the positions
where it ends, extended with the tokens committed since the last call, so a
step costs O(new tokens * max_n + max_matches * max_n) instead of O(L * max_n).
Steps 2-4 are unchanged, and the selected matches are exactly step 1's (same
lengths, same order). The committed context only grows; if the index's tail no
longer matches it (a preempted request recomputed differently), it is rebuilt.
`draft` is the stateless one-context form (the vectorised scan above).
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
from vllm_tree_spec.tree import NO_PARENT, Tree, long_tensor
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


class NgramIndex:
    """Per-request n-gram index: ends[n][gram] = ascending end positions i of `gram` (length n) in the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple, list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def update(self, context) -> None:
        """Bring the index up to `context` ([L], a prefix-extension of what it has seen, else rebuilt)."""
        seen = len(self.tokens)
        tail = min(seen, self.max_n)
        if len(context) < seen or (tail and list(context[seen - tail: seen]) != self.tokens[seen - tail:]):
            self.__init__(self.min_n, self.max_n)
            seen = 0
        new = context[seen:]
        new = new.tolist() if hasattr(new, "tolist") else list(new)
        t = self.tokens
        for tok in new:
            t.append(int(tok))
            p = len(t) - 1
            for n, grams in self.ends.items():
                if p + 1 >= n:
                    grams.setdefault(tuple(t[p - n + 1:]), []).append(p)

    def matches(self, max_matches: int, window: int | None) -> tuple[list[int], list[int]]:
        """The `max_matches` best earlier ends (match length desc, position desc) and their lengths l(i),
        as `match_lengths` + the selection in `NgramTreeDrafter.draft` would give them."""
        t, L = self.tokens, len(self.tokens)
        lo = 0 if window is None else max(0, L - window)  # a match must start inside the window
        chosen, lengths, taken = [], [], set()
        for n in range(min(self.max_n, L - lo - 1) if L - lo > 1 else 0, self.min_n - 1, -1):
            for i in reversed(self.ends[n].get(tuple(t[L - n:]), ())):
                if i >= L - 1 or i in taken:
                    continue  # the root itself; or matched longer already
                if i - n + 1 < lo:
                    break  # ascending positions: the rest start before the window too
                taken.add(i)
                chosen.append(i)
                lengths.append(n)
                if len(chosen) == max_matches:
                    return chosen, lengths
        return chosen, lengths


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

    scores_are_probs = True  # scores: each node's share of the matched continuations

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
        self._index: dict = {}  # started requests -> NgramIndex

    def _start(self, req_id, prompt_token_ids) -> None:
        self._index[req_id] = NgramIndex(self.min_n, self.max_n)

    def _finish(self, req_id) -> None:
        self._index.pop(req_id, None)

    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        out = []
        for r, b in zip(requests, budgets):
            mode = deterministic_mode(r.temperature)
            index = self._index[r.req_id]
            ctx = r.token_ids.cpu().numpy() if isinstance(r.token_ids, torch.Tensor) else r.token_ids
            index.update(ctx)  # also when b == 0: the next call reads only the new tokens
            if b <= 0:
                out.append(TreeProposal.empty(mode))
                continue
            chosen, lengths = index.matches(self.max_matches, self.window)
            out.append(self._trie(index.tokens, chosen, lengths, b, mode))
        return out

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
        chosen = ends[order].tolist()
        return self._trie(tokens.tolist(), chosen, length[chosen].tolist(), budget, mode)

    def _trie(self, tokens: list[int], chosen: list[int], lengths: list[int], budget: int, mode: Mode) -> TreeProposal:
        """Steps 3-4: the weighted trie of the chosen matches' continuations, its best `budget` nodes."""
        if not chosen:
            return TreeProposal.empty(mode)
        nodes: list[_TrieNode] = []
        roots: dict[int, int] = {}  # token -> trie node index of a child of the root
        total = 0
        last = len(tokens)
        # A node deeper than the budget is never kept (its ancestors rank before it and would fill the
        # budget first), and shallower nodes' weights do not depend on it: the trie stops there.
        reach = min(self.max_depth, budget)
        for i, n in zip(chosen, lengths):
            w = self.length_weight ** (int(n) - self.min_n)
            total += w
            level, parent = roots, NO_PARENT
            for depth, tok in enumerate(tokens[i + 1 : min(i + 1 + reach, last)], start=1):
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
        tree = Tree(long_tensor(parents), long_tensor([nodes[j].token for j in keep]))
        scores = torch.from_numpy(np.array([nodes[j].weight / total for j in keep], dtype=np.float64))
        return TreeProposal(tree, mode, scores=scores)
