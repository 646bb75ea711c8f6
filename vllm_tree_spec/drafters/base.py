"""The tree-drafter interface: what the vLLM integration and every drafter agree on.

A *tree drafter* proposes one draft tree per request per decoding step. p is
the target's distribution, q the draft's (README, "Lossless guarantees"). The
integration layer drives a drafter through three calls that mirror a vLLM
request's life:

    start_request(req_id, prompt_token_ids)   once, before the first propose
    propose(requests, budgets)                every step: one TreeProposal per request
    finish_request(req_id)                    when the request finishes or is aborted

`DraftRequest.token_ids` is the whole committed context, prompt plus every
emitted token; its last token is the **root** of the tree (row 0 in tree.py's
numbering), the token whose KV the next target forward computes. The drafter
reconciles its own incremental state (a suffix tree, a KV cache) with
token_ids on every call: it consumes the tokens it has not seen and, if its
state holds tokens that are no longer the committed prefix, rolls back or
fails loudly. The budget is the most draft nodes the target may verify for
that request this step (0 = no speculation: an empty tree).

What a proposal must say is *how its children were chosen*, because that
decides which lossless verification rule applies (`verify/`; exact-law checks in tests/test_verify_exact.py):

    children chosen by                      mode                          draft_probs
    rank / count (top-k, n-gram, suffix)    DETERMINISTIC                 None (q := 1)
      ... for a greedy request (T = 0)      GREEDY                        None
    i.i.d. draws from q                     SAMPLED                       [N + 1, V] required
    draws from q without replacement        SAMPLED_WITHOUT_REPLACEMENT   [N + 1, V] required

At temperature 0 the deterministic rule draws y ~ p with p one-hot, i.e. it is
the greedy rule; `deterministic_mode` returns GREEDY there so verification can
skip the coins. Feeding a deterministic tree's real q into min(1, p / q) would
be lossy (TV ~ 0.7), which is why such proposals carry no q by default.

`TreeDrafter.propose` validates the call and every proposal (node budget,
distinct siblings, q rows that are distributions and cover the drafted tokens)
around the subclass's `_propose`, so a buggy drafter fails here with a message
naming the field, not later as a silent loss of exactness.

Nothing here imports vLLM.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch

from vllm_tree_spec.sampling import GREEDY_TEMPERATURE
from vllm_tree_spec.tree import Tree, long_tensor
from vllm_tree_spec.verify import Mode

PROB_SUM_TOL = 1e-4  # slack on sum(q) == 1 for a float32 q row


class DrafterError(ValueError):
    """A drafter was called wrongly, or produced a proposal that breaks the contract."""


def deterministic_mode(temperature: float) -> Mode:
    """The verification rule for deterministically chosen children at this temperature."""
    return Mode.GREEDY if temperature <= GREEDY_TEMPERATURE else Mode.DETERMINISTIC


# ---------------------------------------------------------------------------
# Requests and proposals


@dataclass(frozen=True)
class DraftRequest:
    """One request's input to a drafting step.

    Attributes:
        req_id: the request's id (as passed to `start_request`).
        token_ids: [L] committed context, prompt + all emitted tokens; token_ids[-1]
            is the tree root. Any int sequence (list, tuple, 1-D tensor or array).
        temperature: the request's sampling temperature (0 = greedy). Lets a
            drafter pick its verification mode and a sampling drafter its q.
        linear_only: a hint: only the proposal's linear draft will be verified
            (the shape policy's `linear` plan), so a drafter may skip drafting
            the rest. The proposal stays valid either way.
    """

    req_id: Hashable
    token_ids: Sequence[int]  # [L]
    temperature: float = 1.0
    linear_only: bool = False

    def __post_init__(self) -> None:
        if len(self.token_ids) == 0:
            raise DrafterError(
                f"DraftRequest {self.req_id!r}: token_ids is empty; pass the committed context "
                f"(at least the root token, which is token_ids[-1])"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DrafterError(
                f"DraftRequest {self.req_id!r}: temperature = {self.temperature} must be finite and >= 0 "
                f"(0 = greedy)"
            )

    @property
    def root_token(self) -> int:
        return int(self.token_ids[-1])


@dataclass(frozen=True, eq=False)
class TreeProposal:
    """A drafter's tree for one request.

    Attributes:
        tree: parents [N] and tokens [N], topological order (row 0 = the root,
            row i + 1 = node i, as everywhere in this package).
        mode: the verification rule that matches how the children were chosen.
        draft_probs: [N + 1, V] q per row: row r = the distribution node r's
            children were drawn from (zero on rows the drafter never expanded). Required
            by the sampled modes; None for deterministic trees unless the
            drafter was asked for it as a diagnostic.
        scores: [N] float64 or None, the drafter's confidence in each node's
            path (log q of the path for model drafters, an empirical path
            frequency for suffix / n-gram drafters). Informational: budget
            policies and metrics may read it, verification never does.
        linear_len: how many leading nodes (0 .. linear_len - 1, a chain from
            the root) are the draft the drafter's *linear* counterpart would
            verify (suffix: vLLM's linear `suffix` draft); None: the rank-0 path.
            The shape policy's `linear` plan keeps exactly those nodes;
            verification never reads it.
    """

    tree: Tree
    mode: Mode
    draft_probs: torch.Tensor | None = None  # [N + 1, V]
    scores: torch.Tensor | None = None  # [N]
    linear_len: int | None = None

    @staticmethod
    def empty(mode: Mode = Mode.DETERMINISTIC) -> "TreeProposal":
        """No speculation: the target verifies only the root and emits one token."""
        return TreeProposal(Tree.chain(0, []), mode, scores=torch.zeros(0, dtype=torch.float64))

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    def validate(self, budget: int | None = None, vocab_size: int | None = None) -> None:
        """Raise DrafterError if the proposal breaks the contract (see the module docstring)."""
        tree, n = self.tree, self.tree.num_nodes
        if not isinstance(self.mode, Mode):
            raise DrafterError(f"mode = {self.mode!r}; use a verify.Mode member")
        if tree.tokens is None:
            raise DrafterError("tree has no tokens; a proposal needs Tree(parents, tokens)")
        if budget is not None and n > budget:
            raise DrafterError(f"proposal has {n} nodes but the budget is {budget}; truncate to a topological prefix")
        toks = tree.tokens.tolist()
        if n and min(toks) < 0:
            raise DrafterError(f"tree.tokens holds a negative id {min(toks)}; draft real token ids")
        if vocab_size is not None and n and max(toks) >= vocab_size:
            raise DrafterError(f"tree.tokens holds id {max(toks)} >= vocab_size {vocab_size}")
        if self.scores is not None and tuple(self.scores.shape) != (n,):
            raise DrafterError(f"scores has shape {tuple(self.scores.shape)}; expected [N] = [{n}]")
        if self.linear_len is not None:
            k = self.linear_len
            if not 0 <= k <= n or tree.parents[:k].tolist() != list(range(-1, k - 1)):
                raise DrafterError(f"linear_len = {k}: the first linear_len nodes must be a chain from the root "
                                   f"(parents -1, 0, 1, ...) within the {n} nodes; pass None if there is none")
        if self.mode != Mode.SAMPLED:
            # Only i.i.d. children may repeat a token (the sampled rule tests each copy in turn).
            dups = tree.duplicate_siblings()
            if dups:
                i, j = dups[0]
                raise DrafterError(
                    f"nodes {i} and {j} are siblings with the same token {int(tree.tokens[i])} in mode "
                    f"{self.mode.name.lower()}; merge duplicate siblings (re-map their children)"
                )
        q = self.draft_probs
        if q is None:
            if self.mode.needs_draft_probs and n:  # an empty tree drew nothing: no q to verify against
                raise DrafterError(
                    f"mode {self.mode.name.lower()} needs draft_probs [N + 1, V]: the q each row's children "
                    f"were drawn from"
                )
            return
        if q.dim() != 2 or q.shape[0] != n + 1:
            raise DrafterError(f"draft_probs has shape {tuple(q.shape)}; expected [N + 1, V] with N + 1 = {n + 1}")
        if vocab_size is not None and q.shape[1] != vocab_size:
            raise DrafterError(f"draft_probs has vocab {q.shape[1]}; the drafter's vocab_size is {vocab_size}")
        if not self.mode.needs_draft_probs:
            return  # diagnostic q of a deterministic tree: never read by verification
        rows = [r for r, ch in enumerate(tree.children) if ch]
        if not rows:
            return
        sub = q[rows].to(torch.float64)
        if not bool(torch.isfinite(sub).all()) or bool((sub < 0).any()):
            raise DrafterError("draft_probs has negative or non-finite entries; pass probabilities, not logits")
        err = (sub.sum(-1) - 1).abs()
        if bool((err > PROB_SUM_TOL).any()):
            r = rows[int((err > PROB_SUM_TOL).nonzero()[0])]
            raise DrafterError(f"draft_probs[{r}] sums to {float(q[r].sum()):.6g}, not 1; normalise q")
        qx = q[(tree.parents + 1).to(q.device), tree.tokens.to(q.device)]  # [N] q of each token at its parent row
        if bool((qx <= 0).any()):
            i = int((qx <= 0).nonzero()[0])
            raise DrafterError(
                f"node {i}'s token {int(tree.tokens[i])} has q = 0 at its parent row {int(tree.parents[i]) + 1}: "
                f"it cannot have been drawn from that row"
            )


# ---------------------------------------------------------------------------
# The drafter interface


class TreeDrafter(ABC):
    """Base class of all tree drafters.

    Subclasses implement `_propose` (and usually `_start` / `_finish` for
    per-request state); the public methods validate calls and results.
    Subclasses that define `__init__` must call `super().__init__()`.

    Attributes:
        vocab_size: the drafter's vocabulary, or None if it does not know it
            (model-free drafters); used to validate proposals.
        validate_proposals: check every proposal (cheap: O(N) Python per tree,
            plus O(N * V) on q rows for sampled trees). Turn off in production
            once the drafter is trusted.
        scores_are_probs: the proposals' `scores` are path frequencies in [0, 1]
            (False: log q of the path); the shape policy's score gate reads them.
    """

    vocab_size: int | None = None
    scores_are_probs: bool = False

    def __init__(self, *, validate_proposals: bool = True) -> None:
        self.validate_proposals = validate_proposals
        self._prompt_len: dict[Hashable, int] = {}  # active requests -> prompt length
        self._rng_keys: dict[Hashable, Hashable] = {}  # active requests -> what seeds their draft sampling

    # -- lifecycle ------------------------------------------------------------

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int], *, seed: int | None = None) -> None:
        """Register a request before its first `propose`.

        seed: the request's own sampling seed, if it has one. Drafters that sample their children seed the
        request's generator from it (and their own `seed`), so a seeded request drafts the same trees on every
        run; without it they seed from the request id, which a server makes unique per request."""
        if req_id in self._prompt_len:
            raise DrafterError(f"request {req_id!r} is already active; call finish_request before reusing its id")
        if len(prompt_token_ids) == 0:
            raise DrafterError(f"request {req_id!r}: prompt_token_ids is empty; pass the prompt's token ids")
        self._rng_keys[req_id] = req_id if seed is None else ("seed", int(seed))
        self._start(req_id, prompt_token_ids)
        self._prompt_len[req_id] = len(prompt_token_ids)

    def rng_key(self, req_id: Hashable) -> Hashable:
        """What seeds the request's draft sampling: its sampling seed if it has one, else its id."""
        return self._rng_keys.get(req_id, req_id)

    def finish_request(self, req_id: Hashable) -> None:
        """Drop the request's per-request state (its id may then be reused)."""
        if req_id not in self._prompt_len:
            raise DrafterError(f"request {req_id!r} is not active; call start_request first")
        del self._prompt_len[req_id]
        self._finish(req_id)
        self._rng_keys.pop(req_id, None)

    @property
    def active_requests(self) -> list[Hashable]:
        return list(self._prompt_len)

    def is_active(self, req_id: Hashable) -> bool:
        """Whether `req_id` was started and not finished (O(1): the runner asks for every request every step)."""
        return req_id in self._prompt_len

    def _start(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        """Hook: create per-request state (default: none)."""

    def _finish(self, req_id: Hashable) -> None:
        """Hook: drop per-request state (default: none)."""

    # -- drafting -------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest], budgets: Sequence[int] | int) -> list[TreeProposal]:
        """One tree per request, in order.

        Args:
            requests: the batch (each started, ids distinct).
            budgets: [B] max draft nodes per request (0 = empty tree), or one int for all.

        Returns:
            [B] proposals; proposal b has at most budgets[b] nodes.
        """
        budgets = [budgets] * len(requests) if isinstance(budgets, int) else [int(b) for b in budgets]
        if len(budgets) != len(requests):
            raise DrafterError(f"{len(budgets)} budgets for {len(requests)} requests; pass one budget per request")
        seen = set()
        for r, b in zip(requests, budgets):
            if not isinstance(r, DraftRequest):
                raise DrafterError(f"requests holds a {type(r).__name__}; pass DraftRequest objects")
            if r.req_id not in self._prompt_len:
                raise DrafterError(f"request {r.req_id!r} is not active; call start_request(req_id, prompt) first")
            if r.req_id in seen:
                raise DrafterError(f"request {r.req_id!r} appears twice in one propose call")
            seen.add(r.req_id)
            if b < 0:
                raise DrafterError(f"budget {b} for request {r.req_id!r} must be >= 0 (0 = no speculation)")
            if len(r.token_ids) < self._prompt_len[r.req_id]:
                raise DrafterError(
                    f"request {r.req_id!r}: token_ids has {len(r.token_ids)} tokens, fewer than its "
                    f"{self._prompt_len[r.req_id]}-token prompt; pass prompt + emitted tokens"
                )
        out = self._propose(list(requests), budgets)
        if len(out) != len(requests):
            raise DrafterError(
                f"{type(self).__name__}._propose returned {len(out)} proposals for {len(requests)} requests"
            )
        if self.validate_proposals:
            for r, b, p in zip(requests, budgets, out):
                try:
                    p.validate(b, self.vocab_size)
                except DrafterError as e:
                    raise DrafterError(f"{type(self).__name__} proposal for request {r.req_id!r}: {e}") from None
        return out

    @abstractmethod
    def _propose(self, requests: list[DraftRequest], budgets: list[int]) -> list[TreeProposal]:
        """Draft one tree per request (inputs already validated)."""


# ---------------------------------------------------------------------------
# Helpers for drafters whose source trees may be messy


def canonical_tree(
    parents: Sequence[int],
    tokens: Sequence[int],
    scores: Sequence[float] | None = None,
    budget: int | None = None,
) -> tuple[Tree, torch.Tensor | None]:
    """A valid proposal tree from a parent array that may be unordered or repeat sibling tokens.

    * Order: nodes are re-listed topologically, keeping the given order where
      it already is topological (Kahn's algorithm, smallest index first), so a
      best-first source order survives.
    * Duplicate siblings (same parent, same token) are merged into the first
      one; the duplicate's children move to the survivor (and merge there in
      turn). A merged node keeps the larger score.
    * budget: keep the first `budget` nodes of that order (a topological
      prefix is always a tree).

    Args:
        parents: [N] parent index per node, -1 = child of the root.
        tokens: [N] token ids.
        scores: [N] per-node scores or None.

    Returns:
        (tree, scores [M] float64 or None), M <= N.
    """
    par = [int(p) for p in parents]
    tok = [int(t) for t in tokens]
    n = len(par)
    if len(tok) != n or (scores is not None and len(scores) != n):
        raise DrafterError(
            f"parents has {n} entries but tokens {len(tok)}"
            + ("" if scores is None else f" and scores {len(scores)}")
            + "; give one entry per node"
        )
    bad = [i for i, p in enumerate(par) if p < -1 or p >= n or p == i]
    if bad:
        raise DrafterError(f"parents[{bad[0]}] = {par[bad[0]]} is not -1 (root) or another node's index in [0, {n})")
    if all(p < i for i, p in enumerate(par)):  # already topological (the usual case): keep the order
        order = range(n)
    else:
        children: list[list[int]] = [[] for _ in range(n + 1)]  # by parent row
        for i, p in enumerate(par):
            children[p + 1].append(i)
        order, heap = [], list(children[0])
        heapq.heapify(heap)
        while heap:
            i = heapq.heappop(heap)
            order.append(i)
            for c in children[i + 1]:
                heapq.heappush(heap, c)
        if len(order) != n:
            raise DrafterError(f"parents has a cycle: {n - len(order)} nodes are not reachable from the root")

    new_index: dict[int, int] = {}  # old node -> surviving new node
    slot: dict[tuple[int, int], int] = {}  # (new parent, token) -> new node
    new_par: list[int] = []
    new_tok: list[int] = []
    new_score: list[float] = []
    for i in order:
        p = -1 if par[i] == -1 else new_index[par[i]]
        key = (p, tok[i])
        if key in slot:
            j = slot[key]
            if scores is not None:
                new_score[j] = max(new_score[j], float(scores[i]))
        else:
            j = slot[key] = len(new_par)
            new_par.append(p)
            new_tok.append(tok[i])
            if scores is not None:
                new_score.append(float(scores[i]))
        new_index[i] = j
    m = len(new_par) if budget is None else min(budget, len(new_par))
    tree = Tree(long_tensor(new_par[:m]), long_tensor(new_tok[:m]))
    out_scores = None if scores is None else torch.from_numpy(np.array(new_score[:m], dtype=np.float64))
    return tree, out_scores
