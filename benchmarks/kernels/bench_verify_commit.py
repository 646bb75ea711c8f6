"""Benchmark: tree verification and accepted-path KV commit, Triton kernels vs PyTorch.

Verification (per mode): B requests, each with a complete binary draft tree of
`nodes` nodes (child tokens = the top-2 of q at the parent row, so walks go a
few levels deep), p = softmax(logits), q = softmax(logits + noise), float32,
one launch of

  verify_triton   `tree_verify_triton` (one program per request, walks its tree)
  verify_torch    `vllm_tree_spec.verify.verify_batch` (vectorised over all rows;
                  host syncs inside, so no CUDA-graph timing)
  verify_served   `verify_batch` as the serving path calls it with VLLM_TREE_SPEC_VERIFY=torch
                  (`integration/tree_sampler.py::verify_rows`): lazy coins drawn in the call (as
                  each step draws them), `sync_free=True`, greedy from the rows' argmax (computed in
                  the call) without p. Tree metadata goes host -> device inside: no CUDA-graph timing
  verify_served_triton  the same call through `verify_batch_triton`, the GPU serving path's default:
                  the lazy coins materialised (`VerifyCoins.materialise`), one upload, one launch

Commit: the same trees with an accepted root-to-leaf path per request (the
deepest, i.e. the most copies), Llama-3-8B KV layout (32 layers, H_kv 8, D 128,
bf16, page 16, vLLM's [2, num_blocks, page, H_kv, D] per layer), rows at the
slots of positions C .. C + N through a shuffled block table:

  commit_triton   `kv_commit_triton`: index lists built in the kernel, all layers in one launch
  commit_torch    `kv_commit_torch`: index lists from tensor ops, one gather + scatter per layer

Times: `triton.testing.do_bench` (L2 flushed) and `do_bench_cudagraph` where the
provider is capturable. Bytes models: verification = every visited row's p (+ E
for deterministic / sampled, + q for sampled) read once, V entries each (both
providers get the same numerator, so GB/s compare speeds; PyTorch reads far
more); commit = accepted rows x layers x (K + V) x row bytes, read + written.
On a machine without a GPU only `quick=True` works (Triton interpreter, tiny
sizes, wall clock): a smoke test of the script, not performance numbers.

TODO (DeepSeek-V4): "commit plus index-list construction under 5% of a verify
step" needs the model's verify-step time; see docs/kernels.md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

FULL_GRID = {"batch": [1, 8, 64], "nodes": [4, 16, 64], "vocab": [32000, 128256],
             "modes": ["greedy", "deterministic", "sampled_without_replacement"]}  # fmt: skip
NOT_CAPTURABLE = {"verify_torch": "host syncs inside verify_batch: not capturable",
                  "verify_served": "tree metadata uploaded inside verify_batch(sync_free=True): not captured",
                  "verify_served_triton": "coins drawn and tree metadata uploaded inside: not captured"}
QUICK_GRID = {"batch": [1, 3], "nodes": [4], "vocab": [257], "modes": ["greedy", "sampled_without_replacement"]}


@dataclass(frozen=True)
class KVShape:
    layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    context: int  # committed tokens before the root

    def describe(self) -> str:
        return (f"{self.layers} layers, H_kv={self.num_kv_heads}, D={self.head_dim}, page={self.page_size}, "
                f"{str(self.dtype).replace('torch.', '')}, context {self.context}")  # fmt: skip


FULL_KV = KVShape(32, 8, 128, 16, torch.bfloat16, 1000)  # Llama-3-8B
QUICK_KV = KVShape(2, 2, 16, 16, torch.bfloat16, 20)
DEFAULT_BUDGET_S = 115.0  # the full GPU grid must fit in ~2 minutes


def binary_tree_parents(n: int) -> list[int]:
    """Complete binary tree under the root: nodes 0, 1 are root children, node i's parent is i // 2 - 1."""
    return [i // 2 - 1 for i in range(n)]


# ---------------------------------------------------------------------------
# Timing


class Timer:
    """GPU: do_bench / do_bench_cudagraph. CPU (quick smoke only): median wall clock of a few runs."""

    def __init__(self, device: torch.device, quick: bool):
        self.device = device
        self.quick = quick

    @property
    def modes(self) -> list[str]:
        return ["do_bench", "cudagraph"] if self.device.type == "cuda" else ["wallclock"]

    def __call__(self, fn: Callable[[], object], mode: str) -> float:
        if mode == "wallclock":
            fn()
            runs = []
            for _ in range(2 if self.quick else 5):
                t0 = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(runs)
        import triton.testing as tt

        # Small budgets: the whole grid (incl. PyTorch's multi-GB verify_batch temporaries) in ~2 min.
        if mode == "do_bench":
            return float(tt.do_bench(fn, warmup=5, rep=20))
        if mode == "cudagraph":
            return float(tt.do_bench_cudagraph(fn, rep=10))
        raise ValueError(mode)


def copy_bandwidth_gbps(device: torch.device, timer: Timer, quick: bool) -> float:
    n = (1 << 30 if device.type == "cuda" and not quick else 1 << 22) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), timer.modes[0])
    del src, dst
    return 2 * n * 4 / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------
# Verification inputs


@dataclass
class VerifyCase:
    batch: object  # TreeBatch
    p: torch.Tensor  # [R, V]
    q: torch.Tensor  # [R, V]
    coins: object  # VerifyCoins
    modes: torch.Tensor  # [B] int32 on the device
    tin: object  # TreeVerifyInputs
    workspace: tuple


def make_verify_case(batch_size: int, nodes: int, vocab: int, mode: str, device: torch.device, seed: int) -> VerifyCase:
    from vllm_tree_spec.kernels.tree_verify_launch import tree_verify_inputs
    from vllm_tree_spec.tree import Tree, TreeBatch
    from vllm_tree_spec.verify import Mode, VerifyCoins

    gen = torch.Generator(device=device).manual_seed(seed)
    parents = torch.tensor(binary_tree_parents(nodes), dtype=torch.long)
    shape = Tree(parents)
    rows = batch_size * (nodes + 1)
    logits = torch.randn(rows, vocab, device=device, generator=gen) * 3
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(rows, vocab, device=device, generator=gen), -1)
    top2 = q.topk(2, dim=-1).indices.cpu()  # [R, 2]: the drafter's two best tokens per row
    trees = []
    for b in range(batch_size):
        base = b * (nodes + 1)
        toks = [int(top2[base + par + 1, int(shape.sibling_rank[i])]) for i, par in enumerate(parents.tolist())]
        trees.append(shape.with_tokens(torch.tensor(toks, dtype=torch.long)))
    batch = TreeBatch.from_trees(trees)
    coins = VerifyCoins.draw(batch_size, batch.max_depth, batch.max_children, vocab, device=device)
    modes = torch.full((batch_size,), int(Mode.parse(mode)), dtype=torch.int32, device=device)
    ws = tuple(torch.empty(batch_size, 2, vocab, device=device) for _ in range(2))
    return VerifyCase(batch, p, q, coins, modes, tree_verify_inputs(batch, device), ws)


def verify_providers(case: VerifyCase, mode: str) -> dict[str, Callable[[], object]]:
    from vllm_tree_spec.kernels.tree_verify_launch import tree_verify_triton, verify_batch_triton
    from vllm_tree_spec.verify import Mode, VerifyCoins, verify_batch

    sampled = mode.startswith("sampled")
    q = case.q if sampled else None
    t = case.tin
    b, d = case.batch.batch_size, t.max_depth
    dev = case.p.device
    out = (torch.empty(b, d + 1, dtype=torch.int64, device=dev), torch.empty(b, dtype=torch.int64, device=dev),
           torch.empty(b, d, dtype=torch.int64, device=dev), torch.empty(b, dtype=torch.int64, device=dev),
           torch.empty(b, dtype=torch.int64, device=dev))  # fmt: skip

    def triton_fn():
        return tree_verify_triton(t.cu_num_rows, t.node_tokens, t.first_child, t.next_sibling, case.p, q, case.modes,
                                  case.coins.uniform, case.coins.exponential, max_depth=d, out=out,
                                  workspace=case.workspace if sampled else None)  # fmt: skip

    def torch_fn():
        return verify_batch(case.batch, case.p, q, mode, case.coins)

    greedy = mode == "greedy"

    def served(verify):
        coins = None if greedy else VerifyCoins.draw(
            b, d, case.batch.max_children, case.p.shape[1], device=dev, lazy=True,
            needs_uniform=[Mode.parse(mode).needs_draft_probs] * b, track_streams=True)
        return verify(case.batch, None if greedy else case.p, q, mode, coins, target_argmax=case.p.argmax(-1),
                      sync_free=True)

    return {"verify_triton": triton_fn, "verify_torch": torch_fn, "verify_served": lambda: served(verify_batch),
            "verify_served_triton": lambda: served(verify_batch_triton)}


def verify_bytes(case: VerifyCase, mode: str, num_accepted: torch.Tensor) -> int:
    visited = int(num_accepted.sum()) + case.batch.batch_size
    per_entry = case.p.element_size()
    if mode != "greedy":
        per_entry += case.coins.exponential.element_size()
    if mode.startswith("sampled"):
        per_entry += case.q.element_size()
    return visited * case.p.shape[1] * per_entry


# ---------------------------------------------------------------------------
# Commit inputs


@dataclass
class CommitCase:
    caches: list
    row_slots: torch.Tensor  # [R]
    cu_num_rows: torch.Tensor  # [B + 1]
    accepted_nodes: torch.Tensor  # [B, D]
    num_accepted: torch.Tensor  # [B]
    layer_table: torch.Tensor  # [L]
    pairs: int


def make_commit_case(batch_size: int, nodes: int, kv: KVShape, device: torch.device, seed: int) -> CommitCase:
    from vllm_tree_spec.tree import Tree, TreeBatch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tree = Tree(torch.tensor(binary_tree_parents(nodes), dtype=torch.long))
    batch = TreeBatch.from_trees([tree] * batch_size)
    page = kv.page_size
    per_req_blocks = -(-(kv.context + nodes + 1) // page)
    num_blocks = batch_size * per_req_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen)
    slots = []
    for b in range(batch_size):
        table = perm[b * per_req_blocks : (b + 1) * per_req_blocks]
        pos = torch.arange(kv.context, kv.context + nodes + 1)
        slots.append(table[pos // page] * page + pos % page)
    path = tree.path_to(nodes - 1) if nodes else []  # the deepest leaf: the most copies
    d = max(1, tree.max_depth)
    acc = torch.full((batch_size, d), -1, dtype=torch.long)
    if path:
        acc[:, : len(path)] = torch.tensor(path)
    num = torch.full((batch_size,), len(path), dtype=torch.long)
    caches = [torch.randn(2, num_blocks, page, kv.num_kv_heads, kv.head_dim, device=device).to(kv.dtype)
              for _ in range(kv.layers)]  # fmt: skip
    pairs = sum(1 for k, n in enumerate(path, start=1) if n + 1 != k) * batch_size
    return CommitCase(
        caches=caches,
        row_slots=torch.cat(slots).to(device),
        cu_num_rows=batch.cu_num_rows.to(device),
        accepted_nodes=acc.to(device),
        num_accepted=num.to(device),
        layer_table=torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device),
        pairs=pairs,
    )


def commit_providers(case: CommitCase) -> dict[str, Callable[[], object]]:
    from vllm_tree_spec.kernels.kv_commit_launch import kv_commit_torch, kv_commit_triton

    args = (case.row_slots, case.cu_num_rows, case.accepted_nodes, case.num_accepted)
    return {
        "commit_triton": lambda: kv_commit_triton(case.caches, *args, layer_table=case.layer_table),
        "commit_torch": lambda: kv_commit_torch(case.caches, *args),
    }


def commit_bytes(case: CommitCase, kv: KVShape) -> int:
    row = kv.num_kv_heads * kv.head_dim * torch.empty(0, dtype=kv.dtype).element_size()
    return case.pairs * kv.layers * 2 * row * 2


# ---------------------------------------------------------------------------
# Correctness gate (run before timing, recorded in the JSON)


def correctness(device: torch.device, quick: bool) -> list[dict]:
    """Kernels vs PyTorch twins: verification on a mixed batch (all modes, EOS / max_tokens), commit vs reference."""
    import random

    from vllm_tree_spec.kernels.kv_commit_launch import kv_commit_reference, kv_commit_triton
    from vllm_tree_spec.kernels.tree_verify_launch import verify_batch_triton
    from vllm_tree_spec.tree import Tree, TreeBatch
    from vllm_tree_spec.verify import VerifyCoins, verify_batch

    rng = random.Random(0)
    rows_out = []
    vocab = 257 if quick else 32000
    modes = ["greedy", "deterministic", "sampled", "sampled_without_replacement"] * 2
    trees = []
    for i in range(len(modes)):
        n = rng.randint(0, 12)
        shape = Tree(torch.tensor([rng.randrange(-1, j) if j else -1 for j in range(n)], dtype=torch.long))
        toks = [0] * n
        for ch in shape.children:
            for c, x in zip(ch, rng.sample(range(vocab), len(ch))):
                toks[c] = x
        trees.append(shape.with_tokens(torch.tensor(toks, dtype=torch.long)))
    batch = TreeBatch.from_trees(trees)
    rows = int(batch.cu_num_rows[-1])
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator(device="cpu").manual_seed(1)
        logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
        for b, t in enumerate(trees):  # favour a child at some rows so walks go deep
            for r, ch in enumerate(t.children):
                if ch and rng.random() < 0.6:
                    logits[int(batch.cu_num_rows[b]) + r, int(t.tokens[ch[0]])] += 6
        p = torch.softmax(logits, -1).to(dtype).to(device)
        q = torch.softmax(logits + torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1).to(dtype).to(device)
        coins = VerifyCoins.draw(len(trees), batch.max_depth, batch.max_children, vocab, dtype=dtype, device=device)
        eos = torch.tensor([-1, -1, 5, -1, -1, -1, -1, -1], device=device)
        mt = torch.tensor([100, 2, 100, 1, 100, 100, 3, 100], device=device)
        fields = ("output_token_ids", "num_accepted", "accepted_nodes", "next_token", "walked")
        out = verify_batch_triton(batch, p, q, modes, coins, eos_token_id=eos, max_tokens=mt)
        ref = verify_batch(batch, p, q, modes, coins, eos_token_id=eos, max_tokens=mt)
        rows_out.append({"check": "verify vs verify_batch", "dtype": str(dtype).replace("torch.", ""),
                         "vocab": vocab, "requests": len(trees), "gate": True,
                         "identical": all(torch.equal(getattr(out, f), getattr(ref, f)) for f in fields),
                         "num_accepted": out.num_accepted.tolist()})  # fmt: skip
        served = []  # the served form: lazy coins (default RNG reseeded for each), argmax for greedy, sync-free
        for verify in (verify_batch_triton, verify_batch):
            torch.manual_seed(2)
            lazy = VerifyCoins.draw(len(trees), batch.max_depth, batch.max_children, vocab, dtype=dtype,
                                    device=device, lazy=True, track_streams=True)
            served.append(verify(batch, p, q, modes, lazy, eos_token_id=eos, max_tokens=mt,
                                 target_argmax=p.argmax(-1), sync_free=True))
        rows_out.append({"check": "served verify_batch_triton vs verify_batch",
                         "dtype": str(dtype).replace("torch.", ""),
                         "vocab": vocab, "requests": len(trees), "gate": True,
                         "identical": all(torch.equal(getattr(served[0], f), getattr(served[1], f)) for f in fields),
                         "num_accepted": served[0].num_accepted.tolist()})  # fmt: skip
    kv = QUICK_KV if quick else KVShape(4, 8, 128, 16, torch.bfloat16, 100)
    case = make_commit_case(3, 15, kv, device, seed=7)
    ref = [c.clone() for c in case.caches]
    args = (case.row_slots, case.cu_num_rows, case.accepted_nodes, case.num_accepted)
    kv_commit_reference(ref, *args)
    kv_commit_triton(case.caches, *args)
    ok = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(case.caches, ref))
    rows_out.append({"check": "commit vs kv_commit_reference", "dtype": "bfloat16", "pairs": case.pairs,
                     "identical": ok, "gate": True})  # fmt: skip
    for r in rows_out:
        r["ok"] = bool(r["identical"] or not r["gate"])  # informational rows never fail the gate
    return rows_out


def ptx_audit() -> dict:
    """Instruction audit of the compiled verification kernels (GPU): no approximate or flush-to-zero division."""
    from vllm_tree_spec.kernels.tree_verify import tree_verify_kernel

    try:
        ptxs = [k.asm["ptx"] for caches in tree_verify_kernel.device_caches.values() for k in caches[0].values()]
    except Exception as e:  # Triton-version dependent internals; the audit is informational
        return {"available": False, "reason": f"{type(e).__name__}: {e}"[:160]}
    return {"available": bool(ptxs), "kernels": len(ptxs),
            "div.full": sum(p.count("div.full") + p.count("div.approx") for p in ptxs),
            "ftz": sum(p.count(".ftz") for p in ptxs),
            "div.rn": sum(p.count("div.rn") for p in ptxs)}  # fmt: skip


# ---------------------------------------------------------------------------
# Driver


def run(quick: bool = False, out_dir: str | Path | None = None, time_budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Run the benchmark; write bench_verify_commit.{json,md} into out_dir; return the JSON dict."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not quick:
            raise RuntimeError("the full verify/commit benchmark needs a CUDA GPU; use quick=True for a CPU smoke run")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("CPU smoke run needs TRITON_INTERPRET=1 set before Triton is imported")
    import triton

    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    budget = min(float(time_budget_s), DEFAULT_BUDGET_S)
    t_start = time.perf_counter()
    grid = QUICK_GRID if quick else FULL_GRID
    kv = QUICK_KV if quick else FULL_KV
    timer = Timer(device, quick)
    meta = {
        "mode": "quick" if quick else "full",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tree": "complete binary tree; child tokens = top-2 of q at the parent row",
        "probs": "float32 p = softmax(3 * randn), q = softmax(logits + randn)",
        "kv": kv.describe(),
        "timer_modes": timer.modes,
        "time_budget_s": budget,
    }
    if device.type == "cpu":
        meta["warning"] = "CPU + Triton interpreter: smoke test of the script only, not performance numbers"
    meta["copy_gbps"] = copy_bandwidth_gbps(device, timer, quick)
    checks = correctness(device, quick)
    results, skipped = [], []

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget

    # Commit first: it is quick, and the verification grid is the part the time budget may cut.
    for batch in grid["batch"]:
        for nodes in grid["nodes"]:
            key = {"kind": "commit", "batch": batch, "nodes": nodes}
            if over_budget():
                skipped.append(key)
                continue
            case = make_commit_case(batch, nodes, kv, device, seed=batch * 13 + nodes)
            nbytes = commit_bytes(case, kv)
            for name, fn in commit_providers(case).items():
                for tmode in timer.modes:
                    row = {**key, "provider": name, "timer": tmode, "pairs": case.pairs, "layers": kv.layers}
                    try:
                        ms = timer(fn, tmode)
                    except Exception as e:
                        row.update(ms=None, note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    else:
                        row.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
                    results.append(row)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for vocab in grid["vocab"]:
        for batch in grid["batch"]:
            for nodes in grid["nodes"]:
                for mode in grid["modes"]:
                    key = {"kind": "verify", "batch": batch, "nodes": nodes, "vocab": vocab, "mode": mode}
                    if over_budget():
                        skipped.append(key)
                        continue
                    case = make_verify_case(batch, nodes, vocab, mode, device, seed=batch * 7919 + nodes * 31 + vocab)
                    provs = verify_providers(case, mode)
                    res = provs["verify_triton"]()
                    nbytes = verify_bytes(case, mode, res[1])
                    depth = float(res[1].float().mean())
                    for name, fn in provs.items():
                        for tmode in timer.modes:
                            row = {**key, "provider": name, "timer": tmode, "mean_accepted": depth}
                            if tmode == "cudagraph" and name in NOT_CAPTURABLE:
                                row.update(ms=None, note=NOT_CAPTURABLE[name])
                            else:
                                try:
                                    ms = timer(fn, tmode)
                                except Exception as e:  # record and go on (e.g. OOM)
                                    row.update(ms=None, note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                                else:
                                    row.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
                            results.append(row)
                    del case, provs, res
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if device.type == "cuda":
        meta["ptx_audit"] = ptx_audit()  # expect div.full == 0 and ftz == 0 (bit-exact fp32 division)
    meta["elapsed_s"] = time.perf_counter() - t_start
    report = {"meta": meta, "correctness": checks, "results": results, "skipped_over_budget": skipped}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_verify_commit.json").write_text(json.dumps(report, indent=1))
        (out / "bench_verify_commit.md").write_text(markdown(report))
    return report


def _cell(r: dict | None) -> str:
    return f"{r['ms']:.4f}" if r and r.get("ms") else "-"


def _ratio(num: dict | None, den: dict | None) -> str:
    return f"{num['ms'] / den['ms']:.1f}x" if num and den and num.get("ms") and den.get("ms") else "-"


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Tree verification and KV commit benchmark",
        "",
        f"- device: {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, "
        f"interpreter: {meta['interpreter']})",
        f"- verification: {meta['tree']}; {meta['probs']}",
        f"- commit: {meta['kv']}; deepest root-to-leaf path accepted",
        f"- measured copy bandwidth: {meta['copy_gbps']:.1f} GB/s; elapsed {meta['elapsed_s']:.1f} s "
        f"(budget {meta['time_budget_s']:.0f} s)",
    ]
    if "warning" in meta:
        lines += ["", f"**{meta['warning']}**"]
    if "ptx_audit" in meta:
        lines += [f"- PTX audit of the verification kernels (want div.full = ftz = 0): {meta['ptx_audit']}"]
    gate = [c for c in report["correctness"] if c["gate"]]
    info = [c for c in report["correctness"] if not c["gate"]]
    lines += ["", f"Correctness gate (kernels bit-exact vs PyTorch twins): "
              f"{'PASS' if all(c['ok'] for c in gate) else 'FAIL'}"]  # fmt: skip
    for c in info:
        lines.append(f"- informational: {c['check']} ({c['dtype']}): "
                     f"{'identical' if c['identical'] else 'differs at a rounding boundary'}")  # fmt: skip
    res = report["results"]
    for tmode in meta["timer_modes"]:
        lines += ["", f"## Verification, {tmode} (ms; GB/s over visited rows' p [+E] [+q])", ""]
        lines.append("| V | B | nodes | mode | mean acc | triton ms | torch ms | speed-up | served ms "
                     "| served / triton | served triton ms | served / served triton | triton GB/s | % copy |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        keys = dict.fromkeys((r["vocab"], r["batch"], r["nodes"], r["mode"]) for r in res if r["kind"] == "verify")
        for k in keys:
            rows = {r["provider"]: r for r in res if r["kind"] == "verify" and r["timer"] == tmode
                    and (r["vocab"], r["batch"], r["nodes"], r["mode"]) == k}  # fmt: skip
            tr, pt, sv = rows.get("verify_triton"), rows.get("verify_torch"), rows.get("verify_served")
            st = rows.get("verify_served_triton")
            speed, served, served_k = _ratio(pt, tr), _ratio(sv, tr), _ratio(sv, st)
            gb = f"{tr['gbps']:.0f}" if tr and tr.get("ms") else "-"
            frac = f"{100 * tr['gbps'] / meta['copy_gbps']:.0f}%" if tr and tr.get("ms") else "-"
            acc = f"{tr['mean_accepted']:.1f}" if tr else "-"
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {acc} | {_cell(tr)} | {_cell(pt)} | {speed} "
                         f"| {_cell(sv)} | {served} | {_cell(st)} | {served_k} | {gb} | {frac} |")  # fmt: skip
        lines += ["", f"## Commit, {tmode} (ms; GB/s = pairs x layers x (K+V) x row, read + write)", ""]
        lines.append("| B | nodes | pairs | layers | triton ms | torch ms | speed-up | triton GB/s | torch GB/s |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        keys = dict.fromkeys((r["batch"], r["nodes"]) for r in res if r["kind"] == "commit")
        for k in keys:
            rows = {r["provider"]: r for r in res if r["kind"] == "commit" and r["timer"] == tmode
                    and (r["batch"], r["nodes"]) == k}  # fmt: skip
            tr, pt = rows.get("commit_triton"), rows.get("commit_torch")
            if not tr:
                continue
            speed = f"{pt['ms'] / tr['ms']:.1f}x" if pt and pt.get("ms") and tr.get("ms") else "-"
            gbt = f"{tr['gbps']:.0f}" if tr.get("ms") else "-"
            gbp = f"{pt['gbps']:.0f}" if pt and pt.get("ms") else "-"
            lines.append(f"| {k[0]} | {k[1]} | {tr['pairs']} | {tr['layers']} | {_cell(tr)} | {_cell(pt)} | {speed} "
                         f"| {gbt} | {gbp} |")  # fmt: skip
    notes = dict.fromkeys(f"{r['provider']} ({r['timer']}): {r['note']}" for r in res if r.get("note"))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    if report["skipped_over_budget"]:
        lines += ["", f"Skipped (time budget): {report['skipped_over_budget']}"]
    return "\n".join(lines) + "\n"
