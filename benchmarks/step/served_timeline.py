"""Where a served step's time goes, per process: a chain-shaped tree vs vLLM's linear n-gram at c = 1.

`stage_profile.py` times the stages in-process; this script times the *served* engines, in each of their
processes, through a probe that Python loads at start-up (`probe/sitecustomize.py` on PYTHONPATH; nothing on the
serving path changes). Per call it records the worker's `execute_model` (input preparation + forward) and
`sample_tokens` (sampling, verification, commit, drafting) and the engine core's `step`, with wall time, the
thread's CPU, system time, page faults and context switches.

Servers are started as users start them (`vllm-tree-spec serve`, serve_launch.py) with the same model, seed and
limits; only `--speculative-config` differs (`stage_profile.ENGINES`):

    tree     {"method": "tree", "drafter": "ngram", "tree": "chain:6", "num_speculative_tokens": 6,
              "budgets": {"1024": 6}, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    linear   {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

`--pairs N` starts 2N servers, tree and linear alternating (interleaved repeats). Each gets a warm-up, then the
same `--rounds` x 3 greedy completions of `--max-tokens` tokens, one at a time (`ignore_eos`). Reported per
server: output tok/s and, over the calls after the warm-up, the median / mean of each timed method, with the
worker's `execute_model` split into steps with drafts (scheduled tokens > 1) and without (= 1: a plain decode
step, where the two engines run the same code apart from the tree's hooks). Greedy texts of the two engines
must be identical (exit 1 otherwise).

    .venv/bin/python benchmarks/step/served_timeline.py --pairs 4 --out runs/step/served_timeline   # ~13 min

`--pin-worker 0 --pin-frontend 1` binds the worker to CPU 0 (VLLM_CPU_OMP_THREADS_BIND) and runs the API server
and engine core on CPU 1 only (taskset), instead of vLLM's default (worker bound, the rest unbound).
Writes OUT/served_timeline.json, OUT/served_timeline.md and the raw per-call records under OUT/raw/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_profile import ENGINES as SPECS  # noqa: E402  (the in-process profile's two engines, unchanged)

from vllm_tree_spec.models import smollm2  # noqa: E402
from vllm_tree_spec.serve_launch import launched, post_json  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 3,
           "Explain, step by step, how a hash map handles collisions, and give an example in Python.",
           "List the planets of the solar system with one fact about each."]
PROBE = Path(__file__).resolve().parent / "probe"


def _summary(rows: list[dict]) -> dict:
    if not rows:
        return {"n": 0}
    out = {"n": len(rows)}
    for k in ("wall", "cpu", "stime"):
        vals = [r[k] * 1e3 for r in rows]
        out[f"{k}_ms_median"], out[f"{k}_ms_mean"] = st.median(vals), st.mean(vals)
    for k in ("minflt", "ivcsw", "vcsw"):
        out[f"{k}_mean"] = st.mean(r[k] for r in rows)
    if rows[0].get("ntok") is not None:
        out["ntok_mean"] = st.mean(r["ntok"] for r in rows)
    out["cpus"] = rows[0]["cpus"]
    return out


def analyse(raw: Path, mark: float) -> dict:
    """{process: {method[/split]: summary}} over calls started after `mark` (the end of the warm-up)."""
    res: dict[str, dict] = {}
    for f in sorted(raw.glob("*.jsonl")):
        role = f.stem.split("-", 1)[1]
        rows = [r for r in map(json.loads, f.read_text().splitlines()) if r["t0"] > mark]
        if not rows:
            continue
        by: dict[str, list[dict]] = {}
        for r in rows:
            by.setdefault(r["m"], []).append(r)
        if "execute_model" in by:
            ex = by["execute_model"]
            by["execute_model/drafted"] = [r for r in ex if (r["ntok"] or 0) > 1]
            by["execute_model/plain"] = [r for r in ex if r["ntok"] == 1]
        span = max(r["t0"] + r["wall"] for r in rows) - min(r["t0"] for r in rows)
        res[role] = {m: _summary(v) for m, v in by.items()}
        res[role]["busy"] = sum(r["wall"] for m, v in by.items() if "/" not in m for r in v) / span
    return res


def run_one(i: int, name: str, args, out: Path, model: str) -> dict:
    raw = out / "raw" / f"{i}-{name}"
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE), os.environ.get("PYTHONPATH")])),
           "STEP_PROBE_DIR": str(raw)}
    if args.pin_worker:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.pin_worker
    if args.pin_frontend:  # the launcher's children inherit this process's affinity
        os.sched_setaffinity(0, {int(c) for c in args.pin_frontend.split(",")})
    try:
        with launched(model, SPECS[name], name=f"{i}-{name}", log_dir=str(out / "logs"), max_num_seqs=1,
                      env=env) as s:
            for p in PROMPTS:  # warm-up
                post_json(s.base + "/v1/completions", {"model": model, "prompt": p, "max_tokens": 16,
                                                       "temperature": 0})
            mark = time.monotonic()
            t0, ntok, texts = time.perf_counter(), 0, []
            for _ in range(args.rounds):
                for p in PROMPTS:
                    r = post_json(s.base + "/v1/completions", {"model": model, "prompt": p, "temperature": 0,
                                                               "max_tokens": args.max_tokens, "ignore_eos": True})
                    ntok += r["usage"]["completion_tokens"]
                    texts.append(r["choices"][0]["text"])
            wall = time.perf_counter() - t0
    finally:
        if args.pin_frontend:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {"index": i, "engine": name, "tok_s": ntok / wall, "tokens": ntok, "wall_s": wall, "texts": texts,
            "processes": analyse(raw, mark)}


def report(runs: list[dict]) -> str:
    lines = ["| # | engine | tok/s | worker execute_model, plain step: median / mean ms | drafted step: median / mean ms "
             "| sample_tokens mean ms | engine-core step mean ms | worker ivcsw / step | worker busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        w, c = r["processes"].get("Worker", {}), r["processes"].get("EngineCore", {})
        pl, dr, sm = w.get("execute_model/plain", {}), w.get("execute_model/drafted", {}), w.get("sample_tokens", {})
        lines.append(f"| {r['index']} | {r['engine']} | {r['tok_s']:.2f} | {pl.get('wall_ms_median', 0):.2f} / "
                     f"{pl.get('wall_ms_mean', 0):.2f} | {dr.get('wall_ms_median', 0):.2f} / {dr.get('wall_ms_mean', 0):.2f} | "
                     f"{sm.get('wall_ms_mean', 0):.2f} | {c.get('step', {}).get('wall_ms_mean', 0):.2f} | "
                     f"{w.get('execute_model', {}).get('ivcsw_mean', 0):.1f} | {w.get('busy', 0):.3f} |")
    by = {e: [r for r in runs if r["engine"] == e] for e in ("tree", "linear")}
    def med(e, f):
        return st.median(f(r) for r in by[e])
    plain = lambda r: r["processes"]["Worker"]["execute_model/plain"]["wall_ms_mean"]
    samp = lambda r: r["processes"]["Worker"]["sample_tokens"]["wall_ms_mean"]
    core = lambda r: (r["processes"]["EngineCore"]["step"]["wall_ms_mean"]
                      - r["processes"]["Worker"]["execute_model"]["wall_ms_mean"]
                      - r["processes"]["Worker"]["sample_tokens"]["wall_ms_mean"])
    ratios = [t["tok_s"] / l["tok_s"] for t, l in zip(by["tree"], by["linear"])]
    lines += ["", f"Medians over servers, tree vs linear: tok/s {med('tree', lambda r: r['tok_s']):.2f} vs "
              f"{med('linear', lambda r: r['tok_s']):.2f} (per-pair ratios {', '.join(f'{x:.3f}' for x in ratios)}); "
              f"plain-step execute_model {med('tree', plain):.2f} vs {med('linear', plain):.2f} ms; sample_tokens "
              f"{med('tree', samp):.2f} vs {med('linear', samp):.2f} ms; engine-core time outside the worker's calls "
              f"{med('tree', core):.2f} vs {med('linear', core):.2f} ms."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the 3 prompts per server")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pin-worker", default="", help="VLLM_CPU_OMP_THREADS_BIND for the worker, e.g. 0")
    ap.add_argument("--pin-frontend", default="", help="CPUs for the API server and engine core, e.g. 1")
    ap.add_argument("--out", default="runs/step/served_timeline")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(smollm2())
    runs = []
    for i, name in enumerate(["tree", "linear"] * args.pairs):
        runs.append(run_one(i, name, args, out, model))
        print(f"{i} {name}: {runs[-1]['tok_s']:.2f} tok/s", flush=True)
    identical = all(t["texts"] == l["texts"] for t in runs if t["engine"] == "tree"
                    for l in runs if l["engine"] == "linear")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.processor() or
            platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(), "argv": sys.argv,
            "git": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "identical": identical}
    (out / "served_timeline.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    md = report(runs) + f"\nGreedy texts identical across all servers: {identical}.\n"
    (out / "served_timeline.md").write_text(md)
    print(md)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
