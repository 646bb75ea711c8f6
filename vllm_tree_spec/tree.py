"""Draft trees: one canonical form and everything derived from it.

A draft tree for one request is a **parent array** over N draft nodes in
topological order (every parent index is smaller than its child's index) plus
the nodes' token ids:

    parents[i] = -1 (NO_PARENT)  node i is a child of the root
    parents[i] = j               node i is a child of node j   (j < i)

The **root** is the last committed (sampled) token; it is not a draft node.
Verification and attention number rows the same way: row 0 is the root and
row i + 1 is draft node i. Everything else is derived:

    depth[i]          1 for children of the root, parent depth + 1 otherwise
    positions         root_position + depth   (RoPE sees true depths)
    ancestor mask     [N, N] bool, mask[i, j] = j is i or an ancestor of i
    bit-packed mask   [N, ceil(N / 32)] int32 words of the same matrix
    leaf paths        root-to-leaf node lists (vLLM/EAGLE "retrieve indices")
    first_child / next_sibling over rows (SGLang's walk lists, -1 = none)

Example (rows in brackets):

              root[0]
             /       \\
          n0[1]      n1[2]          parents = [-1, -1, 0, 0, 3]
          /   \\                    depth   = [ 1,  1, 2, 2, 3]
      n2[3]   n3[4]                 root at position 7 ->
                |                   positions [8, 8, 9, 9, 10]
              n4[5]

Constructors: `Tree.chain(k)` (linear speculation is the degenerate tree),
`Tree.from_paths(...)` (vLLM's former `speculative_token_tree` format) and
`TreeShape.parse("s3_k2_d6")` (SGLang's dynamic-tree parameters; the tree
itself is built from draft scores in `build.py`).

`TreeBatch` lays out B trees of different sizes for kernels: a ragged
flattened form (`cu_num_nodes`) and a padded form ([B, max_nodes]).

Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch

NO_PARENT = -1  # parent of a child of the root
NO_NODE = -1  # "none" in first_child / next_sibling / padded layouts
PAD_TOKEN_ID = -1  # token id of padding slots in batched layouts
WORD_BITS = 32  # bits per word of the packed ancestor mask
SMALL_TREE = 256  # trees up to this size are checked with Python lists (the per-request hot path)


class TreeError(ValueError):
    """A malformed tree (raised with the offending field and how to fix it)."""


def long_tensor(values: Sequence[int]) -> torch.Tensor:
    """[N] int64 CPU tensor from a list of ints (through numpy: about 3x faster than torch.tensor on the short
    lists the per-step host work builds)."""
    return torch.from_numpy(np.array(values, dtype=np.int64).reshape(-1))


def _as_cpu_long(x) -> torch.Tensor:
    """[N] int64 on the CPU (already one: itself, no copy)."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.long and x.dim() == 1 and x.device.type == "cpu":
        return x
    return torch.as_tensor(x, dtype=torch.long).reshape(-1).cpu()


# ---------------------------------------------------------------------------
# Tree


@dataclass(frozen=True, eq=False)
class Tree:
    """One request's draft tree.

    Attributes:
        parents: [N] int64, parent node index or NO_PARENT; parents[i] < i.
        tokens: [N] int64 token ids, or None for a shape-only tree.
    """

    parents: torch.Tensor  # [N]
    tokens: torch.Tensor | None = None  # [N]

    def __post_init__(self) -> None:
        parents = _as_cpu_long(self.parents)
        object.__setattr__(self, "parents", parents)
        n = parents.numel()
        if n <= SMALL_TREE:  # drafters build one tree per request per step: a list scan beats three tensor ops
            i = next((i for i, p in enumerate(parents.tolist()) if p < NO_PARENT or p >= i), None)
        else:
            bad = (parents < NO_PARENT) | (parents >= torch.arange(n))
            i = int(bad.nonzero()[0]) if bool(bad.any()) else None
        if i is not None:
            raise TreeError(
                f"parents[{i}] = {int(parents[i])}: every parent must be -1 (root) or an "
                f"earlier node index (< {i}); list nodes in topological order"
            )
        if self.tokens is not None:
            tokens = _as_cpu_long(self.tokens)
            if tokens.numel() != n:
                raise TreeError(
                    f"tokens has {tokens.numel()} entries but parents has {n}; give one token per node"
                )
            object.__setattr__(self, "tokens", tokens)

    # -- constructors -------------------------------------------------------

    @staticmethod
    def chain(k: int, tokens: Sequence[int] | torch.Tensor | None = None) -> "Tree":
        """A chain of k draft nodes: linear speculation with k draft tokens."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise TreeError(f"chain length k = {k!r} must be an int >= 0")
        return Tree(torch.arange(k) - 1, tokens)

    @staticmethod
    def from_paths(paths: str | Iterable[Sequence[int]]) -> "Tree":
        """Build a shape-only tree from child-rank paths.

        This is the format of vLLM's former `speculative_token_tree`: each
        path lists child ranks from the root, e.g. `[(0,), (1,), (0, 0)]` is
        the root's two best children plus the best child of the first. Nodes
        are ordered by (len(path), path) as vLLM did, which is topological.
        Every proper prefix of a path must itself be listed.
        """
        if isinstance(paths, str):
            try:
                paths = ast.literal_eval(paths)
            except (ValueError, SyntaxError) as e:
                raise TreeError(f"tree paths {paths!r} are not a Python literal list of tuples: {e}") from e
        if isinstance(paths, (int, float)) or not hasattr(paths, "__iter__"):
            raise TreeError(f"tree paths {paths!r} must be a list of child-rank tuples, e.g. [(0,), (1,), (0, 0)]")
        norm: list[tuple[int, ...]] = []
        for p in paths:
            t = (p,) if isinstance(p, int) else tuple(p)
            if len(t) == 0 or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in t):
                raise TreeError(f"tree path {p!r} must be a non-empty tuple of child ranks >= 0")
            norm.append(t)
        if len(set(norm)) != len(norm):
            dup = next(t for t in norm if norm.count(t) > 1)
            raise TreeError(f"tree path {dup} is listed twice; list each node once")
        norm.sort(key=lambda t: (len(t), t))
        index = {t: i for i, t in enumerate(norm)}
        parents = []
        for t in norm:
            if len(t) == 1:
                parents.append(NO_PARENT)
            elif t[:-1] not in index:
                raise TreeError(f"tree path {t} has no parent path {t[:-1]}; add it (paths must be prefix-closed)")
            else:
                parents.append(index[t[:-1]])
        tree = Tree(torch.tensor(parents, dtype=torch.long))
        object.__setattr__(tree, "_paths", norm)
        return tree

    def with_tokens(self, tokens: Sequence[int] | torch.Tensor) -> "Tree":
        return Tree(self.parents, tokens)

    # -- sizes --------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        toks = "" if self.tokens is None else f", tokens={self.tokens.tolist()}"
        return f"Tree(parents={self.parents.tolist()}{toks})"

    # -- derived structure (computed once, cached) --------------------------

    @cached_property
    def depth(self) -> torch.Tensor:
        """[N] int64, 1 for children of the root."""
        depth = [0] * self.num_nodes
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p == NO_PARENT else depth[p] + 1
        return torch.tensor(depth, dtype=torch.long)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0

    def positions(self, root_position: int) -> torch.Tensor:
        """[N] positions of the draft nodes: root_position + depth.

        e.g. depths [1, 1, 2] with the root at position 7 -> [8, 8, 9].
        """
        return root_position + self.depth

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool, mask[i, j] = node j is node i or one of its ancestors."""
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents.tolist()):
            if p != NO_PARENT:
                mask[i] = mask[p]  # rows accumulate down the tree (EAGLE's trick)
            mask[i, i] = True
        return mask

    def attention_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool over rows (root first): row r may attend to column c."""
        n = self.num_nodes
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[1:, 1:] = self.ancestor_mask
        return m

    @cached_property
    def packed_ancestor_mask(self) -> torch.Tensor:
        """[N, ceil(N / 32)] int32: bit (j % 32) of word j // 32 set iff mask[i, j]."""
        return pack_mask(self.ancestor_mask)

    @cached_property
    def children(self) -> list[list[int]]:
        """children[r] = node indices whose parent row is r (row 0 = root), in order."""
        ch: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents.tolist()):
            ch[p + 1].append(i)
        return ch

    @cached_property
    def first_child(self) -> torch.Tensor:
        """[N + 1] int64 over rows: row of the first child, NO_NODE if a leaf."""
        return torch.tensor([c[0] + 1 if c else NO_NODE for c in self.children], dtype=torch.long)

    @cached_property
    def next_sibling(self) -> torch.Tensor:
        """[N + 1] int64 over rows: row of the next sibling, NO_NODE if last (root: NO_NODE)."""
        nxt = [NO_NODE] * (self.num_nodes + 1)
        for c in self.children:
            for a, b in zip(c, c[1:]):
                nxt[a + 1] = b + 1
        return torch.tensor(nxt, dtype=torch.long)

    @cached_property
    def sibling_rank(self) -> torch.Tensor:
        """[N] int64, index of each node among its parent's children."""
        rank = [0] * self.num_nodes
        for c in self.children:
            for r, i in enumerate(c):
                rank[i] = r
        return torch.tensor(rank, dtype=torch.long)

    @property
    def max_children(self) -> int:
        return max((len(c) for c in self.children), default=0)

    @cached_property
    def leaves(self) -> list[int]:
        return [i for i in range(self.num_nodes) if not self.children[i + 1]]

    @cached_property
    def chain_cover(self) -> list[list[int]]:
        """The rows split into chains (row 0 = root, row i + 1 = node i), each row in exactly one.

        A chain starts at the root or at a node whose parent is in an earlier chain and follows
        first children down to a leaf, so there is one chain per leaf (the root alone if there is
        no node). With the example above: [[0, 1, 3], [4, 5], [2]].
        """
        out, stack = [], [0]
        while stack:
            chain = [stack.pop()]
            while True:
                kids = self.children[chain[-1]]
                stack.extend(k + 1 for k in reversed(kids[1:]))  # later siblings start chains of their own
                if not kids:
                    break
                chain.append(kids[0] + 1)
            out.append(chain)
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to `node` (inclusive)."""
        path = []
        while node != NO_PARENT:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    @cached_property
    def leaf_paths(self) -> torch.Tensor:
        """[num_leaves, max_depth] int64 root-to-leaf node paths, padded with NO_NODE."""
        paths = [self.path_to(leaf) for leaf in self.leaves]
        out = torch.full((len(paths), self.max_depth), NO_NODE, dtype=torch.long)
        for r, p in enumerate(paths):
            out[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        return out

    def to_paths(self) -> list[tuple[int, ...]]:
        """The tree as child-rank paths (inverse of `from_paths`, gapped ranks included)."""
        stored = getattr(self, "_paths", None)
        if stored is not None:
            return list(stored)
        rank = self.sibling_rank.tolist()
        return [tuple(rank[j] for j in self.path_to(i)) for i in range(self.num_nodes)]

    def path_tokens(self, node: int) -> list[int]:
        assert self.tokens is not None, "a shape-only tree has no tokens"
        return [int(self.tokens[j]) for j in self.path_to(node)]

    def subtree(self, n: int) -> "Tree":
        """The first n nodes (a prefix of a topological order is a tree)."""
        return Tree(self.parents[:n], None if self.tokens is None else self.tokens[:n])

    def is_chain(self) -> bool:
        return self._is_chain

    @cached_property
    def _is_chain(self) -> bool:  # read by several stages of every step
        return bool(torch.equal(self.parents, torch.arange(self.num_nodes) - 1))

    def duplicate_siblings(self) -> list[tuple[int, int]]:
        """Pairs (i, j), i < j, of siblings carrying the same token."""
        if self.tokens is None:
            return []
        toks = self.tokens.tolist()
        if len(set(zip(self.parents.tolist(), toks))) == len(toks):  # the usual answer, without the walk
            return []
        dups = []
        for c in self.children:
            seen: dict[int, int] = {}
            for i in c:
                if toks[i] in seen:
                    dups.append((seen[toks[i]], i))
                else:
                    seen[toks[i]] = i
        return dups


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a [..., N] bool matrix into [..., ceil(N / 32)] int32 words (bit j % 32 of word j // 32)."""
    n = mask.shape[-1]
    words = (n + WORD_BITS - 1) // WORD_BITS
    padded = torch.zeros(*mask.shape[:-1], words * WORD_BITS, dtype=torch.int64)
    padded[..., :n] = mask.to(torch.int64)
    bits = padded.view(*mask.shape[:-1], words, WORD_BITS) << torch.arange(WORD_BITS, dtype=torch.int64)
    packed = bits.sum(-1)
    # Reinterpret the unsigned 32-bit value as int32 (bit 31 becomes the sign bit).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mask`: [..., W] int32 -> [..., n] bool."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(WORD_BITS, dtype=torch.int64)) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * WORD_BITS)[..., :n].to(torch.bool)


# ---------------------------------------------------------------------------
# Shape strings

_SHAPE_RE = re.compile(r"^s(\d+)_k(\d+)_d(\d+)$")


@dataclass(frozen=True)
class TreeShape:
    """SGLang's tree parameters, written `s{steps}_k{topk}_d{draft_tokens}`.

    Semantics (SGLang `--speculative-num-steps s --speculative-eagle-topk k
    --speculative-num-draft-tokens d`, `organize_draft_results`):

    * step 1 expands the root into its top-k children (by draft probability);
    * each later step expands the current k beams into k children each and keeps
      the k best of those k * k candidates by cumulative draft log-probability
      as the next beams (all k + (s - 1) * k * k candidates stay eligible);
    * the verified tree is the root plus the global top (d - 1) candidates by
      cumulative log-probability, kept in topological order. Path scores never
      increase along a path, so the kept set is ancestor-closed.

    So `s3_k2_d6` = at most 3 levels below the root, top-2 expansion, 6 verified
    tokens including the root (5 draft nodes). With k = 1 it is a chain of
    min(s, d - 1). Requires 1 <= d - 1 <= k + (s - 1) * k * k.
    """

    steps: int
    topk: int
    draft_tokens: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.topk < 1 or self.draft_tokens < 2:
            raise TreeError(
                f"tree shape s{self.steps}_k{self.topk}_d{self.draft_tokens}: need steps >= 1, "
                f"topk >= 1 and draft_tokens >= 2 (the root plus at least one draft node)"
            )
        cap = self.max_candidates
        if self.num_nodes > cap:
            raise TreeError(
                f"tree shape {self}: draft_tokens - 1 = {self.num_nodes} exceeds the "
                f"{cap} candidates that {self.steps} steps of top-{self.topk} produce; "
                f"lower d to <= {cap + 1} or raise s/k"
            )

    @staticmethod
    def parse(text: str) -> "TreeShape":
        m = _SHAPE_RE.match(text.strip())
        if not m:
            raise TreeError(
                f"tree shape {text!r} is not of the form s{{steps}}_k{{topk}}_d{{draft_tokens}}, e.g. 's3_k2_d6'"
            )
        return TreeShape(*(int(g) for g in m.groups()))

    @property
    def num_nodes(self) -> int:
        """Draft nodes verified (excluding the root)."""
        return self.draft_tokens - 1

    @property
    def max_candidates(self) -> int:
        return self.topk + (self.steps - 1) * self.topk * self.topk

    def __str__(self) -> str:
        return f"s{self.steps}_k{self.topk}_d{self.draft_tokens}"


# ---------------------------------------------------------------------------
# Batched layout


class HostTrees(NamedTuple):
    """A TreeBatch flattened into Python lists (request-major, topological order within each tree)."""

    parents: list[int]  # [T] parent node within its tree, NO_PARENT for children of the root
    tokens: list[int]  # [T] (PAD_TOKEN_ID for shape-only trees)
    depth: list[int]  # [T] >= 1
    num_nodes: list[int]  # [B]
    cu_num_nodes: list[int]  # [B + 1]
    cu_num_rows: list[int]  # [B + 1] (1 + n_b rows per request, root first)


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """B trees of different sizes in kernel-friendly layouts.

    Ragged (flattened over all draft nodes of all requests, request-major; `host` has the same as lists):
        cu_num_nodes   [B + 1] int64 node offsets
        parents        [T] int64, local parent index (NO_PARENT for root children)
        tokens         [T] int64
        depth          [T] int64
        packed_mask    [T, W] int32, W = ceil(max_nodes / 32), local columns
        cu_num_rows    [B + 1] int64 row offsets; a request owns 1 + N_b rows (root first)
    Padded ([B, max_nodes], padding: parents NO_NODE, tokens PAD_TOKEN_ID, valid False):
        padded_parents, padded_tokens, padded_depth, valid, dense_mask [B, M, M]
    Walk lists over rows ([B, M + 1], -1 = none; row 0 = root):
        first_child, next_sibling, child_at [B, M + 1, K] (row of the j-th child)
    """

    trees: tuple[Tree, ...]

    @staticmethod
    def from_trees(trees: Sequence[Tree]) -> "TreeBatch":
        return TreeBatch(tuple(trees))

    @property
    def batch_size(self) -> int:
        return len(self.trees)

    # The flattened layouts come from one pass over the trees in Python lists (`host`), shared by every
    # property: the runner builds one batch per step, and on trees this small list work costs a fraction
    # of the tensor ops it replaces.

    @cached_property
    def host(self) -> "HostTrees":
        """The flattened trees as Python lists (one pass; the tensors below are made from it)."""
        par: list[int] = []
        tok: list[int] = []
        dep: list[int] = []
        num: list[int] = []
        for t in self.trees:
            p = t.parents.tolist()
            base = len(dep)
            for x in p:  # parents come first (topological order)
                dep.append(1 if x < 0 else dep[base + x] + 1)
            par += p
            tok += t.tokens.tolist() if t.tokens is not None else [PAD_TOKEN_ID] * len(p)
            num.append(len(p))
        cu_nodes = list(itertools.accumulate(num, initial=0))
        cu_rows = [c + b for b, c in enumerate(cu_nodes)]  # 1 + n_b rows per request
        return HostTrees(par, tok, dep, num, cu_nodes, cu_rows)

    @cached_property
    def num_nodes(self) -> torch.Tensor:
        return long_tensor(self.host.num_nodes)

    @property
    def max_nodes(self) -> int:
        return max(self.host.num_nodes, default=0)

    @property
    def max_depth(self) -> int:
        return max((t.max_depth for t in self.trees), default=0)

    @property
    def max_children(self) -> int:
        return max((t.max_children for t in self.trees), default=0)

    @cached_property
    def cu_num_nodes(self) -> torch.Tensor:
        return long_tensor(self.host.cu_num_nodes)

    @cached_property
    def cu_num_rows(self) -> torch.Tensor:
        return long_tensor(self.host.cu_num_rows)

    @cached_property
    def parents(self) -> torch.Tensor:
        return long_tensor(self.host.parents)

    @cached_property
    def tokens(self) -> torch.Tensor:
        return long_tensor(self.host.tokens)

    @cached_property
    def depth(self) -> torch.Tensor:
        return long_tensor(self.host.depth)

    @cached_property
    def packed_mask(self) -> torch.Tensor:
        w = max(1, (self.max_nodes + WORD_BITS - 1) // WORD_BITS)
        out = torch.zeros(int(self.cu_num_nodes[-1]), w, dtype=torch.int32)
        for b, t in enumerate(self.trees):
            s = int(self.cu_num_nodes[b])
            pm = t.packed_ancestor_mask
            out[s : s + t.num_nodes, : pm.shape[1]] = pm
        return out

    def _pad(self, f, fill: int) -> torch.Tensor:
        out = torch.full((self.batch_size, self.max_nodes), fill, dtype=torch.long)
        for b, t in enumerate(self.trees):
            out[b, : t.num_nodes] = f(t)
        return out

    @cached_property
    def padded_parents(self) -> torch.Tensor:
        return self._pad(lambda t: t.parents, NO_NODE)

    @cached_property
    def padded_tokens(self) -> torch.Tensor:
        return self._pad(
            lambda t: t.tokens if t.tokens is not None else torch.full((t.num_nodes,), PAD_TOKEN_ID), PAD_TOKEN_ID
        )

    @cached_property
    def padded_depth(self) -> torch.Tensor:
        return self._pad(lambda t: t.depth, 0)

    @cached_property
    def valid(self) -> torch.Tensor:
        return torch.arange(self.max_nodes)[None, :] < self.num_nodes[:, None]

    @cached_property
    def dense_mask(self) -> torch.Tensor:
        """[B, M, M] bool ancestor-or-self masks, False in padding."""
        m = self.max_nodes
        out = torch.zeros(self.batch_size, m, m, dtype=torch.bool)
        for b, t in enumerate(self.trees):
            out[b, : t.num_nodes, : t.num_nodes] = t.ancestor_mask
        return out

    def _pad_rows(self, f) -> torch.Tensor:
        out = torch.full((self.batch_size, self.max_nodes + 1), NO_NODE, dtype=torch.long)
        for b, t in enumerate(self.trees):
            out[b, : t.num_nodes + 1] = f(t)
        return out

    @cached_property
    def first_child(self) -> torch.Tensor:
        return self._pad_rows(lambda t: t.first_child)

    @cached_property
    def next_sibling(self) -> torch.Tensor:
        return self._pad_rows(lambda t: t.next_sibling)

    @cached_property
    def child_at(self) -> torch.Tensor:
        """[B, M + 1, K] int64: row of the j-th child of row r, NO_NODE if none."""
        k = max(1, self.max_children)
        out = torch.full((self.batch_size, self.max_nodes + 1, k), NO_NODE, dtype=torch.long)
        for b, t in enumerate(self.trees):
            for r, ch in enumerate(t.children):
                if ch:
                    out[b, r, : len(ch)] = torch.tensor(ch, dtype=torch.long) + 1
        return out
