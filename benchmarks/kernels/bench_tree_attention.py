"""Benchmark: tree attention (Triton) vs PyTorch's flash attention on the same token counts.

Each configuration is B requests, each with a context of `context` committed
tokens, a root and a tree of `nodes` draft nodes (a complete binary tree; the
mask pattern barely matters for speed). Providers:

  tree_triton     our kernel over vLLM's paged cache (page 16), heuristic KV split
  sdpa_flash      F.scaled_dot_product_attention, flash backend, lower-right causal,
                  dense [B, H, L, D] K/V (pre-gathered, gather not timed)
  flash_varlen    PyTorch varlen flash attention (public `varlen_attn`, or
                  aten::_flash_attention_forward when the public one lacks GQA),
                  packed contiguous K/V, causal; same query/key token counts
  flash_varlen_paged  the same reading a paged cache through a block table, if
                  the installed PyTorch supports it
  tree_decode_xN  our kernel with one query row per request (plain decode),
                  time of one call x (nodes + 1): verifying the tree token by token
  flash_decode_xN flash varlen with one query row, x (nodes + 1)

The causal baselines compute a chain mask, not the tree mask: they are the
speed of light for the same amount of attention work, not a drop-in
replacement. Times: `triton.testing.do_bench` (L2 flushed between runs) and
`do_bench_cudagraph` (launch overhead removed). Effective bandwidth =
unique bytes (K/V of every cached token once + Q + O) / time, compared with a
measured device-to-device copy. On a machine without a GPU only `quick=True`
works: Triton's interpreter on tiny sizes, a wall-clock timer, numbers that
say nothing about GPU speed (a smoke test of this script).
"""

from __future__ import annotations

import inspect
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# ---------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class ModelShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"H_q={self.num_heads}, H_kv={self.num_kv_heads}, D={self.head_dim}, page={self.page_size}, "
            f"{str(self.dtype).replace('torch.', '')}"
        )


FULL_SHAPE = ModelShape(32, 8, 128, 16, torch.bfloat16)  # Llama-3-8B attention
QUICK_SHAPE = ModelShape(4, 2, 32, 16, torch.float32)
# nodes 4 / 15 / 63 = 5 / 16 / 64 query rows per request (root included)
FULL_GRID = {"batch": [1, 8, 32, 64], "nodes": [4, 15, 63], "context": [1024, 8192]}
QUICK_GRID = {"batch": [1, 2], "nodes": [4], "context": [40]}


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

        # Budgets sized so the full grid fits in ~5 min on an H200: do_bench runs
        # ~rep ms (L2 flushed between calls); do_bench_cudagraph captures ~rep ms
        # of calls and replays the graph 10 times.
        if mode == "do_bench":
            return float(tt.do_bench(fn, warmup=10 if self.quick else 15, rep=20 if self.quick else 60))
        if mode == "cudagraph":
            return float(tt.do_bench_cudagraph(fn, rep=10 if self.quick else 40))
        raise ValueError(mode)


def copy_bandwidth_gbps(device: torch.device, timer: Timer, quick: bool) -> float:
    n = (1 << 30 if device.type == "cuda" and not quick else 1 << 24) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), timer.modes[0])
    del src, dst
    return 2 * n * 4 / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------
# Inputs


@dataclass
class Inputs:
    q: torch.Tensor  # [T_q, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, page, H_kv, D]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    cu_num_nodes: torch.Tensor  # [B + 1] int32
    packed_mask: torch.Tensor  # [T_nodes, W] int32
    depth: torch.Tensor  # [T_nodes] int32
    q_len: int
    seq_len: int

    @property
    def args(self) -> tuple:
        return (
            self.q, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
            self.query_start_loc, self.cu_num_nodes, self.packed_mask, self.depth,
        )  # fmt: skip


def make_inputs(shape: ModelShape, batch: int, nodes: int, context: int, device: torch.device) -> Inputs:
    from vllm_tree_spec.tree import Tree, TreeBatch
    from vllm_tree_spec.tree_attention import tree_batch_kernel_inputs

    gen = torch.Generator(device=device).manual_seed(batch * 1000 + nodes + context)
    tree = Tree(torch.tensor(binary_tree_parents(nodes), dtype=torch.long))
    tin = tree_batch_kernel_inputs(TreeBatch.from_trees([tree] * batch), device)
    q_len, seq_len = nodes + 1, context + nodes + 1
    blocks = -(-seq_len // shape.page_size)
    pool = batch * blocks
    perm = torch.randperm(pool, device=device, generator=gen).to(torch.int32)
    kc = torch.randn(pool, shape.page_size, shape.num_kv_heads, shape.head_dim, device=device,
                     dtype=shape.dtype, generator=gen)  # fmt: skip
    vc = torch.randn_like(kc)
    return Inputs(
        q=torch.randn(batch * q_len, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype, generator=gen),
        key_cache=kc,
        value_cache=vc,
        block_table=perm.view(batch, blocks).contiguous(),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len,
        q_len=q_len,
        seq_len=seq_len,
        **tin,
    )


def gather_dense(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's cached K/V as contiguous [B, L, H_kv, D] (what a non-paged kernel reads)."""
    b, page = inp.block_table.shape[0], inp.key_cache.shape[1]
    slots = torch.arange(inp.seq_len, device=inp.q.device)
    blk = inp.block_table.long()[:, slots // page]  # [B, L]
    return inp.key_cache[blk, slots % page].contiguous(), inp.value_cache[blk, slots % page].contiguous()


# ---------------------------------------------------------------------------
# Providers: each returns (callable, note) or raises with a reason


def provider_tree(inp: Inputs, shape: ModelShape):
    from vllm_tree_spec.tree_attention import load_triton_launcher

    launch = load_triton_launcher()
    out = torch.empty_like(inp.q)
    kw = dict(out=out, max_query_len=inp.q_len, max_seq_len=inp.seq_len)
    return (lambda: launch(*inp.args, **kw)), ""


def provider_tree_decode(inp: Inputs, shape: ModelShape):
    from vllm_tree_spec.tree_attention import load_triton_launcher

    launch = load_triton_launcher()
    b = inp.block_table.shape[0]
    dev = inp.q.device
    q = inp.q[: b].clone()
    seq_lens = inp.seq_lens - (inp.q_len - 1)  # the root is the newest token
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    cun = torch.zeros(b + 1, device=dev, dtype=torch.int32)
    pm = torch.zeros(0, 1, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    args = (q, inp.key_cache, inp.value_cache, inp.block_table, seq_lens, qsl, cun, pm, None)
    kw = dict(out=out, max_query_len=1, max_seq_len=inp.seq_len - inp.q_len + 1)
    return (lambda: launch(*args, **kw)), f"one q_len=1 call x {inp.q_len}"


def provider_sdpa(inp: Inputs, shape: ModelShape):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    b = inp.block_table.shape[0]
    k, v = gather_dense(inp)
    q4 = inp.q.view(b, inp.q_len, shape.num_heads, shape.head_dim).transpose(1, 2)  # [B, H_q, q_len, D]
    k4, v4 = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, L, D] (strided views, last dim contiguous)
    bias = causal_lower_right(inp.q_len, inp.seq_len)
    backends = [SDPBackend.FLASH_ATTENTION] if inp.q.is_cuda else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def native():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, enable_gqa=True)

    try:
        native()
        return native, "GQA native"
    except Exception as e:  # flash path may refuse GQA with a causal bias: expand K/V (reads G x more)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    g = shape.num_heads // shape.num_kv_heads
    ke, ve = k4.repeat_interleave(g, 1).contiguous(), v4.repeat_interleave(g, 1).contiguous()

    def expanded():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q4, ke, ve, attn_mask=bias)

    expanded()
    return expanded, f"K/V expanded to H_q heads (GQA refused: {reason})"


def _varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, gqa: bool, paged: dict | None):
    """Pick the PyTorch flash varlen entry point this version offers."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
    except Exception:
        varlen_attn, params = None, {}
    kw: dict = {}
    public_ok = varlen_attn is not None and (not gqa or "enable_gqa" in params)
    if paged is not None:
        public_ok = public_ok and "block_table" in params
    if public_ok:
        if "window_size" in params:
            kw["window_size"] = (-1, 0)
        elif "is_causal" in params:
            kw["is_causal"] = True
        if gqa:
            kw["enable_gqa"] = True
        if paged is not None:
            kw.update(paged)
        return (lambda: varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)), "torch.nn.attention.varlen.varlen_attn"
    op = torch.ops.aten._flash_attention_forward
    schema = str(op.default._schema)
    if paged is not None:
        if "block_table" not in schema:
            raise NotImplementedError("this PyTorch has no paged (block_table) flash varlen")
        kw.update(paged)
    return (lambda: op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kw)[0]), (
        "aten::_flash_attention_forward (GQA native)"
    )


def provider_varlen(inp: Inputs, shape: ModelShape):
    if not inp.q.is_cuda:
        raise NotImplementedError("flash varlen needs CUDA")
    b = inp.block_table.shape[0]
    k, v = gather_dense(inp)
    k, v = k.flatten(0, 1), v.flatten(0, 1)  # [B * L, H_kv, D]
    cu_k = torch.arange(b + 1, device=inp.q.device, dtype=torch.int32) * inp.seq_len
    fn, note = _varlen_call(inp.q, k, v, inp.query_start_loc, cu_k, inp.q_len, inp.seq_len,
                            shape.num_heads != shape.num_kv_heads, None)  # fmt: skip
    fn()
    return fn, note


def provider_varlen_paged(inp: Inputs, shape: ModelShape):
    if not inp.q.is_cuda:
        raise NotImplementedError("flash varlen needs CUDA")
    b = inp.block_table.shape[0]
    cu_k = torch.arange(b + 1, device=inp.q.device, dtype=torch.int32) * inp.seq_len
    paged = {"block_table": inp.block_table, "seqused_k": inp.seq_lens}
    fn, note = _varlen_call(inp.q, inp.key_cache, inp.value_cache, inp.query_start_loc, cu_k, inp.q_len,
                            inp.seq_len, shape.num_heads != shape.num_kv_heads, paged)  # fmt: skip
    fn()
    return fn, f"{note}, page {shape.page_size}"


def provider_flash_decode(inp: Inputs, shape: ModelShape):
    if not inp.q.is_cuda:
        raise NotImplementedError("flash varlen needs CUDA")
    b = inp.block_table.shape[0]
    ctx = inp.seq_len - inp.q_len + 1
    k, v = gather_dense(inp)
    k, v = k[:, :ctx].flatten(0, 1).contiguous(), v[:, :ctx].flatten(0, 1).contiguous()
    dev = inp.q.device
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
    cu_k = cu_q * ctx
    q = inp.q[:b].clone()
    fn, note = _varlen_call(q, k, v, cu_q, cu_k, 1, ctx, shape.num_heads != shape.num_kv_heads, None)
    fn()
    return fn, f"{note}; one q_len=1 call x {inp.q_len}"


PROVIDERS = {
    "tree_triton": provider_tree,
    "sdpa_flash": provider_sdpa,
    "flash_varlen": provider_varlen,
    "flash_varlen_paged": provider_varlen_paged,
    "tree_decode_xN": provider_tree_decode,
    "flash_decode_xN": provider_flash_decode,
}
REPEATED = {"tree_decode_xN", "flash_decode_xN"}  # timed once, multiplied by (nodes + 1)


# ---------------------------------------------------------------------------
# Correctness gate (run before timing, recorded in the JSON)


def correctness(shape: ModelShape, device: torch.device, quick: bool) -> list[dict]:
    """Kernel vs the PyTorch reference on a mixed batch, with every feature and several KV splits."""
    from vllm_tree_spec.tree import Tree, TreeBatch
    from vllm_tree_spec.tree_attention import load_triton_launcher, tree_attention_reference, tree_batch_kernel_inputs

    launch = load_triton_launcher()
    gen = torch.Generator(device="cpu").manual_seed(0)
    trees = [Tree(torch.tensor(binary_tree_parents(13))), Tree.chain(5), Tree.chain(0), Tree(torch.full((40,), -1))]
    contexts = [9, 70, 33, 5] if quick else [1000, 77, 3001, 530]
    page = shape.page_size
    seq_lens = [c + 1 + t.num_nodes for c, t in zip(contexts, trees)]
    blocks = [-(-s // page) for s in seq_lens]
    perm = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    bt = torch.zeros(len(trees), max(blocks), dtype=torch.int32)
    off = 0
    for i, nb in enumerate(blocks):
        bt[i, :nb] = perm[off : off + nb]
        off += nb
    kc = torch.randn(sum(blocks), page, shape.num_kv_heads, shape.head_dim, generator=gen)
    vc = torch.randn_like(kc)
    q_lens = [t.num_nodes + 1 for t in trees]
    q = torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, generator=gen)
    tin = tree_batch_kernel_inputs(TreeBatch.from_trees(trees), device)
    args = (
        q.to(device, shape.dtype), kc.to(device, shape.dtype), vc.to(device, shape.dtype), bt.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32),
        tin["cu_num_nodes"], tin["packed_mask"], tin["depth"],
    )  # fmt: skip
    sinks = torch.randn(shape.num_heads, generator=gen).to(device)
    atol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[shape.dtype]
    rows = []
    for feats in ({}, {"sliding_window": 64, "softcap": 30.0, "sinks": sinks}):
        ref = tree_attention_reference(*args, **feats)
        for splits in (1, None, 7):
            out = launch(*args, num_splits=splits, **feats)
            err = (out.float() - ref.float()).abs().max().item()
            rows.append({"features": sorted(feats) or ["plain"], "num_splits": splits or "auto",
                         "max_abs_err": err, "atol": atol, "ok": bool(err <= atol)})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------
# Driver


def _bytes(inp: Inputs, shape: ModelShape) -> int:
    b = inp.block_table.shape[0]
    elt = torch.finfo(shape.dtype).bits // 8
    kv = 2 * b * inp.seq_len * shape.num_kv_heads * shape.head_dim * elt
    qo = 2 * inp.q.numel() * elt
    return kv + qo


def _flops(inp: Inputs, shape: ModelShape) -> float:
    """Dense (unmasked) count 4 * q_len * seq_len * H_q * D per request."""
    b = inp.block_table.shape[0]
    return 4.0 * b * inp.q_len * inp.seq_len * shape.num_heads * shape.head_dim


def run(quick: bool = False, out_dir: str | Path | None = None, time_budget_s: float = 270.0) -> dict:
    """Run the benchmark; write bench_tree_attention.{json,md} into out_dir; return the JSON dict."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not quick:
            raise RuntimeError("the full tree-attention benchmark needs a CUDA GPU; use quick=True for a CPU smoke run")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("CPU smoke run needs TRITON_INTERPRET=1 set before Triton is imported")
    import triton

    t_start = time.perf_counter()
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    grid = QUICK_GRID if quick else FULL_GRID
    timer = Timer(device, quick)
    meta = {
        "mode": "quick" if quick else "full",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": shape.describe(),
        "tree": "complete binary tree under the root",
        "timer_modes": timer.modes,
        "bytes_model": "K/V of every cached token once + Q + O",
    }
    if device.type == "cpu":
        meta["warning"] = "CPU + Triton interpreter: smoke test of the script only, not performance numbers"
    meta["copy_gbps"] = copy_bandwidth_gbps(device, timer, quick)
    checks = correctness(shape, device, quick)
    results = []
    skipped = []
    for batch in grid["batch"]:
        for nodes in grid["nodes"]:
            for context in grid["context"]:
                if time.perf_counter() - t_start > time_budget_s:
                    skipped.append({"batch": batch, "nodes": nodes, "context": context})
                    continue
                inp = make_inputs(shape, batch, nodes, context, device)
                nbytes, flops = _bytes(inp, shape), _flops(inp, shape)
                for name, make in PROVIDERS.items():
                    base = {"batch": batch, "nodes": nodes, "context": context, "provider": name}
                    try:
                        fn, note = make(inp, shape)
                    except Exception as e:
                        results.append({**base, "mode": None, "ms": None,
                                        "note": f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"})  # fmt: skip
                        continue
                    for mode in timer.modes:
                        row = {**base, "mode": mode, "note": note}
                        try:
                            ms = timer(fn, mode) * (nodes + 1 if name in REPEATED else 1)
                        except Exception as e:
                            row.update(ms=None, note=f"{note}; {mode} failed: {type(e).__name__}: {str(e)[:160]}")
                        else:
                            row.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9, tflops=flops / (ms * 1e-3) / 1e12)
                            row["frac_copy_bw"] = row["gbps"] / meta["copy_gbps"]
                        results.append(row)
                    del fn
                del inp
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    meta["elapsed_s"] = time.perf_counter() - t_start
    report = {"meta": meta, "correctness": checks, "results": results, "skipped_over_budget": skipped}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_tree_attention.json").write_text(json.dumps(report, indent=1))
        (out / "bench_tree_attention.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Tree attention benchmark",
        "",
        f"- device: {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, interpreter: {meta['interpreter']})",
        f"- shape: {meta['shape']}; tree: {meta['tree']}",
        f"- measured copy bandwidth: {meta['copy_gbps']:.1f} GB/s; effective GB/s = {meta['bytes_model']} / time",
        f"- elapsed: {meta['elapsed_s']:.1f} s",
    ]
    if "warning" in meta:
        lines += ["", f"**{meta['warning']}**"]
    ok = all(c["ok"] for c in report["correctness"])
    worst = max((c["max_abs_err"] for c in report["correctness"]), default=float("nan"))
    lines += ["", f"Correctness gate (kernel vs PyTorch reference): {'PASS' if ok else 'FAIL'}, max abs err {worst:.2e}"]
    providers = list(PROVIDERS)
    for mode in dict.fromkeys(r["mode"] for r in report["results"] if r["mode"]):
        lines += ["", f"## {mode} (ms; tree GB/s and % of copy bandwidth)", ""]
        lines.append("| B | nodes | ctx | " + " | ".join(providers) + " | tree GB/s | % copy | best baseline / tree |")
        lines.append("|" + "---|" * (len(providers) + 6))
        keys = dict.fromkeys((r["batch"], r["nodes"], r["context"]) for r in report["results"])
        for key in keys:
            rows = {r["provider"]: r for r in report["results"]
                    if (r["batch"], r["nodes"], r["context"]) == key and r["mode"] == mode}  # fmt: skip
            cells = [f"{rows[p]['ms']:.4f}" if p in rows and rows[p].get("ms") else "-" for p in providers]
            tree = rows.get("tree_triton", {})
            base = [rows[p]["ms"] for p in ("sdpa_flash", "flash_varlen", "flash_varlen_paged") if rows.get(p, {}).get("ms")]
            ratio = f"{min(base) / tree['ms']:.2f}" if base and tree.get("ms") else "-"
            gb = f"{tree['gbps']:.0f}" if tree.get("ms") else "-"
            frac = f"{100 * tree['frac_copy_bw']:.0f}%" if tree.get("ms") else "-"
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {gb} | {frac} | {ratio} |")
    notes = dict.fromkeys(f"{r['provider']}: {r['note']}" for r in report["results"] if r.get("note"))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    if report["skipped_over_budget"]:
        lines += ["", f"Skipped (time budget): {report['skipped_over_budget']}"]
    return "\n".join(lines) + "\n"
