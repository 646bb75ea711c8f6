"""Tree builders: from draft distributions to draft trees.

Notation: p = target, q = draft. A builder asks the drafter for q at some tree
rows, picks children from it, and returns a `DraftTree`: the `Tree` (parents +
tokens), each node's path score (sum of log q along its path from the root)
and, when asked for, the q rows the children were drawn from. Rows follow
tree.py: row 0 is the root (the last committed token), row i + 1 is node i.

How children are produced decides which lossless rule may verify them
(`verify/`, README "Lossless guarantees"), so every `DraftTree` records it:

    builder                      children                        verification rule
    expand_static                top-k ranks of q (deterministic)  q := 1 (sample-and-match)
    build_dynamic(_budget)       top-k beams of q (deterministic)  q := 1
    sample_children(iid)         i.i.d. draws from q               RRS with replacement, q fixed
    sample_children(w/o repl.)   draws without replacement         RRS without replacement, q renormalised

Using the real q in min(1, p / q) for deterministic top-k children is lossy
(an exact enumeration finds TV ~ 0.7; tests/test_verify_exact.py flags
such rules); that is why the top-k builders return q
only on request.

Draft access is batched per tree level: a builder issues one `DraftFn` call
per level (static and sampled trees) or per step (dynamic trees) covering
every row it expands in every request of the batch. A query names the request
and the draft path below the root; a vLLM draft model keeps its own KV per
request and can key it by the path, while tests use plain functions of the
token context (`DraftQuery.context` = prefix + path, see `context_draft`).

Static shapes come either as a shape-only `Tree` (a child's rank is its index
among its siblings) or as child-rank paths, which may skip ranks: the path
set [(0,), (2,)] asks for the best and the third-best child of the root.

Sequoia's optimal static tree for a node budget, which these builders fill, is in `sequoia.py`
(its names are re-exported here: `build.optimal_static_trees` keeps working).

Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Protocol, Sequence

import torch

from vllm_tree_spec.sequoia import (  # noqa: F401  (re-exported)
    ACCEPTANCE_SUM_TOL,
    acceptance_table,
    expected_accepted_length,
    optimal_static_tree,
    optimal_static_trees,
)
from vllm_tree_spec.tree import NO_PARENT, Tree, TreeShape

PROB_SUM_TOL = 1e-3  # slack on sum(q) <= 1 for low-precision drafts

# A path is the tuple of draft tokens from the root's child down to a node;
# the root's own path is empty.
Path = tuple[int, ...]
RankPaths = Iterable[Sequence[int] | int]


class ChildSampling(str, Enum):
    """How a builder produced the children of each node (selects the verification rule)."""

    TOPK = "topk"  # deterministic top-k: verify with q := 1
    IID = "iid"  # i.i.d. draws from q: RRS with replacement, q fixed
    WITHOUT_REPLACEMENT = "without_replacement"  # draw order matters: RRS without replacement


# ---------------------------------------------------------------------------
# Draft interface


@dataclass(frozen=True)
class DraftQuery:
    """One row the builder wants q for.

    Attributes:
        request: index of the request in the batch being built.
        path: draft tokens from the root's child down to the row (() = the root).
        prefix: tokens the caller handed the builder for this request (often the
            committed context ending with the root token; () when the drafter
            tracks context itself).
    """

    request: int
    path: Path
    prefix: tuple[int, ...] = ()

    @property
    def context(self) -> tuple[int, ...]:
        """prefix + path: the full token context of the row."""
        return self.prefix + self.path


class DraftFn(Protocol):
    """A drafter: q for a batch of rows, one call per tree level.

    Returns [len(queries), V] probabilities (not logits), each row the draft
    distribution of the next token after the query's row. Rows must be
    non-negative, finite and sum to at most 1 (log q <= 0 is what keeps path
    scores non-increasing along a path).
    """

    def __call__(self, queries: Sequence[DraftQuery]) -> torch.Tensor: ...


def context_draft(fn: Callable[..., torch.Tensor], *, batched: bool = False) -> DraftFn:
    """Adapt a function of token contexts to `DraftFn`.

    batched=False: fn(context: tuple[int, ...]) -> [V] q, called once per row.
    batched=True:  fn(contexts: list[tuple[int, ...]]) -> [n, V] q.
    """

    def draft(queries: Sequence[DraftQuery]) -> torch.Tensor:
        contexts = [qr.context for qr in queries]
        if batched:
            return fn(contexts)
        return torch.stack([torch.as_tensor(fn(c)) for c in contexts]) if contexts else torch.zeros(0, 0)

    return draft


def _call_draft(draft: DraftFn, queries: list[DraftQuery], vocab: int | None = None) -> torch.Tensor:
    """Call the drafter and check what it returned. -> [len(queries), V]"""
    q = draft(queries)
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"draft returned {type(q).__name__}; return a torch.Tensor of shape [num_queries, vocab]")
    if q.dim() != 2 or q.shape[0] != len(queries):
        raise ValueError(
            f"draft returned shape {tuple(q.shape)} for {len(queries)} queries; "
            f"return [num_queries, vocab] probabilities, one row per query"
        )
    if vocab is not None and q.shape[1] != vocab:
        raise ValueError(f"draft returned vocab size {q.shape[1]} after {vocab} earlier; keep the vocabulary fixed")
    if not q.is_floating_point():
        raise ValueError(f"draft returned dtype {q.dtype}; return floating-point probabilities")
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        raise ValueError("draft returned negative or non-finite values; return probabilities (softmax), not logits")
    sums = q.sum(-1, dtype=torch.float64)
    if bool((sums <= 0).any()) or bool((sums > 1 + PROB_SUM_TOL).any()):
        bad = int(((sums <= 0) | (sums > 1 + PROB_SUM_TOL)).nonzero()[0])
        raise ValueError(
            f"draft row {bad} sums to {float(sums[bad]):.6g}; each row must be a distribution "
            f"(0 < sum <= 1), normalise the draft probabilities"
        )
    return q


def _top_ranks(q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row, ties toward the lower token id.

    q: [n, V] -> (ids [n, k] int64, log q [n, k] float64), best first.
    """
    if k > q.shape[-1]:
        raise ValueError(f"asked for the top {k} tokens of a vocabulary of {q.shape[-1]}; lower topk / child ranks")
    # torch.topk finds the k-th largest value but does not promise which of several equal values
    # it keeps, so the selection is rebuilt from it: every token above that value, then the tied
    # ones in ascending id order; a stable sort of those k orders them best first. This is the
    # stable full sort's answer, at topk's cost (the drafters call it on every tree level).
    # q comes from _call_draft (finite rows), so each row selects exactly k tokens.
    n = q.shape[0]
    kth = torch.topk(q, k, dim=-1).values[:, -1:]  # [n, 1]
    above, tied = q > kth, q == kth  # [n, V]
    need = k - above.sum(-1, keepdim=True)  # [n, 1] tied tokens to take, >= 1
    sel = above | (tied & (tied.cumsum(-1) <= need))  # [n, V], k per row
    ids = sel.nonzero()[:, 1].view(n, k)  # ascending ids
    order = torch.sort(q.gather(1, ids), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)  # [n, k] best first, ties toward the lower id
    return ids, torch.log(q.gather(1, ids).to(torch.float64))


def _best_first(scores: torch.Tensor) -> torch.Tensor:
    """Column order by descending score, ties toward the earlier column. [B, M] -> [B, M]"""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


# ---------------------------------------------------------------------------
# Result


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A built draft tree for one request.

    Attributes:
        tree: parents [N] and tokens [N].
        scores: [N] float64, log q of each node's path (sum of log q(token | parent row)).
        sampling: how the children were produced (selects the verification rule).
        q: [N + 1, V] draft distribution at each row (row 0 = root): the law the
            row's children were drawn from. Defined on every row that has
            children; rows the builder never expanded are zero. None unless requested
            (always present for sampled trees, whose verification needs it).
    """

    tree: Tree
    scores: torch.Tensor  # [N]
    sampling: ChildSampling
    q: torch.Tensor | None = None  # [N + 1, V]

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes


# ---------------------------------------------------------------------------
# Static shapes


def _shape_and_ranks(shape: Tree | RankPaths | str) -> tuple[Tree, list[int]]:
    """A shape-only tree and each node's requested child rank."""
    if isinstance(shape, Tree):
        return Tree(shape.parents), shape.sibling_rank.tolist()
    paths = shape if isinstance(shape, str) else list(shape)  # an iterator is read once
    tree = Tree.from_paths(paths)  # validates (prefix-closed, no duplicates, ranks >= 0)
    if isinstance(paths, str):
        paths = ast.literal_eval(paths)
    norm = sorted(((p,) if isinstance(p, int) else tuple(p) for p in paths), key=lambda t: (len(t), t))
    return tree, [p[-1] for p in norm]  # same (len, path) order as Tree.from_paths


def _rows_by_level(tree: Tree) -> list[list[int]]:
    """Rows with children, grouped by level (level 0 = the root row)."""
    levels: list[list[int]] = [[] for _ in range(tree.max_depth)]
    depth = [0] + tree.depth.tolist()  # by row
    for row, ch in enumerate(tree.children):
        if ch:
            levels[depth[row]].append(row)
    return levels


def expand_static(
    draft: DraftFn, shape: Tree | RankPaths | str, *, prefix: Sequence[int] = (), return_q: bool = False
) -> DraftTree:
    """Fill a static shape with the draft's top-ranked tokens (one request).

    The node with child-rank path (r_1, ..., r_k) gets the r_k-th most likely
    token (0-based, ties toward the lower id) of q at its parent. Verify with
    q := 1. See `expand_static_batch`.
    """
    return expand_static_batch(draft, shape, [prefix], return_q=return_q)[0]


def expand_static_batch(
    draft: DraftFn,
    shape: Tree | RankPaths | str,
    prefixes: Sequence[Sequence[int]],
    *,
    return_q: bool = False,
) -> list[DraftTree]:
    """`expand_static` for a batch of requests sharing one shape.

    One draft call per level, over every row with children in every request.

    Args:
        draft: the drafter.
        shape: a shape-only Tree (rank = index among siblings) or child-rank paths.
        prefixes: one token prefix per request (handed to the drafter in each query).
        return_q: also return q at every expanded row.
    """
    tree, ranks = _shape_and_ranks(shape)
    n, nb = tree.num_nodes, len(prefixes)
    pre = [tuple(int(t) for t in p) for p in prefixes]
    tokens = [[0] * n for _ in range(nb)]
    scores = torch.zeros(nb, n + 1, dtype=torch.float64)  # [B, N + 1] by row, root = 0
    paths: list[list[Path]] = [[()] * (n + 1) for _ in range(nb)]  # by row
    q_rows: list[dict[int, torch.Tensor]] = [{} for _ in range(nb)]
    vocab = None
    for rows in _rows_by_level(tree):
        queries = [DraftQuery(b, paths[b][r], pre[b]) for b in range(nb) for r in rows]
        if not queries:
            continue
        q = _call_draft(draft, queries, vocab)  # [B * len(rows), V]
        vocab = q.shape[1]
        need = 1 + max(ranks[i] for r in rows for i in tree.children[r])
        ids, logq = _top_ranks(q, need)  # [B * len(rows), need]
        ids_l = ids.tolist()
        for j, qr in enumerate(queries):
            b, r = qr.request, j % len(rows)
            row = rows[r]
            if return_q:
                q_rows[b][row] = q[j]
            for i in tree.children[row]:
                tok = ids_l[j][ranks[i]]
                tokens[b][i] = tok
                scores[b, i + 1] = scores[b, row] + logq[j, ranks[i]]
                paths[b][i + 1] = paths[b][row] + (tok,)
    return [
        DraftTree(
            tree=tree.with_tokens(torch.tensor(tokens[b], dtype=torch.long)),
            scores=scores[b, 1:].clone(),
            sampling=ChildSampling.TOPK,
            q=_stack_q(q_rows[b], n, vocab) if return_q else None,
        )
        for b in range(nb)
    ]


def _stack_q(rows: dict[int, torch.Tensor], n: int, vocab: int | None) -> torch.Tensor:
    """[N + 1, V] from {row: [V]}, zero where the row was never expanded."""
    if not rows:
        return torch.zeros(n + 1, vocab or 0)
    ref = next(iter(rows.values()))
    out = torch.zeros(n + 1, ref.shape[0], dtype=ref.dtype, device=ref.device)
    for r, v in rows.items():
        out[r] = v
    return out


# ---------------------------------------------------------------------------
# Dynamic trees (EAGLE-2 / SGLang)


def build_dynamic(
    draft: DraftFn, shape: TreeShape | str, *, prefix: Sequence[int] = (), return_q: bool = False
) -> DraftTree:
    """EAGLE-2 / SGLang dynamic tree for one request. See `build_dynamic_batch`."""
    return build_dynamic_batch(draft, shape, [prefix], return_q=return_q)[0]


def build_dynamic_batch(
    draft: DraftFn,
    shape: TreeShape | str,
    prefixes: Sequence[Sequence[int]],
    *,
    return_q: bool = False,
) -> list[DraftTree]:
    """EAGLE-2 / SGLang dynamic trees `s{steps}_k{topk}_d{draft_tokens}` for a batch.

    Step 1 takes the top-k children of the root. Each later step expands the
    k beams (one draft call for all beams of all requests), scores the k * k
    children by cumulative log q (beam score + log q(child)) and keeps the best
    k as the next beams. Candidates are numbered in creation order (step 1:
    0..k-1; step t: beam-major, beam i's j-th child at offset + i * k + j), and
    the tree is the global top (d - 1) candidates by score, sorted by number.

    Ties go to the earlier candidate everywhere. Since log q <= 0 a child never
    scores above its parent, and its parent is an earlier candidate, so the
    parent always ranks first: the kept set is ancestor-closed even when a
    child has q = 1 (or both scores are -inf), and sorting by candidate number
    gives a topological order.
    """
    shape = TreeShape.parse(shape) if isinstance(shape, str) else shape
    s, k, keep = shape.steps, shape.topk, shape.num_nodes
    nb = len(prefixes)
    pre = [tuple(int(t) for t in p) for p in prefixes]

    q0 = _call_draft(draft, [DraftQuery(b, (), pre[b]) for b in range(nb)])  # [B, V]
    vocab = q0.shape[1]
    ids, logq = _top_ranks(q0, k)  # [B, k]
    cand_tokens = [ids.cpu()]  # per step: [B, k], then [B, k * k]
    cand_scores = [logq.cpu()]
    cand_parent = [torch.full((nb, k), NO_PARENT, dtype=torch.long)]  # candidate number of the parent
    beam_scores = logq.cpu()  # [B, k]
    beam_cands = torch.arange(k).expand(nb, k)  # [B, k] candidate number of each beam
    beam_paths = [[(t,) for t in row] for row in ids.tolist()]
    expanded_q: list[dict[int, torch.Tensor]] = [{} for _ in range(nb)]  # candidate number -> [V]
    offset = k
    for _ in range(1, s):
        queries = [DraftQuery(b, beam_paths[b][j], pre[b]) for b in range(nb) for j in range(k)]
        q = _call_draft(draft, queries, vocab)  # [B * k, V]
        if return_q:
            for b in range(nb):
                for j in range(k):
                    expanded_q[b][int(beam_cands[b, j])] = q[b * k + j]
        ids, logq = _top_ranks(q, k)  # [B * k, k]
        ids, logq = ids.cpu().reshape(nb, k * k), logq.cpu().reshape(nb, k, k)
        scores = (beam_scores[:, :, None] + logq).reshape(nb, k * k)  # [B, k * k] cumulative log q
        cand_tokens.append(ids)
        cand_scores.append(scores)
        cand_parent.append(beam_cands.repeat_interleave(k, dim=1))  # [B, k * k]
        best = _best_first(scores)[:, :k]  # [B, k] next beams, positions in this step
        beam_scores = scores.gather(1, best)
        beam_paths = [
            [beam_paths[b][c // k] + (int(ids[b, c]),) for c in best[b].tolist()] for b in range(nb)
        ]
        beam_cands = offset + best
        offset += k * k

    all_tokens = torch.cat(cand_tokens, 1)  # [B, M], M = k + (s - 1) * k * k
    all_scores = torch.cat(cand_scores, 1)
    all_parent = torch.cat(cand_parent, 1)
    kept = torch.sort(_best_first(all_scores)[:, :keep], dim=1).values  # [B, d - 1], topological order
    out = []
    for b in range(nb):
        sel = kept[b].tolist()
        node_of = {c: i for i, c in enumerate(sel)}
        parents = []
        for c in sel:
            pc = int(all_parent[b, c])
            assert pc == NO_PARENT or pc in node_of, "dynamic tree lost ancestor closure (score tie-break broken)"
            parents.append(NO_PARENT if pc == NO_PARENT else node_of[pc])
        q_out = None
        if return_q:
            rows = {0: q0[b]} | {node_of[c] + 1: v for c, v in expanded_q[b].items() if c in node_of}
            q_out = _stack_q(rows, keep, vocab)
        out.append(
            DraftTree(
                tree=Tree(torch.tensor(parents, dtype=torch.long), all_tokens[b, sel]),
                scores=all_scores[b, sel].clone(),
                sampling=ChildSampling.TOPK,
                q=q_out,
            )
        )
    return out


def budget_shape(depth: int, topk: int, budget: int) -> TreeShape:
    """The `TreeShape` of EAGLE-2's (depth, top_k, total_tokens) parameters.

    depth = levels below the root (EAGLE-2's `depth` + 1; SGLang's steps),
    budget = draft nodes kept by the global rerank (EAGLE-2's `total_tokens`;
    SGLang's num_draft_tokens - 1).
    """
    if depth < 1 or topk < 1:
        raise ValueError(f"depth = {depth}, topk = {topk}: both must be >= 1")
    cap = topk + (depth - 1) * topk * topk
    if not 1 <= budget <= cap:
        raise ValueError(
            f"budget = {budget} draft nodes: need 1 <= budget <= {cap} "
            f"(the candidates that {depth} levels of top-{topk} produce); change budget or raise depth/topk"
        )
    return TreeShape(depth, topk, budget + 1)


def build_dynamic_budget(
    draft: DraftFn,
    depth: int,
    topk: int,
    budget: int,
    *,
    prefixes: Sequence[Sequence[int]] = ((),),
    return_q: bool = False,
) -> list[DraftTree]:
    """Expand by cumulative draft log-prob, then rerank globally to `budget` nodes.

    The same algorithm as `build_dynamic_batch`, parameterised as EAGLE-2 is
    (see `budget_shape` for the mapping). Returns one tree per prefix.
    """
    return build_dynamic_batch(draft, budget_shape(depth, topk, budget), prefixes, return_q=return_q)


# ---------------------------------------------------------------------------
# Sampled children


def draw_without_replacement(q: torch.Tensor, c: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """c distinct tokens per row, drawn without replacement from q, in draw order.

    Exponential race: token x finishes at E_x / q(x), E_x ~ Exp(1); the
    finishing order has the law of sequential draws without replacement
    (the Gumbel-top-k trick, as RSD uses). q: [n, V] -> [n, c] int64.
    """
    support = (q > 0).sum(-1)
    if bool((support < c).any()):
        raise ValueError(
            f"cannot draw {c} distinct children from a draft row with only {int(support.min())} "
            f"tokens of positive probability; draw fewer children or sample with replacement"
        )
    e = torch.empty(q.shape, dtype=torch.float64, device=q.device).exponential_(generator=generator)
    keys = e / q.to(torch.float64)  # q = 0 -> inf: never drawn
    return torch.sort(keys, dim=-1, stable=True).indices[:, :c]


def sample_children(
    draft: DraftFn,
    shape: Tree | RankPaths | str,
    *,
    replacement: bool,
    generator: torch.Generator | None = None,
    prefix: Sequence[int] = (),
) -> DraftTree:
    """Fill a static shape with sampled children (one request). See `sample_children_batch`."""
    return sample_children_batch(draft, shape, [prefix], replacement=replacement, generators=[generator])[0]


def sample_children_batch(
    draft: DraftFn,
    shape: Tree | RankPaths | str,
    prefixes: Sequence[Sequence[int]],
    *,
    replacement: bool,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[DraftTree]:
    """Fill a static shape with children sampled from q, one draft call per level.

    A row with c children draws c tokens from its q; the j-th child (index
    among siblings) is the j-th draw. replacement=True: i.i.d. draws, and
    duplicates stay separate siblings (the SpecInfer verifier must process
    each one). replacement=False: distinct tokens in draw order, the order the
    without-replacement verifier walks. Returned q is the unmodified q at each
    row; the verifier renormalises it itself.

    Args:
        generators: one generator per request, so a request's tree does not
            depend on the rest of the batch (None = torch's default generator).
    """
    tree = _shape_and_ranks(shape)[0]
    n, nb = tree.num_nodes, len(prefixes)
    gens = list(generators) if generators is not None else [None] * nb
    if len(gens) != nb:
        raise ValueError(f"generators has {len(gens)} entries for {nb} requests; pass one per request")
    pre = [tuple(int(t) for t in p) for p in prefixes]
    tokens = [[0] * n for _ in range(nb)]
    scores = torch.zeros(nb, n + 1, dtype=torch.float64)  # [B, N + 1] by row
    paths: list[list[Path]] = [[()] * (n + 1) for _ in range(nb)]
    q_rows: list[dict[int, torch.Tensor]] = [{} for _ in range(nb)]
    vocab = None
    for rows in _rows_by_level(tree):
        queries = [DraftQuery(b, paths[b][r], pre[b]) for b in range(nb) for r in rows]
        if not queries:
            continue
        q = _call_draft(draft, queries, vocab)  # [B * len(rows), V]
        vocab = q.shape[1]
        logq = torch.log(q.to(torch.float64))
        for j, qr in enumerate(queries):
            b, row = qr.request, rows[j % len(rows)]
            kids = tree.children[row]
            if replacement:
                draws = torch.multinomial(q[j], len(kids), replacement=True, generator=gens[b])  # [c]
            else:
                draws = draw_without_replacement(q[j : j + 1], len(kids), gens[b])[0]  # [c]
            q_rows[b][row] = q[j]
            for i, tok in zip(kids, draws.tolist()):
                tokens[b][i] = tok
                scores[b, i + 1] = scores[b, row] + logq[j, tok]
                paths[b][i + 1] = paths[b][row] + (tok,)
    mode = ChildSampling.IID if replacement else ChildSampling.WITHOUT_REPLACEMENT
    return [
        DraftTree(
            tree=tree.with_tokens(torch.tensor(tokens[b], dtype=torch.long)),
            scores=scores[b, 1:].clone(),
            sampling=mode,
            q=_stack_q(q_rows[b], n, vocab),
        )
        for b in range(nb)
    ]
