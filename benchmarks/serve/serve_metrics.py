"""Server-side numbers of one run: `/metrics` counter deltas and peak memory of the server processes.

Speculation (vLLM's spec-decode counters; the tree verifier fills them with the chain contract):

    round                 one request's verify step that had a non-empty draft (vLLM's "draft")
    tokens per round      1 + accepted / rounds: tokens committed per round, bonus/correction included
                          (vLLM's "mean acceptance length"; the number to compare at equal budget D)
    candidates per round  draft tokens verified / rounds (chain: <= D; tree: nodes, <= D)
    acceptance rate       accepted / candidates (per verified candidate; a tree's siblings compete for one
                          slot, so compare tokens per round, not this rate, between trees and chains)
    per depth             P(the round accepted a token at depth d) = accepted_per_pos[d] / rounds

Tree stage time (`vllm_tree_spec:stage_seconds_total`, worker side, tree configurations only):
draft = the drafter's proposal for the batch, verify = target distributions + the lossless rule (the
target forward itself is not in it), commit = KV compaction of the accepted path. vLLM exports no such
split for its own linear methods. Engine steps come from `vllm:iteration_tokens_total_count`.

CPU time: user + system seconds of the server's process tree during the run (psutil). On a shared
machine wall-clock throughput moves with the neighbours' load; output tokens per server CPU-second
does much less, so it is the side-by-side efficiency ratio reported next to tok/s.

Memory: the resident set of the server's process tree (API server, engine core, workers), sampled
every 0.2 s during the run (peak of the sum), plus each process's kernel high-water mark (VmHWM) at the
end. On CPU the KV cache is a fixed preallocation (VLLM_CPU_KVCACHE_SPACE), so differences between
configurations are drafter state, draft model weights and per-step scratch (tree rows, masks, probs).
"""

from __future__ import annotations

import threading
import time

from vllm_tree_spec.serve_launch import Labels, metric_by_label, metric_sum, scrape_metrics

Metrics = dict[tuple[str, Labels], float]


def delta(after: Metrics, before: Metrics) -> Metrics:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _per_index(d: dict[str, float], start: int) -> list[float]:
    """{"start": a, "start+1": b, ...} -> [a, b, ...] by integer key (missing keys 0)."""
    keys = [int(k) for k in d if k.isdigit() and int(k) >= start]
    out = [0.0] * (max(keys) - start + 1 if keys else 0)
    for k in keys:
        out[k - start] = d[str(k)]
    return out


def spec_summary(d: Metrics) -> dict:
    """Speculation, tree and engine numbers from a counter delta (see the module docstring)."""
    rounds = metric_sum(d, "vllm:spec_decode_num_drafts_total")
    cands = metric_sum(d, "vllm:spec_decode_num_draft_tokens_total")
    acc = metric_sum(d, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = _per_index(metric_by_label(d, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position"), 0)
    out = {
        "rounds": rounds,
        "candidates": cands,
        "accepted": acc,
        "tokens_per_round": 1 + acc / rounds if rounds else None,
        "candidates_per_round": cands / rounds if rounds else None,
        "acceptance_rate": acc / cands if cands else None,
        "accept_prob_per_depth": [x / rounds for x in per_pos] if rounds else [],
        "engine_steps": metric_sum(d, "vllm:iteration_tokens_total_count"),
        "engine_tokens": metric_sum(d, "vllm:iteration_tokens_total_sum"),
        "generation_tokens": metric_sum(d, "vllm:generation_tokens_total"),
        "prompt_tokens": metric_sum(d, "vllm:prompt_tokens_total"),
        "prefix_cache_hits": metric_sum(d, "vllm:prefix_cache_hits_total"),
        "prefix_cache_queries": metric_sum(d, "vllm:prefix_cache_queries_total"),
        "preemptions": metric_sum(d, "vllm:num_preemptions_total"),
    }
    stages = metric_by_label(d, "vllm_tree_spec:stage_seconds_total", "stage")
    tree_rounds = metric_sum(d, "vllm_tree_spec:rounds_total")
    out["tree"] = None
    if stages or tree_rounds:
        steps = out["engine_steps"] or None
        out["tree"] = {
            "rounds": tree_rounds,
            "nodes": metric_sum(d, "vllm_tree_spec:nodes_verified_total"),
            "accepted": metric_sum(d, "vllm_tree_spec:accepted_tokens_total"),
            "accepted_per_depth": _per_index(metric_by_label(d, "vllm_tree_spec:accepted_tokens_per_depth_total",
                                                             "depth"), 1),
            "stage_s": {s: stages.get(s, 0.0) for s in ("draft", "verify", "commit")},
            "stage_ms_per_step": ({s: 1e3 * stages.get(s, 0.0) / steps for s in ("draft", "verify", "commit")}
                                  if steps else None),
        }
    return out


def snapshot(base: str) -> Metrics:
    return scrape_metrics(base)


class MemorySampler:
    """Peak resident set (sum over the process tree rooted at pid), sampled in a thread."""

    def __init__(self, pid: int | None, interval_s: float = 0.2):
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu0: dict[int, float] = {}
        self.cpu_s: float | None = None

    def _procs(self):
        import psutil

        root = psutil.Process(self.pid)
        return [root, *root.children(recursive=True)]

    def _sample(self) -> None:
        import psutil

        total = 0
        try:
            for p in self._procs():
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            return
        self.peak_rss = max(self.peak_rss, total)
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def cpu_seconds(self) -> dict[int, float]:
        """{pid: user + system CPU seconds} over the server's process tree."""
        import psutil

        out = {}
        try:
            procs = self._procs()
        except psutil.Error:
            return out
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def __enter__(self) -> "MemorySampler":
        if self.pid is not None:
            self._cpu0 = self.cpu_seconds()
            self._sample()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._sample()
            cpu1 = self.cpu_seconds()
            self.cpu_s = sum(v - self._cpu0.get(pid, 0.0) for pid, v in cpu1.items())

    def high_water_marks(self) -> dict[str, int]:
        """{"pid name": VmHWM bytes} per process (Linux; empty elsewhere)."""
        out = {}
        if self.pid is None:
            return out
        try:
            procs = self._procs()
        except Exception:
            return out
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            out[f"{p.pid} {p.name()}"] = int(line.split()[1]) * 1024
            except Exception:
                pass
        return out

    def result(self) -> dict:
        hwm = self.high_water_marks()
        return {"peak_rss_bytes": self.peak_rss or None, "samples": self.samples, "server_cpu_s": self.cpu_s,
                "vm_hwm_bytes": hwm, "vm_hwm_sum_bytes": sum(hwm.values()) or None,
                "method": "sum of RSS over the server process tree, sampled every "
                          f"{self.interval_s:g} s; VmHWM = per-process kernel peak since start"}


def wait_idle(base: str, timeout_s: float = 10.0) -> None:
    """Wait until the server reports no running or waiting request (so counters are final)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            m = scrape_metrics(base)
        except OSError:
            return
        if metric_sum(m, "vllm:num_requests_running") == 0 and metric_sum(m, "vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.2)
