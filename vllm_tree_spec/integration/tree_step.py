"""What one verify step knows about its trees (built in `_prepare_inputs`, read by attention, sampler, commit).

vLLM schedules 1 + n tokens for a request with n drafts and gives them linear
positions and cache slots. For a tree we keep the slots (every node owns a
unique slot: the scratch for standard attention) but give each row its true
position (root + depth) and a tree mask. Flattened token rows of request b:

    root_row        the root (last sampled token), position root_pos
    root_row + 1 + i   draft node i, position root_pos + depth[i], slot row_slots[1 + i]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_tree_spec.tree import Tree
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
class TreeStep:
    """All tree requests of one forward, in batch order."""

    requests: list[TreeRequestStep]

    def __bool__(self) -> bool:
        return bool(self.requests)

    def by_index(self) -> dict[int, TreeRequestStep]:
        return {r.req_index: r for r in self.requests}
