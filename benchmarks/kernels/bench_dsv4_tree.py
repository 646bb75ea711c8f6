"""Benchmark: one DeepSeek-V4 tree step on vLLM's NVIDIA serving path (plan, per-layer launches, refresh).

What runs is the serving path's own code, not a copy: the NVIDIA adapter's `host_plan` (plan.py, host numpy)
and `device_plan` (device_plan.py: one upload, the lists written into vLLM's metadata buffers), the per-layer
launches of its layer overrides (hooks.py) and the accepted-path refresh `refresh_triton` over the adapter's
copy plan (`device_plan.refresh_copy_plan`, what the adapter builds after allocation). vLLM is not
needed (`dsv4_step.py` builds the step): the metadata objects are SimpleNamespaces with the fields
`device_plan` reads and writes, the caches are views into pooled allocations laid out as vLLM 0.32 lays out
DeepSeek-V4 (block-outermost; fp8_ds_mla and indexer-key pages padded to a multiple of 576 bytes, so a
layer's page stride is the pooled block).

One step, DeepSeek-V4-Flash (43 layers: 2 SWA, 21 CSA, 20 HCA; every layer has an SWA window cache):

    plan       device_plan: SWA window lists (one per SWA group), entry write slots, the C128 list, the C4
               path entries, compressor windows, long-context indexer lengths / page tables, refresh tables
    layers     per CSA layer: top-k ids -> slots (N2, `tree_topk_slots_triton`), virtual indexer pages
               (N4, 2 x `copy_rows_triton`, long context); per compressor (21 main + 21 indexer + 20 HCA)
               with block-completing draft nodes: its nodes' pooling windows into scratch (N3, `copy_rows`).
               vLLM's own compress kernel on the virtual tokens and DeepGEMM's indexer schedule are vLLM's
               kernels: not timed here.
    refresh    `refresh_triton`: every SWA row, state row, C4 / C128 entry and indexer key of the accepted
               paths, one launch

Stage 1 (correctness, bitwise): every list `device_plan` wrote, every per-layer launch and the refresh
against their PyTorch twins (`*_reference`, `copy_rows_reference`, `refresh_reference`) on the padded,
pooled pages, at V4-Flash widths (batch 4, binary 15, staggered starts so nodes at every depth complete
blocks). Stage 2 (timing): batch {1, 4, 16, 64} x trees {s3_k2_d6 (5 nodes, 6 rows per request), chain 7,
binary 15} x context {8k, 64k}, root at P = context - 2 (depth-1 nodes complete a C4 and a C128 block),
deepest path accepted; `do_bench` (eager, the real upload) and `do_bench_cudagraph` (the device half
captured: the upload replays from a fixed pinned staging buffer; host_plan is host numpy and is timed
apart). Launches per step are counted: Triton launches (the launchers, wrapped) and PyTorch kernels outside
them (a dispatch mode; views and allocations excluded), plus device-to-host syncs (must be 0), and on a GPU
the profiler's device kernel count.

Denominator: a roofline lower bound of the verify step (`verify_step_lower_bound`; attention = the attention
core at max(FLOPs / bf16 peak, fp8 KV bytes / copy bandwidth) plus the indexer scores at FP8 peak / key
bytes; the whole step adds timed attention-side GEMMs / 2, MoE and LM head rooflines). The headline is
plan + layers + refresh as a fraction of the attention terms at batch 4, s3_k2_d6, 8k context; since the
denominator is a lower bound, the fractions are upper bounds.

On a machine without a GPU only `quick=True` works (Triton interpreter, a tiny V4-shaped stack with vLLM's
row formats, wall clock): a smoke test of the script, not performance numbers.
"""


import json
import math
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dsv4_step import (CSA, HCA, QUICK_SHAPE, Case, V4Shape, count_launches, flash_shape, make_case,
                       profiled_kernels, run_device_plan, run_host_plan, run_layers, run_refresh, staged_upload)

FULL_GRID = {"context": [8192, 65536], "batch": [4, 1, 16, 64], "tree": ["s3_k2_d6", "chain7", "binary15"]}
QUICK_GRID = {"context": [256], "batch": [1], "tree": ["s3_k2_d6"]}
HEADLINE = {"batch": 4, "tree": "s3_k2_d6", "context": 8192}  # the fraction the issue asks for (quick: its row)
DEFAULT_BUDGET_S = 110.0


# ---------------------------------------------------------------------------
# Stage 1: correctness at the benchmark's widths (bitwise)


def correctness(shape: V4Shape, device, batch: int, tree: str, context: int) -> list[dict]:
    from vllm_tree_spec.kernels import dsv4_refresh_launch as r
    from vllm_tree_spec.kernels.dsv4_tree_meta_launch import (DSV4TreeRows, tree_entry_slots_reference,
                                                              tree_topk_slots_reference,
                                                              tree_window_slots_reference)  # fmt: skip

    case = make_case(shape, batch, tree, context, device, seed=1, stagger=True)
    hp = run_host_plan(case)
    plan = run_device_plan(case, hp)
    keep: dict = {}
    run_layers(case, plan, keep)
    rows = DSV4TreeRows(*(torch.from_numpy(a) for a in (hp.row_req, hp.parent, hp.depth, hp.start, hp.cu)),
                        hp.max_depth)  # fmt: skip
    pos = hp.positions
    checks: list[dict] = []

    def eq(name: str, got, want, nonvacuous: bool = True) -> None:
        got, want = got.cpu(), want.cpu()
        ok = got.shape == want.shape and bool(torch.equal(got, want)) and nonvacuous
        checks.append({"check": name, "ok": ok, "detail": f"{tuple(want.shape)}" + ("" if nonvacuous else
                                                                                      " (vacuous)")})

    t = torch.from_numpy
    for g in case.caches.swa:  # SWA window lists, straight into decode_swa_indices / lens
        sm, bt = case.stock[f"swa{g.gid}"]
        m_ = case.md[f"swa{g.gid}"]
        want = tree_window_slots_reference(rows, t(sm), t(bt), m_.block_size, shape.window, align="left")
        eq(f"SWA group {g.gid} window list", m_.decode_swa_indices[:, 0, :], want[0])
        eq(f"SWA group {g.gid} window lens", m_.decode_swa_lens, want[1])
    own, ref_entries = {}, {}
    for m in case.caches.ratios:  # the rows' own entry slots: roots canonical, emitting nodes scratch
        o = t(case.stock[f"entries{m}"][0].copy())
        o[t(hp.emitters[m].rows)] = t(hp.emitters[m].slots)
        own[m] = o
        bt = t(case.stock[f"entries{m}"][1])
        epb = case.caches.entries_per_block[m]
        if m == HCA:
            dense = case.md[f"entries{HCA}"].c128a_global_decode_topk_indices
            want = tree_entry_slots_reference(rows, o, bt, epb, m, root_committed=True, dense_width=dense.shape[-1])
            eq("C128 entry list (dense)", dense[:, 0, :], want.dense)
            eq("C128 entry list lens", case.md[f"entries{HCA}"].c128a_decode_topk_lens, want.lens)
        else:
            want = tree_entry_slots_reference(rows, o, bt, epb, m, root_committed=True)
            for f in ("tail", "lens", "committed", "write"):
                eq(f"C4 path entries ({f})", getattr(plan.entries[CSA], f), getattr(want, f))
        ref_entries[m] = want
    nodes = t(hp.node_rows)
    for key in [f"entries{m}" for m in case.caches.ratios] + (["indexer"] if "indexer" in case.md else []):
        want = t(case.stock[f"entries{CSA}" if key == "indexer" else key][0].copy())
        want[nodes] = -1
        eq(f"write slot mapping ({key}: draft nodes -1)", case.md[key].slot_mapping, want)
    if CSA in case.caches.ratios:  # N2: every CSA layer's top-k ids -> slots
        bt = t(case.stock[f"entries{CSA}"][1])
        for j, (got, ids) in enumerate(zip(keep["topk"], case.topk)):
            want = tree_topk_slots_reference(rows, ids.cpu(), ref_entries[CSA], bt, case.caches.entries_per_block[CSA])
            tail_hits = bool(((ids.cpu().long() >= ref_entries[CSA].committed.long()[:, None])).any())
            eq(f"CSA layer {j} top-k slots", got[0], want[0], tail_hits)
            eq(f"CSA layer {j} top-k lens", got[1], want[1])
    for m, vc in plan.compress.items():  # compressor windows: sources of the scratch copies
        sm, bt = case.stock[f"state{m}"]
        win = tree_window_slots_reference(rows, t(sm), t(bt), case.caches.state[m].block_size, vc.window,
                                          align="position", out_dtype=torch.int64)[0]  # fmt: skip
        hc = hp.compress[m]
        eq(f"C{m} compressor window sources", vc.fill_src, win[t(hc.fill_rows), t(hc.fill_cols)], vc.num > 0)
    for tag, cp, before, src, dst, after in keep.get("n3", []):  # N3 copies vs the twin, on the scratch state
        scratch = cp.planes[0][1].owner
        got = scratch.clone()
        scratch.copy_(before)
        r.copy_rows_reference(cp, src, dst)
        eq(f"N3 window copy ({tag})", got, scratch, not torch.equal(before, after))
    if plan.indexer is not None:  # N4 pages + keys on the padded key pages, and the indexer's metadata
        ix = plan.indexer
        dec = case.md["indexer"].decode
        eq("indexer seq_lens (entries per row)", dec.seq_lens.view(-1), t((pos + 1) // CSA).to(torch.int32))
        want_bt = t(case.stock["indexer_bt"].copy()).to(torch.int32)
        ih = hp.indexer
        want_bt[t(ih.rows_bt), t(ih.blk_idx)] = t(ih.vblock).to(torch.int32)
        eq("indexer page table rows (virtual pages)", dec.block_table, want_bt, len(ih.rows_bt) > 0)
        pool = case.pools[-1]
        for j in sorted({0, len(case.caches.key_caches) - 1}):
            k_cache = case.caches.key_caches[j]
            pages, keys = case.page_plans[k_cache.data_ptr()]
            k_cache[ix.page_dst] = 0  # the virtual pages before this layer's copies (run_layers filled them)
            before = pool.clone()
            r.copy_rows_triton(pages, ix.page_src, ix.page_dst)
            r.copy_rows_triton(keys, ix.key_src, ix.key_dst)
            got = pool.clone()
            pool.copy_(before)
            r.copy_rows_reference(pages, ix.page_src, ix.page_dst)
            r.copy_rows_reference(keys, ix.key_src, ix.key_dst)
            eq(f"N4 virtual pages + keys (CSA layer {j})", got, pool, not torch.equal(before, got))
    # the refresh (adapter.commit) on every pooled, padded page vs refresh_reference
    before = [p.clone() for p in case.pools]
    run_refresh(case, plan)
    got = [p.clone() for p in case.pools]
    for p, b in zip(case.pools, before):
        p.copy_(b)
    copies = r.refresh_reference(case.refresh, plan.refresh.src, plan.refresh.dst, case.step.meta.cu_num_rows,
                                 case.result.accepted_nodes, case.result.num_accepted)  # fmt: skip
    same = all(torch.equal(a, b) for a, b in zip(got, case.pools))
    moved = sum(int((a != b).sum()) for a, b in zip(got, before))
    checks.append({"check": "refresh (accepted paths, all spaces) vs refresh_reference", "ok": same and moved > 0,
                   "detail": f"{copies} (plane, row) copies, {moved} bytes changed"})
    return checks


# ---------------------------------------------------------------------------
# Verify-step lower bound


def linear_shapes(s: V4Shape, kind: str) -> list[tuple[int, int, int]]:
    """(groups, in, out) of the attention-side linears of one layer."""
    lin = [(1, s.hidden, s.q_lora), (1, s.q_lora, s.heads * s.head_dim), (1, s.hidden, s.head_dim),
           (s.o_groups, s.heads // s.o_groups * s.head_dim, s.o_lora),
           (1, s.o_groups * s.o_lora, s.hidden)]  # fmt: skip
    if kind == "csa":
        lin += [(1, s.hidden, 4 * s.head_dim), (1, s.q_lora, s.index_heads * s.index_dim), (1, s.hidden, s.index_heads),
                (1, s.hidden, 4 * s.index_dim)]  # fmt: skip
    elif kind == "hca":
        lin += [(1, s.hidden, 2 * s.head_dim)]
    return lin


def verify_step_lower_bound(s: V4Shape, batch: int, rows: int, context: int, device, timer, tmode: str,
                            copy_gbps: float, bf16_tflops: float, cache: dict) -> dict:  # fmt: skip
    key = (batch, rows, context, tmode)
    if key in cache:
        return cache[key]
    R = rows
    bw = copy_gbps * 1e9
    peak = bf16_tflops * 1e12
    terms = {"linears_bf16_timed": 0.0, "attn_core": 0.0, "indexer": 0.0, "moe": 0.0, "lm_head": 0.0}
    for kind in ("swa", "csa", "hca"):
        n_layers = s.count(kind)
        if not n_layers:
            continue
        ws = []
        for groups, din, dout in linear_shapes(s, kind):
            x = torch.randn(groups, R, din, device=device, dtype=torch.bfloat16)
            w = torch.randn(groups, din, dout, device=device, dtype=torch.bfloat16) / math.sqrt(din)
            ws.append((x, w))

        def lin_fn(ws=ws):
            for x, w in ws:
                torch.bmm(x, w)

        terms["linears_bf16_timed"] += n_layers * timer(lin_fn, tmode) * 1e-3 / 2  # FP8 credit: / 2
        n_kv = s.window + {"csa": s.index_topk, "hca": context // s.hca_ratio}.get(kind, 0)
        flops = 4 * R * s.heads * n_kv * s.head_dim
        kv_bytes = R * n_kv * (s.kv_data_bytes + 8)
        terms["attn_core"] += n_layers * max(flops / peak, kv_bytes / bw)
        if kind == "csa":
            nv = context // 4
            flops = 2 * R * s.index_heads * s.index_dim * nv
            terms["indexer"] += n_layers * max(flops / (2 * peak), batch * nv * (s.index_dim + 4) / bw)
    # MoE: expected distinct routed experts touched by R tokens (uniform routing) + the shared expert
    touched = s.experts * (1 - (1 - s.experts_per_tok / s.experts) ** R)
    expert_params = 3 * s.hidden * s.moe_inter
    moe_bytes = touched * expert_params * 0.5 + s.shared_experts * expert_params * 1.0
    moe_flops = 2 * R * (s.experts_per_tok + s.shared_experts) * expert_params
    terms["moe"] = len(s.kinds) * max(moe_bytes / bw, moe_flops / (2 * peak))
    terms["lm_head"] = s.vocab * s.hidden * 2 / bw
    total = sum(terms.values())
    out = {"total_ms": total * 1e3, "attention_ms": (terms["attn_core"] + terms["indexer"]) * 1e3,
           **{k + "_ms": v * 1e3 for k, v in terms.items()}}
    cache[key] = out
    return out


def bf16_matmul_tflops(device, timer, quick: bool) -> float:
    n = 256 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    b = torch.randn_like(a)
    ms = timer(lambda: a @ b, timer.modes[0])
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------
# Stage 2: one configuration


def time_case(case: Case, timer, tmode: str, quick: bool) -> dict:
    """ms per provider; quick (interpreter): one wall-clock call each, total = the sum (a smoke test)."""
    hp = run_host_plan(case)
    if quick:
        timer = _once

    def total():
        p = run_device_plan(case, hp)
        run_layers(case, p)
        run_refresh(case, p)

    with staged_upload(case.device) if tmode == "cudagraph" else _nothing():
        plan = run_device_plan(case, hp)  # warm: the staging buffers exist before a capture
        providers = {"plan": lambda: run_device_plan(case, hp), "layers": lambda: run_layers(case, plan),
                     "refresh": lambda: run_refresh(case, plan), "total": total}
        if quick:
            del providers["total"]
        out = {k + "_ms": _safe(timer, fn, tmode) for k, fn in providers.items()}
    if quick and all(isinstance(v, float) for v in out.values()):
        out["total_ms"] = sum(out.values())
    return out


def _once(fn, mode) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@contextmanager
def _nothing():
    yield


def _safe(timer, fn, tmode):
    try:
        return timer(fn, tmode)
    except Exception as e:  # record and go on (the row notes it)
        return f"{type(e).__name__}: {str(e)[:160]}"


def launches(case: Case) -> dict:
    hp = run_host_plan(case)
    out = {}
    plan_box = {}
    out["plan"] = count_launches(case, lambda: plan_box.setdefault("p", run_device_plan(case, hp)))
    plan = plan_box["p"]
    out["layers"] = count_launches(case, lambda: run_layers(case, plan))
    out["refresh"] = count_launches(case, lambda: run_refresh(case, plan))
    if case.device.type == "cuda":
        out["profiled_device_ops"] = profiled_kernels(lambda: (run_layers(case, run_device_plan(case, hp)),
                                                               run_refresh(case, plan)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# Driver


def run(quick: bool = False, out_dir: str | Path | None = None, time_budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Run both stages; write bench_dsv4_tree.{json,md} into out_dir; return the JSON dict."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not quick:
            raise RuntimeError("the full DeepSeek-V4 tree benchmark needs a CUDA GPU; use quick=True for a CPU "
                               "smoke run")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("CPU smoke run needs TRITON_INTERPRET=1 set before Triton is imported")
    import triton

    from bench_verify_commit import Timer, copy_bandwidth_gbps

    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    budget = float(time_budget_s)
    t_start = time.perf_counter()
    shape = QUICK_SHAPE if quick else flash_shape()
    grid = QUICK_GRID if quick else FULL_GRID
    timer = Timer(device, quick)
    meta = {
        "mode": "quick" if quick else "full",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": shape.describe(),
        "timer_modes": timer.modes,
        "time_budget_s": budget,
        "workload": "P = context - 2 (depth-1 nodes complete a C4 and a C128 block), deepest path accepted, "
                    "vLLM's linear row slots, pooled padded pages",
    }
    if device.type == "cpu":
        meta["warning"] = ("CPU + Triton interpreter: smoke test of the script only, not performance numbers "
                           "(no GPU was available when this report was produced)")  # fmt: skip
    meta["copy_gbps"] = copy_bandwidth_gbps(device, timer, quick)
    meta["bf16_tflops"] = bf16_matmul_tflops(device, timer, quick)
    # quick: 2 requests of s3_k2_d6 (the interpreter pays per program: each C128 emitter copies 128 rows)
    checks = correctness(shape, device, *((2, "s3_k2_d6") if quick else (4, "binary15")), grid["context"][0])
    meta["stage1_s"] = time.perf_counter() - t_start
    results, skipped, step_cache = [], [], {}
    for context in grid["context"]:
        for batch in grid["batch"]:
            for tree_name in grid["tree"]:
                key = {"batch": batch, "tree": tree_name, "context": context}
                if time.perf_counter() - t_start > budget:
                    skipped.append(key)
                    continue
                case = make_case(shape, batch, tree_name, context, device, seed=batch + context)
                t0 = time.perf_counter()
                for _ in range(3):
                    hp = run_host_plan(case)
                host_ms = (time.perf_counter() - t0) / 3 * 1e3
                base = {**key, "rows": case.rows, "accepted": int(case.result.num_accepted[0]),
                        "emitters": {m: len(e.rows) for m, e in hp.emitters.items()},
                        "virtual_pages": len(hp.indexer.page_dst) if hp.indexer is not None else 0,
                        "host_plan_ms": host_ms, "launches": launches(case)}  # fmt: skip
                try:
                    step = verify_step_lower_bound(shape, batch, case.rows, context, device, timer, timer.modes[0],
                                                   meta["copy_gbps"], meta["bf16_tflops"], step_cache)  # fmt: skip
                except Exception as e:
                    step = {"total_ms": None, "attention_ms": None, "note": f"{type(e).__name__}: {str(e)[:160]}"}
                for tmode in timer.modes:
                    row = {**base, "timer": tmode, **time_case(case, timer, tmode, quick), "verify_step": step}
                    tot = row.get("total_ms")
                    if isinstance(tot, float):
                        if step.get("attention_ms"):
                            row["pct_of_attention"] = 100 * tot / step["attention_ms"]
                        if step.get("total_ms"):
                            row["pct_of_step"] = 100 * tot / step["total_ms"]
                    results.append(row)
                del case
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    meta["elapsed_s"] = time.perf_counter() - t_start
    headline = [r for r in results if all(r[k] == v for k, v in HEADLINE.items())] if not quick else results[:1]
    report = {"meta": meta, "correctness": checks, "results": results, "skipped_over_budget": skipped,
              "headline": headline}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_dsv4_tree.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "bench_dsv4_tree.md").write_text(markdown(report))
    return report


def _f(x, fmt="{:.4f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# DeepSeek-V4 tree step on vLLM's NVIDIA serving path: plan, per-layer launches, refresh",
        "",
        f"- device: {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, interpreter: "
        f"{meta['interpreter']})",
        f"- model: {meta['shape']}",
        f"- workload: {meta['workload']}",
        f"- measured copy bandwidth {meta['copy_gbps']:.1f} GB/s, matmul {meta['bf16_tflops']:.1f} TFLOP/s; "
        f"stage 1 {meta['stage1_s']:.1f} s, elapsed {meta['elapsed_s']:.1f} s (budget {meta['time_budget_s']:.0f} s)",
        "- attention = roofline lower bound of the verify step's attention core + indexer scores; step = the "
        "whole-step lower bound; both % are upper bounds",
    ]
    if "warning" in meta:
        lines += ["", f"**{meta['warning']}**"]
    gate = report["correctness"]
    verdict = "PASS" if gate and all(c["ok"] for c in gate) else "FAIL"
    lines += ["", f"## Stage 1: correctness (bitwise vs the PyTorch twins): {verdict}", ""]
    lines += [f"- {'ok' if c['ok'] else 'FAIL'}: {c['check']} {c.get('detail', '')}" for c in gate]
    for h in report.get("headline", []):
        lines += ["", f"Headline ({h['timer']}, batch {h['batch']}, {h['tree']}, ctx {h['context']}): plan + layers "
                  f"+ refresh {_f(h.get('total_ms'))} ms = {_f(h.get('pct_of_attention'), '{:.2f}')} % of the "
                  f"attention estimate {_f(h['verify_step'].get('attention_ms'), '{:.3f}')} ms "
                  f"({_f(h.get('pct_of_step'), '{:.2f}')} % of the step's "
                  f"{_f(h['verify_step'].get('total_ms'), '{:.3f}')} ms)"]  # fmt: skip
    for tmode in meta["timer_modes"]:
        lines += ["", f"## Stage 2: {tmode} (ms per step, whole model)", ""]
        lines.append("| ctx | B | tree | rows | host plan | plan | layers | refresh | total | attention LB | % attn "
                     "| % step | launches triton / torch (plan, layers, refresh) | syncs |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in report["results"]:
            if r["timer"] != tmode:
                continue
            ln = r["launches"]
            lc = ", ".join(f"{ln[k]['triton']}/{ln[k]['torch']}" for k in ("plan", "layers", "refresh"))
            syncs = sum(ln[k]["syncs"] for k in ("plan", "layers", "refresh"))
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['tree']} | {r['rows']} | {_f(r['host_plan_ms'], '{:.3f}')} "
                f"| {_f(r.get('plan_ms'))} | {_f(r.get('layers_ms'))} | {_f(r.get('refresh_ms'))} "
                f"| {_f(r.get('total_ms'))} | {_f(r['verify_step'].get('attention_ms'), '{:.3f}')} "
                f"| {_f(r.get('pct_of_attention'), '{:.2f}')} | {_f(r.get('pct_of_step'), '{:.2f}')} | {lc} "
                f"| {syncs} |")  # fmt: skip
    notes = [f"{r['batch']}/{r['tree']}/{r['context']} {k}: {v}" for r in report["results"] for k, v in r.items()
             if k.endswith("_ms") and isinstance(v, str)]  # fmt: skip
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in dict.fromkeys(notes)]
    if report["skipped_over_budget"]:
        lines += ["", f"Skipped (time budget): {report['skipped_over_budget']}"]
    return "\n".join(lines) + "\n"
