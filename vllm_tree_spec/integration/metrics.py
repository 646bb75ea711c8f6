"""Tree metrics where vLLM users look: Prometheus `/metrics` and the periodic log line.

Two sources, because the numbers live in two processes:

* `TreeSpecStatLogger` (vLLM's `vllm.stat_logger_plugins` entry point, API-server
  process): from the scheduler's spec-decode stats, which the tree verifier fills
  with the chain contract, it derives the tree view -- verify rounds, nodes
  verified, accepted tokens per depth, mean accepted length, nodes per round.
* Worker timings (draft / verify / commit seconds): the tree runner's counters,
  exported with prometheus_client when `PROMETHEUS_MULTIPROC_DIR` is set (the
  `vllm-tree-spec serve` launcher sets it, so every process writes to one
  registry), and always printed in the worker's periodic "Tree speculation:"
  log line.

Both are inert in engines without tree speculation.
"""

from __future__ import annotations

import os

from vllm.v1.metrics.loggers import StatLoggerBase

_METRICS: dict[str, object] = {}  # prometheus collectors are process-global: create once


def _metric(kind: str, name: str, doc: str, labels: tuple[str, ...], **kw):
    if name not in _METRICS:
        import prometheus_client

        _METRICS[name] = getattr(prometheus_client, kind)(name, doc, labelnames=labels, **kw)
    return _METRICS[name]


class TreeSpecStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.enabled = "tree_spec" in (vllm_config.additional_config or {})
        if not self.enabled:
            return
        labels = ("model_name", "engine")
        self.label = dict(model_name=vllm_config.model_config.served_model_name, engine=str(engine_index))
        gauge_kw = {"multiprocess_mode": "mostrecent"} if os.getenv("PROMETHEUS_MULTIPROC_DIR") else {}
        self.rounds = _metric("Counter", "vllm_tree_spec:rounds", "Verify rounds with a non-empty tree", labels)
        self.nodes = _metric("Counter", "vllm_tree_spec:nodes_verified", "Draft tree nodes verified", labels)
        self.accepted = _metric("Counter", "vllm_tree_spec:accepted_tokens", "Draft nodes accepted", labels)
        self.per_depth = _metric("Counter", "vllm_tree_spec:accepted_tokens_per_depth",
                                 "Rounds that accepted a node at this depth", labels + ("depth",))
        self.mean_len = _metric("Gauge", "vllm_tree_spec:mean_accepted_length",
                                "Tokens per verify round, bonus included (since start)", labels, **gauge_kw)
        self.nodes_per_round = _metric("Gauge", "vllm_tree_spec:nodes_per_round",
                                       "Mean tree size per verify round (since start)", labels, **gauge_kw)
        self._rounds = self._accepted = self._nodes = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if not self.enabled or scheduler_stats is None or scheduler_stats.spec_decoding_stats is None:
            return
        sd = scheduler_stats.spec_decoding_stats
        if sd.num_drafts == 0:
            return
        self._rounds += sd.num_drafts
        self._accepted += sd.num_accepted_tokens
        self._nodes += sd.num_draft_tokens
        self.rounds.labels(**self.label).inc(sd.num_drafts)
        self.nodes.labels(**self.label).inc(sd.num_draft_tokens)
        self.accepted.labels(**self.label).inc(sd.num_accepted_tokens)
        for depth, n in enumerate(sd.num_accepted_tokens_per_pos, start=1):
            if n:
                self.per_depth.labels(**self.label, depth=str(depth)).inc(n)
        self.mean_len.labels(**self.label).set(1 + self._accepted / self._rounds)
        self.nodes_per_round.labels(**self.label).set(self._nodes / self._rounds)

    def log_engine_initialized(self):
        pass


class WorkerTimers:
    """Draft / verify / commit seconds from the tree runner, exported in multiprocess mode only."""

    def __init__(self):
        self.enabled = bool(os.getenv("PROMETHEUS_MULTIPROC_DIR"))
        if self.enabled:
            self.seconds = _metric("Counter", "vllm_tree_spec:stage_seconds",
                                   "Time spent per tree-speculation stage in the worker", ("stage",))

    def add(self, stage: str, seconds: float) -> None:
        if self.enabled:
            self.seconds.labels(stage=stage).inc(seconds)


class PlanGauges:
    """The online shape policy's current plan per drafter and batch-size bucket, and its changes.

    Set in the worker (the policy lives there); exported like the stage timings: in-process engines and
    the `vllm-tree-spec serve` launcher (multiprocess registry) show them on `/metrics`.
    """

    def __init__(self, drafter: str):
        self.drafter = drafter
        kw = {"multiprocess_mode": "mostrecent"} if os.getenv("PROMETHEUS_MULTIPROC_DIR") else {}
        labels = ("drafter", "batch_size")
        self.nodes = _metric("Gauge", "vllm_tree_spec:plan_nodes",
                             "Draft nodes per request of the current plan (0 = no speculation)", labels, **kw)
        self.depth = _metric("Gauge", "vllm_tree_spec:plan_depth", "Depth of the current plan", labels, **kw)
        self.width = _metric("Gauge", "vllm_tree_spec:plan_width", "Most nodes on one level of the current plan",
                             labels, **kw)
        self.full = _metric("Gauge", "vllm_tree_spec:plan_full",
                            "1 while the plan is the drafter's own unpruned tree (nodes/depth/width: its caps)",
                            labels, **kw)
        self.score_gate = _metric("Gauge", "vllm_tree_spec:plan_score_gate",
                                  "Break-even acceptance below which the score gate drops draft nodes (0 = off)",
                                  labels, **kw)
        self.changes = _metric("Counter", "vllm_tree_spec:plan_changes", "Changes of the shape plan", ("drafter",))
        self.changes.labels(drafter=drafter).inc(0)

    def set(self, bucket: int, nodes: int, depth: int, width: int, full: bool) -> None:
        label = dict(drafter=self.drafter, batch_size=str(bucket))
        self.nodes.labels(**label).set(nodes)
        self.depth.labels(**label).set(depth)
        self.width.labels(**label).set(width)
        self.full.labels(**label).set(int(full))

    def gate(self, bucket: int, tau: float) -> None:
        self.score_gate.labels(drafter=self.drafter, batch_size=str(bucket)).set(tau)

    def changed(self, n: int = 1) -> None:
        self.changes.labels(drafter=self.drafter).inc(n)


class PrefixCounters:
    """The EAGLE drafters' restores on prefix-cache hits (drafters/prefix_pages.py): requests, and tokens
    whose draft KV was restored or is missing (drafted without it). Counted by tensor-parallel rank 0 only
    (every rank restores the same); exported like the plan gauges."""

    def __init__(self, drafter: str):
        self.label = dict(drafter=drafter)
        self.hits = _metric("Counter", "vllm_tree_spec:draft_prefix_hits",
                            "Requests whose draft KV was restored for prefix-cached tokens", ("drafter",))
        self.tokens = _metric("Counter", "vllm_tree_spec:draft_prefix_tokens",
                              "Prefix-cached tokens whose draft KV was restored (kind=restored) or is missing "
                              "(kind=missing: the head drafted without them)", ("drafter", "kind"))
        self.hits.labels(**self.label).inc(0)
        for kind in ("restored", "missing"):
            self.tokens.labels(**self.label, kind=kind).inc(0)
        self._seen = (0, 0, 0)

    def update(self, stats) -> None:
        """Add what `stats` (a PrefixStats) counted since the last call."""
        now = (stats.hits, stats.restored, stats.missing + stats.dropped)
        hits, restored, missing = (a - b for a, b in zip(now, self._seen))
        if hits:
            self.hits.labels(**self.label).inc(hits)
        if restored:
            self.tokens.labels(**self.label, kind="restored").inc(restored)
        if missing:
            self.tokens.labels(**self.label, kind="missing").inc(missing)
        self._seen = now
