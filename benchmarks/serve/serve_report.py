"""Render a serving-benchmark folder: Markdown table, tree vs linear per window, PNG plots; the results page.

    python benchmarks/serve/serve_report.py OUT        # rewrites OUT/report.md, summary.json, *.png, plan-changes.log
    python benchmarks/serve/serve_report.py --page benchmarks/results/cpu-suffix        # a docs/benchmarks.md table
    python benchmarks/serve/serve_report.py --plot PNG benchmarks/results/cpu-suffix ...  # tok/s vs concurrency

Reads OUT/runs/*.json (one per run, written by bench_serve.py). Quality is computed here, across runs:
a run's greedy texts are compared prompt by prompt with the `off` run of the same load (same prompts).
One folder holds one sampling setting (greedy, or one --temperature/--top-p/--top-k).
With --repeats, a configuration's runs at one load are folded into one row (medians over the repeats), and
tree / linear ratios are medians of the per-repeat ratios (repeat i of the tree against repeat i of linear:
interleaved, so neighbours in time: a *window*); each window's tok/s ratio is listed next to the median, which
shows how much of it is the machine's noise. EAGLE-3 folders also get the head's acceptance profile and planned
trees (profile/profile.json, planned_trees.json, acceptance_profile.png; written by bench_serve.py).
--page and --plot read only the stored summary.json of each folder (benchmarks/results/INDEX.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPEAT_METRICS = ("tokens_per_round", "candidates_per_round", "acceptance_rate", "output_tok_s", "requests_s",
                  "tok_per_cpu_s", "tokens_per_step")


def load_runs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(out) / "runs").glob("*.json"))]


def _g(d, *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k) if isinstance(d, dict) else None
    return d


def run_sampling(run: dict) -> dict:
    """The run's OpenAI sampling fields (runs written before --temperature existed were greedy)."""
    return run["run"].get("sampling") or {"temperature": 0.0}


def is_greedy(run: dict) -> bool:
    return not run_sampling(run).get("temperature")


def _identical(run: dict, base: dict | None) -> tuple[int, int] | None:
    """(equal, compared) greedy texts against `off`; None when not comparable (sampled runs: speculation consumes
    randomness differently, so equal seeds do not give equal texts; losslessness in distribution is tested)."""
    if base is None or run is base or not run.get("records") or not is_greedy(run) or not is_greedy(base):
        return None
    ref = {r["id"]: r["text"] for r in base["records"] if r["ok"]}
    pairs = [(r["text"], ref[r["id"]]) for r in run["records"] if r["ok"] and r["id"] in ref]
    return sum(a == b for a, b in pairs), len(pairs)


def rows(runs: list[dict]) -> list[dict]:
    offs = {(r["run"]["key"], r["run"].get("repeat", 0)): r for r in runs
            if r["config"]["kind"] == "off" and not r.get("failed")}
    out = []
    for r in runs:
        rep = r["run"].get("repeat", 0)
        res, spec = r.get("results") or {}, r.get("speculation") or {}
        tree = spec.get("tree") or {}
        stage = tree.get("stage_ms_per_step") or {}
        mem = r.get("memory") or {}
        he = r.get("humaneval") or {}
        off = offs.get((r["run"]["key"], rep)) or next((o for (k, _), o in sorted(offs.items(), key=lambda x: x[0])
                                                        if k == r["run"]["key"]), None)
        ident = None if r["config"]["kind"] == "off" else _identical(r, off)
        out.append({
            "config": r["config"]["name"], "kind": r["config"]["kind"], "family": r["config"]["family"],
            "style": r["config"]["style"], "budget": r["config"]["budget"], "mode": r["run"]["mode"],
            "level": r["run"]["level"], "key": r["run"]["key"], "failed": r.get("failed"), "repeat": rep,
            "requests": res.get("requests"), "completed": res.get("completed"), "errors": res.get("errors"),
            "timeouts": res.get("timeouts"),
            "tokens_per_round": spec.get("tokens_per_round"), "candidates_per_round": spec.get("candidates_per_round"),
            "acceptance_rate": spec.get("acceptance_rate"), "accept_prob_per_depth": spec.get("accept_prob_per_depth"),
            "output_tok_s": res.get("output_tok_s"), "requests_s": res.get("requests_s"),
            "tok_per_cpu_s": res.get("output_tok_per_cpu_s"),
            "tokens_per_step": _ratio(spec.get("generation_tokens"), spec.get("engine_steps")),
            "ttft_ms": [_ms(_g(res, "ttft_s", "median")), _ms(_g(res, "ttft_s", "p95"))],
            "tpot_ms": [_ms(_g(res, "tpot_s", "median")), _ms(_g(res, "tpot_s", "p95"))],
            "itl_ms": [_ms(_g(res, "itl_s", "median")), _ms(_g(res, "itl_s", "p95"))],
            "itl_chunk_ms": [_ms(_g(res, "itl_chunk_s", "median")), _ms(_g(res, "itl_chunk_s", "p95"))],
            "e2e_s": [_g(res, "e2e_s", "median"), _g(res, "e2e_s", "p95")],
            "stage_ms_per_step": stage or None, "engine_steps": spec.get("engine_steps"),
            "peak_rss_gib": (mem.get("peak_rss_bytes") or 0) / 2**30 or None,
            "identical": ident, "sampled": not is_greedy(r),
            "humaneval": (he.get("passed"), he.get("total")) if he else None,
            "input_tokens": _g(res, "lengths", "input_tokens"), "output_tokens": _g(res, "lengths", "output_tokens"),
        })
    out = fold_repeats(out)
    order = {"off": 0, "linear": 1, "tree": 2}
    out.sort(key=lambda x: (x["mode"], x["level"], x["family"] if x["family"] != "off" else "",
                            x["budget"] or 0, order.get(x["style"], 3), x["config"]))
    return out


def _median(xs):
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fold_repeats(rs: list[dict]) -> list[dict]:
    """One row per (configuration, load): medians over the repeats, the per-repeat values kept in `per_repeat`.

    A failed repeat stays a row of its own (marked with its repeat) and is left out of the medians.
    """
    groups: dict[tuple, list[dict]] = {}
    out = []
    for r in rs:
        if r["failed"]:
            out.append({**r, "config": r["config"] + (f" (rep {r['repeat']})" if r["repeat"] else ""),
                        "repeats": 1, "per_repeat": None})
        else:
            groups.setdefault((r["config"], r["key"]), []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: r["repeat"])
        row = dict(group[0])
        row["repeats"] = len(group)
        row["per_repeat"] = {g["repeat"]: {m: g[m] for m in REPEAT_METRICS} for g in group}
        if len(group) > 1:
            for m in REPEAT_METRICS:
                row[m] = _median(g[m] for g in group)
            for m in ("ttft_ms", "tpot_ms", "itl_ms", "itl_chunk_ms", "e2e_s"):
                row[m] = [_median(g[m][i] for g in group) for i in range(2)]
            for m in ("completed", "errors", "timeouts", "requests"):
                row[m] = sum(g[m] or 0 for g in group)
            idents = [g["identical"] for g in group if g["identical"] is not None]
            row["identical"] = (sum(i[0] for i in idents), sum(i[1] for i in idents)) if idents else None
            he = [g["humaneval"] for g in group if g["humaneval"] and g["humaneval"][0] is not None]
            row["humaneval"] = (sum(h[0] for h in he), sum(h[1] for h in he)) if he else group[0]["humaneval"]
            stages = [g["stage_ms_per_step"] for g in group if g["stage_ms_per_step"]]
            row["stage_ms_per_step"] = ({k: _median(st[k] for st in stages) for k in stages[0]} if stages else None)
            row["peak_rss_gib"] = max((g["peak_rss_gib"] or 0 for g in group), default=0) or None
        out.append(row)
    return out


def _ms(x):
    return None if x is None else 1e3 * x


def _f(x, nd=2, suffix=""):
    return "-" if x is None else f"{x:.{nd}f}{suffix}"


def _pair(p, nd=0):
    return "-" if p is None or p[0] is None else f"{p[0]:.{nd}f} / {p[1]:.{nd}f}"


def markdown_table(rs: list[dict]) -> str:
    head = ["config", "load", "ok/err/timeout", "tokens/round", "cand./round", "accept rate", "tok/step", "out tok/s",
            "tok/CPU-s", "req/s",
            "TTFT p50/p95 ms", "TPOT p50/p95 ms", "ITL p50/p95 ms", "e2e p50/p95 s",
            "draft/verify/commit ms/step", "peak RSS GiB", "identical to off", "HumanEval pass"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        if r["failed"]:
            lines.append(f"| {r['config']} | {r['key']} | FAILED: {r['failed'][:80]} |" + " |" * (len(head) - 3))
            continue
        st = r["stage_ms_per_step"]
        stage = "-" if not st else f"{st['draft']:.2f} / {st['verify']:.2f} / {st['commit']:.2f}"
        ident = (("n/a (sampled)" if r["sampled"] and r["kind"] != "off" else "-") if r["identical"] is None
                 else f"{r['identical'][0]}/{r['identical'][1]}")
        he = "-" if not r["humaneval"] or r["humaneval"][0] is None else f"{r['humaneval'][0]}/{r['humaneval'][1]}"
        load = f"c={r['level']:g}" if r["mode"] == "concurrency" else f"{r['level']:g} req/s"
        name = r["config"] + (f" (median of {r['repeats']})" if r.get("repeats", 1) > 1 else "")
        lines.append("| " + " | ".join([
            name, load, f"{r['completed']}/{r['errors']}/{r['timeouts']}", _f(r["tokens_per_round"]),
            _f(r["candidates_per_round"]), _f(r["acceptance_rate"]), _f(r["tokens_per_step"]), _f(r["output_tok_s"], 1),
            _f(r["tok_per_cpu_s"], 1), _f(r["requests_s"], 3),
            _pair(r["ttft_ms"]), _pair(r["tpot_ms"], 1), _pair(r["itl_ms"], 1), _pair(r["e2e_s"], 2), stage,
            _f(r["peak_rss_gib"], 2), ident, he]) + " |")
    return "\n".join(lines)


def comparisons(rs: list[dict]) -> list[dict]:
    """Tree vs linear (same drafter, D, load) and each vs off."""
    idx = {(r["family"], r["style"], r["budget"], r["key"], r["kind"]): r for r in rs if not r["failed"]}
    off = {r["key"]: r for r in rs if r["kind"] == "off" and not r["failed"]}
    out = []
    for r in rs:
        if r["style"] != "tree" or r["failed"]:
            continue
        twin = "linear-" + r["kind"][len("tree-"):]  # tree-suffix-wide -> linear-suffix-wide
        lins = [idx.get((r["family"], "linear", r["budget"], r["key"], twin))
                or idx.get((r["family"], "linear", r["budget"], r["key"], f"linear-{r['family']}"))]
        if r["family"] == "eagle3":  # against each linear eagle3 setting measured (default and probabilistic)
            lins = [x for k, x in sorted(idx.items(), key=lambda kv: kv[0][4])
                    if k[:4] == (r["family"], "linear", r["budget"], r["key"])] or [None]
        o = off.get(r["key"])
        for lin in lins:
            out.append(_compare(r, lin, o))
    return out


def _rratio(a: dict | None, b: dict | None, metric: str):
    """a / b for one metric: the median of per-repeat ratios where both have the same repeats, else the ratio."""
    if a is None or b is None:
        return None
    pa, pb = a.get("per_repeat") or {}, b.get("per_repeat") or {}
    common = sorted(set(pa) & set(pb))
    if len(common) > 1:
        return _median(_ratio(pa[i][metric], pb[i][metric]) for i in common)
    return _ratio(a[metric], b[metric])


def _compare(r: dict, lin: dict | None, o: dict | None) -> dict:
    """Tree row r against linear row lin (None: not measured) and off row o, same D and load."""
    return {
        "tree": r["config"], "kind": r["kind"], "linear": lin["config"] if lin else None, "family": r["family"],
        "budget": r["budget"], "key": r["key"], "mode": r["mode"], "level": r["level"],
        "accepted_length_ratio": _rratio(r, lin, "tokens_per_round"),
        "tokens_per_step_ratio": _rratio(r, lin, "tokens_per_step"),
        "throughput_ratio_vs_linear": _rratio(r, lin, "output_tok_s"),
        "cpu_efficiency_ratio_vs_linear": _rratio(r, lin, "tok_per_cpu_s"),
        "cpu_efficiency_ratio_vs_off": _rratio(r, o, "tok_per_cpu_s"),
        "throughput_ratio_vs_off": _rratio(r, o, "output_tok_s"),
        "linear_vs_off": _rratio(lin, o, "output_tok_s"),
        "tpot_p50_ratio_vs_linear": _ratio(r["tpot_ms"][0], lin and lin["tpot_ms"][0]),
        "windows": windows(r, lin, "output_tok_s"),
        "linear_kind": lin["kind"] if lin else None,
        "repeats": min(r["repeats"], lin["repeats"]) if lin else None,
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def windows(a: dict | None, b: dict | None, metric: str) -> list[float]:
    """a / b per window (repeat i of a against repeat i of b), in window order; [] without repeats."""
    pa, pb = (a or {}).get("per_repeat") or {}, (b or {}).get("per_repeat") or {}
    common = sorted(set(pa) & set(pb), key=int)
    ws = [_ratio(pa[i][metric], pb[i][metric]) for i in common]
    return [w for w in ws if w is not None] if len(common) > 1 else []


def comparison_table(cmp: list[dict]) -> str:
    lines = ["| tree | vs linear | load | tokens/round tree/linear | tok/step tree/linear | tok/s tree/linear "
             "(windows) | tok/CPU-s tree/linear | TPOT p50 tree/linear | tok/s tree vs off | tok/s linear vs off | "
             "tok/CPU-s tree vs off |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cmp:
        lines.append(f"| {c['tree']} | {c['linear'] or '-'} | {c['key']} | {_f(c['accepted_length_ratio'], 3, 'x')} | "
                     f"{_f(c['tokens_per_step_ratio'], 3, 'x')} | "
                     f"{_f(c['throughput_ratio_vs_linear'], 3, 'x')}{_windows(c)} | "
                     f"{_f(c['cpu_efficiency_ratio_vs_linear'], 3, 'x')} | "
                     f"{_f(c['tpot_p50_ratio_vs_linear'], 3, 'x')} | "
                     f"{_f(c['throughput_ratio_vs_off'], 3, 'x')} | {_f(c['linear_vs_off'], 3, 'x')} | "
                     f"{_f(c['cpu_efficiency_ratio_vs_off'], 3, 'x')} |")
    return "\n".join(lines)


def _windows(c: dict) -> str:
    ws = c.get("windows") or []
    return f" ({', '.join(f'{w:.3f}' for w in ws)})" if ws else ""


def lengths_table(runs: list[dict]) -> str:
    """Input/output token distributions per dataset, from the `off` runs (the same prompts for every config)."""
    base = ([r for r in runs if r["config"]["kind"] == "off" and r.get("results")]
            or [r for r in runs if r.get("results")])
    lines = ["| run | dataset | n | input tokens min/median/p95/max | output tokens min/median/p95/max |",
             "|---|---|---|---|---|"]
    for r in base:
        for ds, d in sorted(r["results"]["lengths"]["by_dataset"].items()):
            i, o = d["input_tokens"], d["output_tokens"]
            if not o["count"]:
                continue
            lines.append(f"| {r['config']['name']} {r['run']['key']} | {ds} | {o['count']} | "
                         f"{_q(i)} | {_q(o)} |")
    return "\n".join(lines)


def _q(d):
    if not d or not d["count"]:
        return "-"
    return f"{d['min']:.0f} / {d['median']:.0f} / {d['p95']:.0f} / {d['max']:.0f}"


def acceptance_profiles(rs: list[dict], env: dict) -> dict:
    """Per-depth conditional acceptance a[d] = [P(depth d accepted | depth d - 1 accepted)] per configuration.

    Taken at the lowest load measured, in the planner's a[d][r] format with rank 0 only: vLLM's counters give
    acceptance per depth, not per sibling rank, so a tree run's width is folded into its rank-0 column.
    """
    out = {}
    best: dict[str, dict] = {}
    for r in rs:
        if r["failed"] or not r["accept_prob_per_depth"]:
            continue
        if r["config"] not in best or (r["mode"], r["level"]) < (best[r["config"]]["mode"], best[r["config"]]["level"]):
            best[r["config"]] = r
    for name, r in best.items():
        probs, table, prev = r["accept_prob_per_depth"], [], 1.0
        for p in probs:
            table.append([min(1.0, p / prev) if prev > 0 else 0.0])
            prev = p
        while table and table[-1][0] == 0.0:
            table.pop()
        if table:
            out[name] = {"table": table, "source": f"{name} @ {r['key']}, model {Path(str(env.get('model'))).name}: "
                                                   "per-depth acceptance, rank 0 only"}
    return out


# ---------------------------------------------------------------------------
# Plots



def _save(fig, path, written: list[str]) -> None:
    """Lay out, write and close one plot; record its file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

def plots(runs: list[dict], rs: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [r for r in rs if not r["failed"]]
    conc = [r for r in ok if r["mode"] == "concurrency"]
    # 1. throughput vs concurrency, one line per configuration
    if conc:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name in sorted({r["config"] for r in conc}):
            pts = sorted((r["level"], r["output_tok_s"]) for r in conc if r["config"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _save(fig, out / "throughput_vs_concurrency.png", written)
    rate = [r for r in ok if r["mode"] == "rate"]
    if rate:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name in sorted({r["config"] for r in rate}):
            pts = sorted((r["level"], r["tpot_ms"][0] or 0) for r in rate if r["config"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("median TPOT (ms)")
        ax.set_title("Latency vs request rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _save(fig, out / "latency_vs_rate.png", written)
    # 2. accepted length vs budget, per drafter family and style, at the lowest load measured
    spec = [r for r in ok if r["tokens_per_round"] is not None and r["budget"]]
    if spec:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        lowest = {}
        for r in spec:
            k = (r["kind"], r["budget"])
            if k not in lowest or (r["mode"], r["level"]) < (lowest[k]["mode"], lowest[k]["level"]):
                lowest[k] = r
        families = sorted({k.split("-", 1)[1] for k, _ in lowest})  # suffix, ngram, suffix-wide, draft-static...
        colors = {f: f"C{i}" for i, f in enumerate(families)}
        for kind in sorted({k for k, _ in lowest}):
            pts = sorted((b, lowest[(k, b)]["tokens_per_round"]) for k, b in lowest if k == kind)
            linear = kind.startswith("linear")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if linear else "-",
                    marker="s" if linear else "o", color=colors[kind.split("-", 1)[1]], label=kind)
        budgets = sorted({b for _, b in lowest})
        ax.set_xticks(budgets)
        if len(budgets) == 1:
            ax.set_xlim(budgets[0] - 1, budgets[0] + 1)
        ax.set_xlabel("verification budget D (draft tokens per request per step)")
        ax.set_ylabel("tokens per round (accepted + 1)")
        ax.set_title("Accepted length vs budget (lowest load measured)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        _save(fig, out / "accepted_length_vs_budget.png", written)
    # 3. acceptance per depth, P(round accepts depth d), per configuration at its lowest load
    best: dict[str, dict] = {}
    for r in ok:
        if r["accept_prob_per_depth"] and (r["config"] not in best or (r["mode"], r["level"]) <
                                           (best[r["config"]]["mode"], best[r["config"]]["level"])):
            best[r["config"]] = r
    if best:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, r in sorted(best.items()):
            probs = r["accept_prob_per_depth"]
            ax.plot(range(1, len(probs) + 1), probs, "--" if r["style"] == "linear" else "-", marker="o",
                    label=f"{name} @ {r['key']}")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("depth d (draft position)")
        ax.set_ylabel("P(round accepts a token at depth d)")
        ax.set_ylim(0, 1)
        ax.set_title("Acceptance per depth (lowest load measured)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        _save(fig, out / "acceptance_per_depth.png", written)
    # 4. inter-token latency CDF (per token), one panel per load level
    keys = sorted({(r["run"]["mode"], r["run"]["level"]) for r in runs if r.get("records")})
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4.0), squeeze=False)
        for ax, (mode, level) in zip(axes[0], keys):
            for r in sorted((r for r in runs if r["run"]["mode"] == mode and r["run"]["level"] == level
                             and r.get("records")), key=lambda r: r["config"]["name"]):
                itl = sorted(1e3 * x for rec in r["records"] if rec["ok"] for x in _itl_token(rec))
                if not itl:
                    continue
                n = len(itl)
                ax.plot(itl, [(i + 1) / n for i in range(n)], label=r["config"]["name"])
            ax.set_xscale("log")
            ax.set_xlabel("inter-token latency per token (ms)")
            ax.set_ylabel("fraction of tokens")
            ax.set_title(f"ITL CDF, {'concurrency' if mode == 'concurrency' else 'rate'} {level:g}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        _save(fig, out / "itl_cdf.png", written)
    return written


def _itl_token(rec: dict) -> list[float]:
    t, k = rec["chunk_t"], rec["chunk_tokens"]
    out = []
    for i in range(1, len(t)):
        out.extend([(t[i] - t[i - 1]) / k[i]] * k[i])
    return out


# ---------------------------------------------------------------------------


def profile_section(out: Path, rs: list[dict]) -> list[str]:
    """The EAGLE-3 head's measured profile a[d][r] and the planned trees: predicted vs measured tokens/round."""
    pf, tf = out / "profile" / "profile.json", out / "planned_trees.json"
    if not pf.exists():
        return []
    prof = json.loads(pf.read_text())
    table, src = prof["table"], prof.get("source", {})
    ranks = max((len(r) for r in table), default=0)
    sl = src.get("prompts")
    where = f"pool prompts [{sl[0]}, {sl[1]})" if sl else "its own prompts"
    md = ["## EAGLE-3 acceptance profile and planned trees", "",
          f"Measured by probe servers ({src.get('method', 'eagle3_profile.py')}) on {where} (disjoint from warm-up "
          f"and the measured slices), head `{src.get('head')}`"
          + (f"; reused from `{src['reused']}`" if src.get("reused") else "") + ". a[d][r] = P(the rank-r child of "
          "an accepted depth-(d-1) node is the accepted one); plot: [acceptance_profile.png](acceptance_profile.png).",
          "", "| depth | " + " | ".join(f"rank {r}" for r in range(ranks)) + " | sum |",
          "|---|" + "---|" * (ranks + 1)]
    for d, row in enumerate(table, 1):
        md.append(f"| {d} | " + " | ".join(f"{x:.3f}" for x in row) + f" | {sum(row):.3f} |")
    if tf.exists():
        low: dict[str, dict] = {}
        for r in rs:
            if r["kind"] == "tree-eagle3-planned" and not r["failed"] and (
                    r["config"] not in low or (r["mode"], r["level"]) < (low[r["config"]]["mode"],
                                                                          low[r["config"]]["level"])):
                low[r["config"]] = r
        md += ["", "| D | planned tree (child-rank paths) | predicted tokens/round | predicted chain of D | "
                   "measured tokens/round (lowest load) |", "|---|---|---|---|---|"]
        for d, t in sorted(((int(k), v) for k, v in json.loads(tf.read_text())["trees"].items())):
            m = low.get(f"tree-eagle3-planned-D{d}")
            measured = f"{_f(m['tokens_per_round'], 3)} @ {m['key']}" if m else "-"
            md.append(f"| {d} | `{[tuple(p) for p in t['paths']]}` | {t['expected_tokens_per_round']:.3f} | "
                      f"{t['chain_expected_tokens_per_round']:.3f} | {measured} |")
    return md + [""]


def check_one_sampling(runs: list[dict]) -> dict:
    """A folder compares configurations under one sampling setting; mixing them would pair unlike runs."""
    kinds = {json.dumps(run_sampling(r), sort_keys=True) for r in runs if r.get("run")}
    if len(kinds) > 1:
        raise SystemExit(f"runs with different sampling settings in one folder: {sorted(kinds)}; "
                         "write each setting to its own --out folder")
    return json.loads(kinds.pop()) if kinds else {"temperature": 0.0}


def write_report(out: Path | str) -> str:
    out = Path(out)
    runs = load_runs(out)
    sampling = check_one_sampling(runs)
    rs = rows(runs)
    cmp = comparisons(rs)
    pngs = plots(runs, rs, out) if runs else []
    env = next((r["environment"] for r in runs if r.get("environment")), {})
    host, ver = env.get("host", {}), env.get("versions", {})
    md = [
        f"# Serving benchmark: {out.name}",
        "",
        f"Date (UTC): {env.get('date_utc')}; model: `{env.get('model')}`; sampling: "
        + ("greedy" if not sampling.get("temperature") else json.dumps(sampling) + " (seed: per-request base)"),
        f"Host: {host.get('cpu')}, {host.get('cores')} cores, {(host.get('memory_bytes') or 0) / 2**30:.0f} GiB, "
        f"GPU: {host.get('gpu') or 'none'}; load average at start: {host.get('loadavg_at_start')}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v) + f"; git {_g(env, 'git', 'commit')}"
        + (" (dirty)" if _g(env, "git", "dirty") else ""),
        "",
        "Definitions: a *round* is one request's verify step with a non-empty draft; tokens/round = 1 + "
        "accepted/rounds (bonus included); candidates/round = draft tokens (chain) or nodes (tree) verified per "
        "round; accept rate = accepted / candidates; tok/step = output tokens per engine step (forward pass, "
        "prefill steps included; at concurrency 1 independent of machine load). ITL is per token (a chunk of k "
        "tokens after a gap g counts k times g/k); TPOT = (e2e - TTFT)/(tokens - 1); tok/CPU-s = output tokens per "
        "CPU-second of the server's processes (less sensitive to neighbours' load than wall clock, but vLLM's "
        "processes also poll while idle, so it is not a pure work measure either). Stage times are "
        "the tree worker's timers per engine step "
        "(verify = target distributions + lossless rule, not the forward). Identical = greedy text equal to the "
        "`off` run on the same prompts (not compared for sampled runs).",
        "",
        "## Runs",
        "",
        markdown_table(rs),
        "",
        "## Tree vs linear at equal budget",
        "",
        comparison_table(cmp),
        "",
        *profile_section(out, rs),
        "## Prompt lengths (server-counted tokens, chat template included)",
        "",
        lengths_table(runs),
        "",
        "Plots: " + (", ".join(f"[{p}]({p})" for p in pngs) or "none"),
    ]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"rows": rs, "comparisons": cmp,
                                                  "environment": env, "plots": pngs}, indent=1))
    (out / "acceptance_profiles.json").write_text(json.dumps(acceptance_profiles(rs, env), indent=1))
    plan_changes(out)
    return text


def plan_changes(out: Path) -> None:
    """The shape policy's plan changes from the servers' logs (one `Tree shape plan` line per change) in one file."""
    lines = [ln.rstrip() for log in sorted((out / "logs").glob("*.log")) for ln in log.read_text(errors="replace")
             .splitlines() if "Tree shape plan" in ln]
    if lines:
        (out / "plan-changes.log").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------
# The results page (docs/benchmarks.md): tables and plots from stored summary.json files

STYLE_ORDER = {"off": 0, "linear": 1, "tree": 2}
PAGE_LEVELS = (1, 4, 16, 64)


def load_summary(folder: Path | str) -> dict:
    path = Path(folder) / "summary.json"
    if not path.exists():
        raise SystemExit(f"{path}: no summary.json (a bench_serve.py output folder, e.g. benchmarks/results/*)")
    return json.loads(path.read_text())


def _linear_for(tree: dict, rows_at_key: list[dict]) -> dict | None:
    """The linear row a tree row is compared with: same drafter family and D, vLLM's default setting first."""
    lins = [r for r in rows_at_key if r["style"] == "linear" and r["family"] == tree["family"]
            and r["budget"] == tree["budget"]]
    lins.sort(key=lambda r: (r["kind"] != f"linear-{tree['family']}", r["kind"]))
    return lins[0] if lins else None


def page_rows(folders: list[Path | str], levels=PAGE_LEVELS) -> list[dict]:
    """One row per (concurrency, configuration), the first folder that measured it winning; configurations a
    folder set never measured at a level (`off` included) come back with `row: None`."""
    found: dict[tuple[int, str], tuple[dict, str, list[dict]]] = {}
    names: dict[str, dict] = {"off": {"config": "off", "style": "off"}}
    for folder in folders:
        ok = [r for r in load_summary(folder)["rows"] if not r["failed"] and r["mode"] == "concurrency"]
        for r in ok:
            names.setdefault(r["config"], r)
            same = [x for x in ok if x["key"] == r["key"]]
            found.setdefault((int(r["level"]), r["config"]), (r, Path(folder).name, same))
    out = []
    for level in levels:
        for name, proto in sorted(names.items(), key=lambda kv: (STYLE_ORDER.get(kv[1]["style"], 3), kv[0])):
            r, run, same = found.get((level, name), (None, None, []))
            lin = _linear_for(r, same) if r is not None and r["style"] == "tree" else None
            out.append({"level": level, "config": name, "row": r, "run": run, "linear": lin,
                        "vs_linear": _rratio(r, lin, "output_tok_s") if lin else None,
                        "windows": windows(r, lin, "output_tok_s") if lin else []})
    return out


def page_table(folders: list[Path | str], levels=PAGE_LEVELS) -> str:
    """The Markdown table docs/benchmarks.md prints for these stored runs."""
    lines = ["| c | configuration | tokens/round | out tok/s | tok/s vs linear (windows) | TTFT p50 / p95 ms | "
             "ITL p50 / p95 ms | run |", "|---|---|---|---|---|---|---|---|"]
    rows_ = page_rows(folders, levels)
    for p in rows_:
        r = p["row"]
        if r is None and not any(q["row"] for q in rows_ if q["level"] == p["level"]):
            if p is next(q for q in rows_ if q["level"] == p["level"]):  # one line for a level never measured
                lines.append(f"| {p['level']} | every configuration | not measured | | | | | |")
            continue
        if r is None:
            lines.append(f"| {p['level']} | {p['config']} | not measured | | | | | |")
            continue
        vs = "-" if p["vs_linear"] is None else f"{p['vs_linear']:.3f}x" + (
            f" ({', '.join(f'{w:.2f}' for w in p['windows'])})" if p["windows"] else "")
        lines.append(f"| {p['level']} | {p['config']} | {_f(r['tokens_per_round'])} | {_f(r['output_tok_s'], 1)} | "
                     f"{vs} | {_pair(r['ttft_ms'])} | {_pair(r['itl_ms'], 1)} | {p['run']} |")
    return "\n".join(lines)


def page_plot(folders: list[Path | str], path: Path | str, levels=PAGE_LEVELS) -> Path:
    """Output tok/s vs concurrency, one panel per drafter family, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list] = {}  # folders grouped by the drafter family they measure
    for folder in folders:
        fam = next((r["family"] for r in load_summary(folder)["rows"] if r["family"] != "off"), "off")
        groups.setdefault(fam, []).append(folder)
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.0), squeeze=False)
    for ax, (fam, fs) in zip(axes[0], groups.items()):
        pts: dict[str, list[tuple[int, float]]] = {}
        for p in page_rows(fs, levels):
            if p["row"] is not None:
                pts.setdefault(p["config"], []).append((p["level"], p["row"]["output_tok_s"]))
        trees = iter(f"C{i}" for i in range(1, 10))
        for name, xy in pts.items():  # off grey dotted, linear blue dashed, trees in solid colours
            style, color = (":", "0.45") if name == "off" else ("--", "C0") if name.startswith("linear") else (
                "-", next(trees))
            ax.plot([x for x, _ in xy], [y for _, y in xy], style, color=color, marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(levels), [str(x) for x in levels])
        ax.set_title(fam, fontsize=9)
        ax.set_xlabel("concurrency", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("output tok/s", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="bench_serve.py output folder(s)")
    ap.add_argument("--page", action="store_true", help="print the results-page table of the folders' summary.json")
    ap.add_argument("--plot", metavar="PNG", help="write tok/s vs concurrency of the folders' summary.json to PNG")
    ap.add_argument("--levels", default=",".join(map(str, PAGE_LEVELS)), help="concurrencies of --page / --plot")
    args = ap.parse_args(argv)
    levels = tuple(int(x) for x in args.levels.split(","))
    if args.page or args.plot:
        if args.page:
            print(page_table(args.folders, levels))
        if args.plot:
            print(f"wrote {page_plot(args.folders, args.plot, levels)}")
        return 0
    for folder in args.folders:
        print(write_report(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
