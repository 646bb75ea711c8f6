"""What one verify step knows about its trees (built in `_prepare_inputs`, read by attention, sampler, commit).

vLLM schedules 1 + n tokens for a request with n drafts and gives them linear
positions and cache slots. For a tree we keep the slots (every node owns a
unique slot: the scratch for standard attention) but give each row its true
position (root + depth) and a tree mask. Flattened token rows of request b:

    root_row        the root (last sampled token), position root_pos
    root_row + 1 + i   draft node i, position root_pos + depth[i], slot row_slots[1 + i]

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

from dataclasses import dataclass, field
from functools import cached_property

import torch

from vllm_tree_spec.tree import Tree, TreeBatch
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
