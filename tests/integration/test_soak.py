"""Soak, CI scale: the served tree engine under concurrent mixed load, against a no-speculation server.

Two `vllm-tree-spec serve` servers on the same tiny float32 checkpoint (launched like users launch
them: `vllm_tree_spec/serve_launch.py`): tree speculation (suffix drafter, s3_k2_d6) and none. The
load (`benchmarks/soak/soak_client.py`): STREAMS concurrent streams x REQUESTS_PER_STREAM requests
mixing chat and completions, streaming and not, greedy (some with logit bias or penalties) and
sampled requests (temperature, top-k, top-p, min-p, logit_bias, presence / frequency / repetition
penalties, seeds, n = 2), logprobs, stop strings and max_tokens 1..MAX_TOKENS, with ~15 % of the
clients disconnecting mid-stream. Pass:

* 0 errors and 0 lost requests: every request that did not disconnect has a valid response
  (its choices, finish reasons, token counts, logprobs, no stop string in the text);
* greedy outputs identical to the no-speculation server (float32: plain equality);
* during the load the tree worker holds per-request state only for requests vLLM holds
  (`integration/live_state.py`, polled through vLLM's /collective_rpc), and after it none at all,
  with nothing running or waiting;
* `/health` and `/metrics` fine afterwards (tree counters moving), and the server still serves.

The full-scale version (SmolLM2, 64 x 500, memory) is `bench_serve.py --preset soak` (docs/soak.md).
"""

import contextlib
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "soak"))

VOCAB = 2048
STREAMS = 8
REQUESTS_PER_STREAM = 8
MAX_TOKENS = 40
TREE = {"method": "tree", "drafter": "suffix", "tree": "s3_k2_d6"}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: /collective_rpc


@pytest.fixture(scope="module")
def servers(tiny_models):
    from vllm_tree_spec.serve_launch import launched

    model = str(tiny_models.llama(vocab_size=VOCAB, num_layers=2, seed=0))
    logs = str(Path(model).parent / "soak-logs")
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(launched(model, TREE, name="soak-tree", log_dir=logs, max_num_seqs=STREAMS,
                                            max_model_len=512, env=ENV))
        off = stack.enter_context(launched(model, None, name="soak-off", log_dir=logs, max_num_seqs=STREAMS,
                                           max_model_len=512, env=ENV))
        yield model, tree, off


class _LeakPoller(threading.Thread):
    """Reads the tree worker's per-request places every `every` seconds during the load."""

    def __init__(self, base: str, every: float = 0.5):
        super().__init__(daemon=True)
        self.base, self.every = base, every
        self.stop = threading.Event()
        self.polls, self.leaks, self.errors = 0, [], []

    def run(self):
        from soak_client import live_state

        from vllm_tree_spec.integration.live_state import leaks

        while not self.stop.is_set():
            try:
                for worker in live_state(self.base):
                    bad = leaks(worker)
                    if bad:
                        self.leaks.append(bad)
                self.polls += 1
            except Exception as e:  # noqa: BLE001 (reported by the test)
                self.errors.append(repr(e))
            self.stop.wait(self.every)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.extended  # ~75 s (two servers); the default run keeps the fault tests (test_engine_faults.py)
def test_soak_mixed_load(servers):
    from soak_client import (check_records, greedy_mismatches, make_mix, run_load, summary, wait_drained,
                             without_seeds)

    from vllm_tree_spec.serve_launch import metric_sum, post_json, scrape_metrics

    model, tree, off = servers
    reqs = make_mix(STREAMS * REQUESTS_PER_STREAM, model, vocab_size=VOCAB, seed=0, max_tokens=MAX_TOKENS)
    poller = _LeakPoller(tree.base)
    poller.start()
    t0 = time.perf_counter()
    try:
        records = run_load(tree.base, reqs, streams=STREAMS, timeout_s=300)
    finally:
        poller.stop.set()
        poller.join(timeout=30)
    load_s = time.perf_counter() - t0
    reference = run_load(off.base, without_seeds(reqs), streams=STREAMS, timeout_s=300, skip_disconnects=True)
    stats = summary(reqs, records)
    print(f"soak: {stats}, {load_s:.1f} s, {poller.polls} live-state polls")

    assert stats["disconnected"] > 0 and stats["greedy"] > 0 and stats["n2"] > 0, stats
    assert not check_records(reqs, records), check_records(reqs, records)[:10]
    kept = [i for i, r in enumerate(reqs) if r.disconnect_after is None]
    ref_problems = check_records([reqs[i] for i in kept], [reference[i] for i in kept])
    assert not ref_problems, ref_problems[:10]
    mismatches = greedy_mismatches(reqs, records, reference)
    assert not mismatches, mismatches[:10]

    assert poller.polls > 0 and not poller.errors, poller.errors[:3]
    assert not poller.leaks, poller.leaks[:3]
    state, gauges = wait_drained(tree.base)
    assert not any(gauges.values()), gauges
    for worker in state:
        assert all(not ids for ids in worker.values()), {k: v for k, v in worker.items() if v}

    from soak_client import worker_memory

    heap = worker_memory(tree.base, trim=True)  # the soak's RSS diagnosis through the same RPC
    assert heap and all(w["rss_mb"] > 100 and "rss_mb_after_trim" in w and w["heap_trims"] >= 0 for w in heap), heap

    assert urllib.request.urlopen(tree.base + "/health", timeout=10).status == 200
    metrics = scrape_metrics(tree.base)
    assert metric_sum(metrics, "vllm_tree_spec:rounds_total") > 0
    assert metric_sum(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
    body = {"model": model, "prompt": "def tree(x): return x + 1\n", "max_tokens": 16, "temperature": 0}
    after = post_json(tree.base + "/v1/completions", body)["choices"][0]["text"]
    assert after == post_json(off.base + "/v1/completions", body)["choices"][0]["text"]
