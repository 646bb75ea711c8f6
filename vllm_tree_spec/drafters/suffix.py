"""Model-free tree drafts from suffix trees (Arctic Inference's SuffixDecoding).

`arctic_inference.suffix_decoding.SuffixDecodingCache` (Snowflake, Apache-2.0;
the library behind vLLM's `suffix` method, arXiv 2411.04975) keeps one suffix
tree per active request over its prompt and emitted tokens, plus a global
suffix tree over previous responses. Given the context tail it finds the
longest matching suffix and, with `use_tree_spec=True`, returns a *tree* of
continuations: `token_ids`, `parents` (-1 = child of the root), `probs`
(the empirical frequency of each node's path among the matched
continuations) and a `score`. vLLM 0.32 only uses it as a chain.

The children come from counts, not from sampling a distribution, so the tree
is verified with the deterministic rule (q := 1, sample-and-match: one draw
y ~ p per visited node, accept the child equal to y; `verify/`, README
"Lossless guarantees"). Feeding `probs` into min(1, p / q) would be lossy, so
no q is returned.

What this adapter adds on top of the library:

* per-request bookkeeping: each call adds only the committed tokens the cache
  has not seen (`add_active_response`), and refuses a context that rewrites
  tokens already added (a suffix tree cannot forget them);
* the node budget: passed as `max_spec_tokens` and enforced again by keeping
  a topological prefix of the library's best-first order;
* the shape: the library's best chain under the user's caps (exactly the
  draft vLLM's linear `suffix` method verifies), then the branches of its tree
  under the *branch* caps, which by default are the node budget alone. The
  linear caps (a draft of at most max_spec_factor x the matched length, nodes
  of frequency >= min_token_prob) leave most of the budget unused (~2.2 of 6
  candidates per round on chat and code prompts); the tree spends it on the
  library's other continuations and on deeper ones. Whether a node is worth its
  verify row is the engine's call, not a fixed cap: the online policy's score
  gate drops nodes whose calibrated acceptance at their score is below the
  break-even of one more row (docs/planner.md section 4);
* a score that ranks nodes by how likely they are accepted: the path
  frequency f times m / (m + d), for a node at depth d drafted from a match of
  m tokens. The frequency alone ranks poorly: a continuation seen once after a
  one-token match has f = 1. The factor is the linear caps' rule (a match of m
  tokens predicts about m more) made soft. Replayed against greedy outputs
  (96 chat / code / math prompts of the serving benchmark's pool), the
  chance that an accepted node outranks a rejected one (AUC) is 0.83 with the
  factor and 0.74 without; it only orders nodes, the gate calibrates it;
* a canonical tree: the order is checked (re-listed topologically if the
  library ever returns otherwise) and duplicate sibling tokens are merged, so
  the deterministic rule sees distinct children.

Library notes (arctic-inference 0.3.0): `speculate` never matches the whole
context it is given (the longest match it tries is len(context) - 1 tokens),
so pass the full tail; it keeps the last `max_tree_depth` tokens itself.
`max_spec_tokens=None` fails inside the library (`self.max_depth` does not
exist), so it is always passed explicitly.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from vllm_tree_spec.drafters.base import (
    DraftRequest,
    DrafterError,
    TreeDrafter,
    TreeProposal,
    canonical_tree,
    deterministic_mode,
)

# vLLM 0.32's defaults for its linear `suffix` method (SpeculativeConfig).
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10000
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1


def _scores(draft) -> list[float]:
    """[n] per node of a library draft: path frequency f x m / (m + depth) (m: the draft's match length)."""
    m, depth, out = max(1, draft.match_len), [], []
    for i, (p, f) in enumerate(zip(draft.parents, draft.probs)):
        depth.append(1 if p < 0 else depth[p] + 1)
        out.append(float(f) * m / (m + depth[i]))
    return out


def as_int_list(seq) -> list[int]:
    """A token sequence (list, tuple, tensor, ndarray) as a list of Python ints."""
    if hasattr(seq, "tolist"):
        return [int(t) for t in seq.tolist()]
    return [int(t) for t in seq]


class SuffixTreeDrafter(TreeDrafter):
    """Tree drafts from Arctic Inference's suffix-tree cache.

    Args:
        max_tree_depth: longest context match and draft depth the suffix trees hold.
        max_cached_requests: responses kept in the global tree (FIFO eviction);
            0 disables the global tree (each request drafts from its own context only).
        max_spec_factor, max_spec_offset: the library caps a draft at
            max_spec_factor * match_length + max_spec_offset tokens.
        min_token_prob: drop nodes whose estimated path probability is below this.
            These three cap the best chain, the draft of vLLM's linear `suffix` method.
        branch_spec_factor: caps the branches as max_spec_factor caps the chain; None (default): the
            node budget alone.
        branch_min_token_prob: min_token_prob of the branches (default 0: every continuation seen).
        branches: False drafts the best chain only (one library call per request; `"tree": "chain:K"`).
        validate_proposals: see `TreeDrafter`.
    """

    scores_are_probs = True  # scores: path frequency x m / (m + depth), in (0, 1]

    def __init__(
        self,
        *,
        max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
        max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
        max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
        max_spec_offset: float = 0.0,
        min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
        branch_spec_factor: float | None = None,
        branch_min_token_prob: float = 0.0,
        branches: bool = True,
        validate_proposals: bool = True,
    ) -> None:
        super().__init__(validate_proposals=validate_proposals)
        if max_tree_depth < 1:
            raise DrafterError(f"max_tree_depth = {max_tree_depth} must be >= 1")
        if max_cached_requests < 0:
            raise DrafterError(f"max_cached_requests = {max_cached_requests} must be >= 0 (0 = no global cache)")
        if max_spec_factor < 0:
            raise DrafterError(f"max_spec_factor = {max_spec_factor} must be >= 0")
        if not 0 <= min_token_prob <= 1:
            raise DrafterError(f"min_token_prob = {min_token_prob} must be in [0, 1]")
        if branch_spec_factor is not None and branch_spec_factor <= 0:
            raise DrafterError(f"branch_spec_factor = {branch_spec_factor} must be > 0 (or None: the budget alone)")
        if not 0 <= branch_min_token_prob <= 1:
            raise DrafterError(f"branch_min_token_prob = {branch_min_token_prob} must be in [0, 1]")
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:  # optional dependency (the cpu / gpu extras)
            raise ImportError(
                "SuffixTreeDrafter needs the arctic-inference package: pip install arctic-inference "
                "(or the project's cpu / gpu extra)"
            ) from e
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.branch_spec_factor = branch_spec_factor
        self.branch_min_token_prob = branch_min_token_prob
        self.branches = branches
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self._num_added: dict[Hashable, int] = {}  # tokens of token_ids already in the cache
        self._last_added: dict[Hashable, int] = {}  # the last of them, to detect a rewritten context

    def _start(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        prompt = as_int_list(prompt_token_ids)
        # A finished request with the same id may still own a response in the
        # global tree; the library evicts it here (a fresh request, fresh response).
        self.cache.start_request(req_id, prompt)
        self._num_added[req_id] = len(prompt)
        self._last_added[req_id] = prompt[-1]

    def _finish(self, req_id: Hashable) -> None:
        # The response stays in the global tree for later requests (until evicted).
        self.cache.stop_request(req_id)
        del self._num_added[req_id]
        del self._last_added[req_id]

    def _sync(self, req: DraftRequest) -> None:
        """Add the committed tokens the cache has not seen."""
        rid, n = req.req_id, self._num_added[req.req_id]
        total = len(req.token_ids)
        if total < n or int(req.token_ids[n - 1]) != self._last_added[rid]:
            raise DrafterError(
                f"request {rid!r}: token_ids no longer extends the {n} tokens already added to the suffix "
                f"cache (a suffix tree cannot drop tokens); pass only committed tokens, or finish and restart "
                f"the request"
            )
        if total > n:
            new = as_int_list(req.token_ids[n:])
            self.cache.add_active_response(rid, new)
            self._num_added[rid] = total
            self._last_added[rid] = new[-1]

    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        out = []
        for req, budget in zip(requests, budgets):
            self._sync(req)  # even at budget 0: the response must stay complete for later matches
            mode = deterministic_mode(req.temperature)
            if budget == 0:
                out.append(TreeProposal.empty(mode))
                continue
            context = as_int_list(req.token_ids[-self.max_tree_depth :])
            # The library's best chain first (what vLLM's linear `suffix` method verifies), then its
            # tree's branches in best-first order: the tree contains the linear draft and spends the
            # budget the linear caps leave.
            chain = self.cache.speculate(req.req_id, context, use_tree_spec=False, max_spec_tokens=budget,
                                         max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
                                         min_token_prob=self.min_token_prob)
            nc = len(chain.token_ids)
            parents, tokens, node_scores = list(range(-1, nc - 1)), list(chain.token_ids), _scores(chain)
            if self.branches and not req.linear_only:  # (a `linear` plan verifies the chain alone)
                # a match is >= 1 token, so a factor of `budget` leaves the budget as the only cap
                factor = float(budget) if self.branch_spec_factor is None else self.branch_spec_factor
                branch = self.cache.speculate(req.req_id, context, use_tree_spec=True, max_spec_tokens=budget,
                                              max_spec_factor=factor, max_spec_offset=self.max_spec_offset,
                                              min_token_prob=self.branch_min_token_prob)
                parents += [p if p < 0 else p + nc for p in branch.parents]
                tokens += branch.token_ids
                node_scores += _scores(branch)
            # the chain's nodes stay first (a topological prefix; a branch node equal to one merges into it)
            tree, scores = canonical_tree(parents, tokens, node_scores, budget)
            out.append(TreeProposal(tree, mode, scores=scores, linear_len=nc))
        return out
