"""What one verify step knows about its trees: built once per step by `build_step` (whichever model runner
calls it), read by attention, the sampler and the commit.

vLLM schedules 1 + n tokens for a request with n drafts and gives them linear
positions and cache slots. For a tree we keep the slots (every node owns a
unique slot: the scratch for standard attention) but give each row its true
position (root + depth) and a tree mask. Flattened token rows of request b:

    root_row        the root (last sampled token), position root_pos
    root_row + 1 + i   draft node i, position root_pos + depth[i], slot row_slots[1 + i]
    root_row + 1 + n + j   pad row j (Model Runner V2 only: it schedules K draft rows for every
                       decoding request, so a tree of n < K nodes is followed by K - n pad rows;
                       they are no part of the tree, never verified nor accepted, and attention
                       computes them as cheaply as it can: `num_pads`)

The runner also flattens the step's trees once (`TreeStepMeta`: rows, nodes,
depths, positions and slots as `[R]` / `[T]` tensors on the device, plus
per-request offsets), so verification and the commit need no per-request
work on the device; the per-request list stays for the attention overrides.

No silent causal fallback: every attention override that applies the tree mask
records its layer in the step (`mark_applied`), and after the forward the runner
checks that every layer that must apply it did (`check_applied`). A layer whose
metadata lost the step would otherwise give draft rows plain causal attention:
wrong logits for every node that is not on a chain, with no error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from vllm_tree_spec.tree import Tree, TreeBatch, long_tensor
from vllm_tree_spec.verify import Mode


@dataclass
class TreeRequestStep:
    req_id: str
    req_index: int  # row in the persistent batch
    root_row: int  # flattened token index of the root row
    root_pos: int  # position of the root token
    tree: Tree  # the (possibly truncated) draft tree, with tokens
    mode: Mode  # how the children were drafted (greedy requests verify greedily regardless)
    draft_probs: torch.Tensor | None  # [n + 1, V] q rows, sampled modes only
    row_slots: dict[int, list[int]] = field(default_factory=dict)  # kv group id -> [n + 1] slots
    num_pads: int = 0  # rows after the nodes that belong to the request but not to its tree (V2)

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def seq_len(self) -> int:
        """Tokens in the cache for this request this step: prefix + root + nodes."""
        return self.root_pos + 1 + self.num_nodes

    def key_positions(self) -> torch.Tensor:
        """[seq_len] position of every key: the linear prefix, then root_pos + depth per node."""
        prefix = torch.arange(self.root_pos + 1)
        return torch.cat([prefix, self.root_pos + self.tree.depth])

    def node_mask(self) -> torch.Tensor:
        """[n, seq_len] bool: node i sees the prefix, the root, and its ancestors-or-self."""
        n = self.num_nodes
        m = torch.ones(n, self.seq_len, dtype=torch.bool)
        m[:, self.root_pos + 1:] = self.tree.ancestor_mask
        return m


@dataclass
class TreeStepMeta:
    """The step's trees flattened once (R = sum(1 + n_b) tree rows, T = sum(n_b) draft nodes).

    Request-major, root row first, in the order of `TreeStep.requests`. Device tensors unless
    marked host; `batch` is the host `TreeBatch` of the same trees (verification reads its layouts).
    """

    batch: TreeBatch  # host: the B trees
    req_index: torch.Tensor  # [B] host int64, row of each request in the persistent batch
    root_rows: torch.Tensor  # [B] host int64, flattened token row of each root
    cu_num_rows: torch.Tensor  # [B + 1] row offsets
    rows: torch.Tensor  # [R] flattened token row of every tree row
    node_rows: torch.Tensor  # [T] flattened token row of every draft node
    positions: torch.Tensor  # [T] root_pos + depth of every draft node
    row_slots: dict[int, torch.Tensor] = field(default_factory=dict)  # kv group id -> [R] cache slot per row


@dataclass
class TreeStep:
    """All tree requests of one forward, in batch order."""

    requests: list[TreeRequestStep]
    applied: set = field(default_factory=set)  # names of the layers that applied the tree mask this step
    meta: TreeStepMeta | None = None  # the flattened form (the runner builds it; None in bare tests)
    scratch_blocks: range = range(0)  # KV-cache block ids the scheduler never hands out (CPU decode path)

    def __bool__(self) -> bool:
        return bool(self.requests)

    @cached_property
    def all_chains(self) -> bool:
        """Every tree of the step is a chain (its tree mask is the causal mask); computed once per step."""
        return all(r.tree.is_chain() for r in self.requests)

    def by_index(self) -> dict[int, TreeRequestStep]:
        return {r.req_index: r for r in self.requests}

    def mark_applied(self, layer_name) -> None:
        """Called by an attention override after it recomputed this step's draft rows with the tree mask."""
        self.applied.add(layer_name)

    def check_applied(self, expected: set) -> None:
        """Fail loudly if a layer that must apply the tree mask did not (its draft rows would be causal)."""
        missing = expected - self.applied
        if missing:
            first = sorted(map(str, missing))[0]
            raise RuntimeError(
                f"tree step with {len(self.requests)} trees: {len(missing)} of {len(expected)} attention layers "
                f"(e.g. {first}) did not apply the tree mask, so their draft rows saw plain causal attention; "
                f"refusing to verify (an attention override is missing or lost the step's metadata)")


# ---------------------------------------------------------------------------------------------------------------
# Building a step (runner-agnostic: each runner adapter hands over what its batch knows)


@dataclass
class ScheduledTree:
    """One request of the step that has a recorded tree, as the runner scheduled it."""

    batch_index: int  # its row in the step's batch (the sampler's request order)
    req_id: str
    num_scheduled: int  # draft rows the runner scheduled for it (tree nodes, then pads)
    proposal: object  # the drafter's TreeProposal (tree, mode, draft_probs)
    scheduled_tokens: Sequence[int] | None = None  # the draft tokens as scheduled (V1), checked against the tree


def build_step(found: list[ScheduledTree], query_start_loc: Sequence[int], num_computed: Sequence[int],
               positions: torch.Tensor, slot_mapping: Callable[[int], torch.Tensor], num_groups: int, *,
               verification_for: Callable[[str], str], host_slots: bool,
               set_positions: Callable[[torch.Tensor, torch.Tensor, list], None]) -> TreeStep:
    """The step's trees, once: per-request records for attention, flattened tensors (`TreeStepMeta`) for
    positions, verification and the commit.

    found: the step's requests with a tree (any order); query_start_loc [B + 1] and num_computed [B] host
    arrays of the step's batch (a request's last 1 + num_scheduled query rows are its root and draft rows);
    positions: the step's device position buffer (vLLM's linear positions: `set_positions` rewrites the draft
    nodes' to root + depth); slot_mapping(gid): KV group gid's device slot mapping over the step's rows
    (computed from the linear positions, so each node keeps its own linear slot). A request scheduled with
    fewer rows than its tree has nodes verifies the topological prefix that fits; one scheduled with more
    gets pad rows. Host work is one pass over the step's requests; the device gets one upload and one gather
    of each KV group's slot mapping (no device-to-host copy, except `host_slots`: per-request slot lists for
    adapters that commit from host lists).
    """
    from vllm_tree_spec.verify import upload

    if not found:
        return TreeStep([])
    found = sorted(found, key=lambda f: f.batch_index)  # batch order (the sampler's row order)
    trees = []
    for f in found:
        tree = f.proposal.tree
        trees.append(tree if f.num_scheduled >= tree.num_nodes else tree.subtree(f.num_scheduled))
    batch = TreeBatch.from_trees(trees)
    host = batch.host  # the trees as flat lists, one pass
    # Row bookkeeping in one pass over the requests, in lists: a step has a few dozen rows, where each numpy
    # call would cost more than its arithmetic.
    idx, root_row, root_pos, rows, node_rows, node_pos, pads = [], [], [], [], [], [], []
    for b, (f, n) in enumerate(zip(found, host.num_nodes)):
        k = host.cu_num_nodes[b]
        if f.scheduled_tokens is not None and list(f.scheduled_tokens) != host.tokens[k: k + n]:
            raise RuntimeError(f"request {f.req_id}: scheduled drafts {list(f.scheduled_tokens)} do not match its "
                               f"tree {f.proposal.tree.tokens.tolist()} (first {n} nodes: {host.tokens[k: k + n]})")
        i = f.batch_index
        p = f.num_scheduled - n  # pad rows after the nodes
        r0 = int(query_start_loc[i + 1]) - f.num_scheduled - 1  # the root's flattened row
        p0 = int(num_computed[i]) + r0 - int(query_start_loc[i])  # the root's linear position (host: no sync)
        idx.append(i)
        root_row.append(r0)
        root_pos.append(p0)
        pads.append(p)
        rows.extend(range(r0, r0 + n + 1))
        node_rows.extend(range(r0 + 1, r0 + n + 1))
        node_pos.extend([p0 + d for d in host.depth[k: k + n]])
    cu_rows = host.cu_num_rows
    rows, node_rows, node_pos, cu_rows_t = (long_tensor(a) for a in (rows, node_rows, node_pos, cu_rows))
    rows_d, node_rows_d, positions_d, cu_d = upload([rows, node_rows, node_pos, cu_rows_t], positions.device)
    set_positions(node_rows_d, positions_d, trees)
    slots = {gid: slot_mapping(gid)[rows_d].to(torch.long) for gid in range(num_groups)}  # [R] per group
    meta = TreeStepMeta(batch, long_tensor(idx), long_tensor(root_row), cu_d, rows_d, node_rows_d, positions_d,
                        slots)
    per_req_slots = {gid: sm.tolist() for gid, sm in slots.items()} if host_slots else {}  # one copy per group
    reqs = []
    for b, (f, tree) in enumerate(zip(found, trees)):
        dt = f.proposal
        q = dt.draft_probs[: tree.num_nodes + 1] if dt.draft_probs is not None else None
        mode = Mode(dt.mode)
        if mode != Mode.GREEDY:  # the user's `verification` rule (lossless for this drafting: config.py)
            mode = Mode.parse(verification_for(mode.name.lower()))
        r0, r1 = cu_rows[b], cu_rows[b + 1]
        reqs.append(TreeRequestStep(f.req_id, f.batch_index, root_row[b], root_pos[b], tree, mode, q,
                                    {gid: sm[r0:r1] for gid, sm in per_req_slots.items()}, pads[b]))
    return TreeStep(reqs, meta=meta)


def attach_step(step: TreeStep, attn_metadata) -> None:
    """Hand the step to every attention layer: each distinct metadata object of `attn_metadata` (one
    `{layer: metadata}` dict, or a list of them) gets `tree_step`, which the attention overrides read."""
    dicts = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for d in dicts:
        for md in {id(m): m for m in d.values()}.values():
            md.tree_step = step
