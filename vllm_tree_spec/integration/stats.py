"""Tree-speculation counters kept in the worker and logged periodically.

vLLM's own spec-decode metrics keep working unchanged (the verifier returns
the chain contract): accepted tokens, drafts, and acceptance per *position*,
which for a tree is acceptance per *depth*. These counters add what a chain
metric cannot show: nodes verified per step, the accepted length per round,
and where the time goes (draft, verify, commit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_tree_spec.integration.tree_step import TreeRequestStep

LOG_INTERVAL_S = 10.0


@dataclass
class TreeStats:
    max_depth: int
    rounds: int = 0  # request-rounds verified with a non-empty tree
    nodes: int = 0  # draft nodes verified
    accepted: int = 0  # draft nodes accepted
    accepted_per_depth: list[int] = field(default_factory=list)
    branching_rounds: int = 0  # rounds whose tree had a node with >= 2 children
    off_first_branch: int = 0  # rounds whose accepted path left the rank-0 chain
    drafter_failures: int = 0  # steps whose drafter raised (decoded without drafts instead of crashing)
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    prefix: object = None  # the EAGLE drafters' PrefixStats (prefix-cache hits; None: not applicable)
    _last_log: float = field(default_factory=time.monotonic)
    _timers: object = None

    def __post_init__(self) -> None:
        self.accepted_per_depth = [0] * self.max_depth
        from vllm_tree_spec.integration.metrics import WorkerTimers

        self._timers = WorkerTimers()

    def add_time(self, stage: str, seconds: float) -> None:
        """stage: draft | verify | commit."""
        setattr(self, f"{stage}_s", getattr(self, f"{stage}_s") + seconds)
        self._timers.add(stage, seconds)

    def observe(self, reqs: list[TreeRequestStep], paths: list[list[int]]) -> None:
        for req, path in zip(reqs, paths):
            self.rounds += 1
            self.nodes += req.num_nodes
            self.accepted += len(path)
            for d in range(len(path)):
                self.accepted_per_depth[d] += 1
            self.branching_rounds += req.tree.max_children > 1
            rank = req.tree.sibling_rank
            self.off_first_branch += any(int(rank[n]) > 0 for n in path)
        if time.monotonic() - self._last_log > LOG_INTERVAL_S:
            self._last_log = time.monotonic()
            from vllm.logger import init_logger

            init_logger(__name__).info("%s", self.summary())

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify round, bonus included (vLLM's 'mean acceptance length')."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def summary(self) -> str:
        per_depth = ", ".join(f"{c / self.rounds:.2f}" for c in self.accepted_per_depth if self.rounds) or "-"
        return (f"Tree speculation: rounds {self.rounds}, mean accepted length {self.mean_accepted_length:.2f}, "
                f"nodes/round {self.nodes / max(1, self.rounds):.1f}, acceptance per depth [{per_depth}], "
                f"draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s commit {self.commit_s:.2f}s"
                + self._prefix_summary())

    def _prefix_summary(self) -> str:
        p = self.prefix
        if p is None or not p.hits:
            return ""
        return (f", prefix-cache hits {p.hits}: draft KV restored for {p.restored} tokens, missing "
                f"{p.missing + p.dropped} (drafted without them)")

    def as_dict(self) -> dict:
        return dict(rounds=self.rounds, nodes=self.nodes, accepted=self.accepted,
                    accepted_per_depth=list(self.accepted_per_depth), draft_s=self.draft_s,
                    verify_s=self.verify_s, commit_s=self.commit_s, branching_rounds=self.branching_rounds,
                    off_first_branch=self.off_first_branch, drafter_failures=self.drafter_failures,
                    mean_accepted_length=self.mean_accepted_length)
