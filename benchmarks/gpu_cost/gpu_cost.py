"""Cost side of tree speculation on one GPU, without vLLM: draft, verify, commit time vs nodes and batch.

    python benchmarks/gpu_cost/gpu_cost.py                          # one H200: < 8 min -> runs/gpu_cost/
    python benchmarks/gpu_cost/gpu_cost.py --quick                  # CPU smoke (Triton interpreter, tiny sizes)
    python benchmarks/gpu_cost/gpu_cost.py --acceptance mine=a.json # extra acceptance profile(s) for the planner

vLLM cannot be installed on the GPU machine and there is no model hub, so every model is built there
with random weights at real widths, and a step is assembled from this repository's pieces:

    verify(B, t)   target forward over B requests x t rows (root + t - 1 tree nodes) on a paged KV cache of
                   C context tokens per request: fused QKV, RoPE at root + depth, KV write, the Triton tree
                   attention kernel (`kernels/`), O projection, SwiGLU MLP, LM head over every row, fp32
                   softmax, then the Triton verification kernel (lossless rule, one launch). t = 1 is the
                   no-speculation step (forward + one draw per request).
    draft(B, w)    one draft level: w rows per request through a drafter, top-k over the vocabulary.
                   Drafters: `eagle_head` (EAGLE-style: fc(2h -> h) + one decoder layer at target width +
                   the target's LM head) and `draft_1b` (a Llama-3.2-1B-shaped LM). Model-free drafters
                   (suffix, n-gram) draft on the host: their cost comes from --host-draft-ms.
    commit(B, n)   the Triton KV-commit kernel moving the accepted path's rows, every target layer in one
                   launch (deepest path of the tree: the most copies).

Times use CUDA graphs (`triton.testing.do_bench_cudagraph`, falling back to `do_bench`), like vLLM's
decode steps. On CPU (`--quick`) they are wall clock under the Triton interpreter: a smoke test only.

Then it fits the planner's CostModel (`vllm_tree_spec/planner.py`): verify = TableVerify(ms[B][t]),
draft_level_ms + draft_node_ms from draft(B, w) ~ a + b B w, state_ms + state_node_ms from
commit(B, n) ~ s0 + s1 B n; and runs `plan_trees` for synthetic acceptance profiles (per-depth, per-rank
a[d][r]: an assumed EAGLE-like profile, profiles measured in our CPU runs, or --acceptance files). It
writes costs_<drafter>_ctx<C>.json (for `vllm-tree-spec plan --costs`), plan_*.json and budgets_*.json
(ready for the `"budgets"` key), gpu_cost.json and gpu_cost.md.

Last (on by default, `--no-dsv4` skips it, never fatal) it times the DeepSeek-V4 reference model
(`vllm_tree_spec/reference/dsv4*.py`, plain PyTorch, unoptimised) at V4-Flash attention widths for a
three-layer SWA/CSA/HCA stack: tree forward vs nodes and batch, and commit vs replay. Those are reference
numbers (host-built slot lists, no fused kernels), reported separately, never fed to the planner.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


# ---------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0

    @property
    def params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.ffn) + 2 * self.vocab * self.hidden


TARGET = LlamaShape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256)
DRAFT_1B = LlamaShape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256)
EAGLE = LlamaShape("eagle-head", 4096, 1, 32, 8, 128, 14336, 128256)
QUICK_TARGET = LlamaShape("tiny-target", 64, 1, 4, 2, 16, 128, 256)
QUICK_DRAFT = LlamaShape("tiny-draft", 32, 1, 2, 1, 16, 64, 256)
QUICK_EAGLE = LlamaShape("tiny-eagle", 64, 1, 4, 2, 16, 128, 256)

FULL = dict(batches=[1, 4, 16, 64], tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32], contexts=[1024, 4096],
            draft_widths=[1, 2, 4, 8], commit_nodes=[1, 3, 6, 8, 16, 31], page=16)
QUICK = dict(batches=[1, 2], tokens=[1, 3], contexts=[16], draft_widths=[2], commit_nodes=[3], page=16)

# Per-depth, per-rank acceptance a[d][r] (planner.py): P(the rank-r child of an accepted node is accepted).
ASSUMED_PROFILE = {"ranks": [0.6, 0.15, 0.05], "decay": 0.9, "depth": 8,
                   "source": "assumed EAGLE-like profile (docs/planner.md's example), not a measurement"}
# Measured on CPU (docs/benchmarks.md, SmolLM2-135M, suffix drafter, D = 6): conditional acceptance per depth
# P(depth d accepted | depth d - 1 accepted), rank 0 only (the metrics do not split ranks) -> chain-like.
CPU_PROFILES_FILE = HERE / "cpu_profiles.json"


# ---------------------------------------------------------------------------
# Timing


class Timer:
    def __init__(self, device, quick: bool):
        self.device = device
        self.quick = quick
        self.fallbacks: list[str] = []

    def __call__(self, fn: Callable[[], object]) -> tuple[float, str]:
        import torch

        if self.device.type != "cuda":
            fn()
            runs = []
            for _ in range(1 if self.quick else 5):
                t0 = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(runs), "wallclock"
        import triton.testing as tt

        fn()
        torch.cuda.synchronize()
        try:
            return float(tt.do_bench_cudagraph(fn, rep=25)), "cudagraph"
        except Exception as e:  # a launch that cannot be captured: eager timing, recorded
            self.fallbacks.append(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            torch.cuda.synchronize()
            return float(tt.do_bench(fn, warmup=5, rep=25)), "do_bench"


def wall_ms(fn: Callable[[], object], device, reps: int = 3) -> float:
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


# ---------------------------------------------------------------------------
# A random-weight Llama with paged KV and the tree-attention kernel


class RandomLlama:
    """Weights N(0, 1/fan_in) (activations stay O(1) in bf16); KV cache in vLLM's GPU layout per layer."""

    def __init__(self, shape: LlamaShape, device, dtype, seed: int = 0, lm_head=None, embed=None,
                 eagle_fc: bool = False):
        import torch

        self.s, self.device, self.dtype = shape, device, dtype
        g = torch.Generator(device=device).manual_seed(seed)

        def w(out_f, in_f):
            return (torch.randn(out_f, in_f, device=device, dtype=torch.float32, generator=g)
                    / math.sqrt(in_f)).to(dtype)

        h, hd = shape.hidden, shape.head_dim
        self.layers = []
        for _ in range(shape.layers):
            self.layers.append({
                "qkv": w((shape.heads + 2 * shape.kv_heads) * hd, h), "o": w(h, shape.heads * hd),
                "gate_up": w(2 * shape.ffn, h), "down": w(h, shape.ffn),
                "ln1": torch.ones(h, device=device, dtype=dtype), "ln2": torch.ones(h, device=device, dtype=dtype),
            })
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.embed = embed if embed is not None else (
            torch.randn(shape.vocab, h, device=device, dtype=torch.float32, generator=g).to(dtype))
        self.lm_head = lm_head if lm_head is not None else w(shape.vocab, h)
        self.fc = w(h, 2 * h) if eagle_fc else None
        inv = shape.rope_theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        ang = torch.arange(65536, device=device, dtype=torch.float32)[:, None] * inv
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)  # [P, hd/2]
        self.kv: list = []

    def alloc_kv(self, num_blocks: int, page: int) -> None:
        import torch

        s = self.s
        self.kv = [torch.zeros(2, num_blocks, page, s.kv_heads, s.head_dim, device=self.device, dtype=self.dtype)
                   for _ in range(s.layers)]
        for c in self.kv:
            c.normal_()

    @staticmethod
    def _rms(x, w, eps=1e-5):
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def _rope(self, x, positions):
        import torch

        half = x.shape[-1] // 2
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)

    def forward(self, step: "StepInputs", hidden_in=None):
        """Tokens of one step -> logits [T, V] (all rows), like a verify (or draft level) forward."""
        import torch
        import torch.nn.functional as F

        from vllm_tree_spec.tree_attention import load_triton_launcher

        attn = load_triton_launcher()
        s = self.s
        x = self.embed[step.tokens]
        if self.fc is not None:  # EAGLE: fuse the token embedding with the target's hidden state
            x = torch.cat((x, hidden_in if hidden_in is not None else x), -1) @ self.fc.T
        T = x.shape[0]
        hd, nh, nkv = s.head_dim, s.heads, s.kv_heads
        for layer, cache in zip(self.layers, self.kv):
            hN = self._rms(x, layer["ln1"])
            qkv = hN @ layer["qkv"].T
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
            q = self._rope(q.view(T, nh, hd), step.positions)
            k = self._rope(k.view(T, nkv, hd), step.positions)
            kc, vc = cache[0], cache[1]
            kc.view(-1, nkv, hd).index_copy_(0, step.slots, k)
            vc.view(-1, nkv, hd).index_copy_(0, step.slots, v.view(T, nkv, hd))
            o = attn(q.contiguous(), kc, vc, step.block_table, step.seq_lens, step.query_start_loc,
                     step.cu_num_nodes, step.packed_mask, step.depth, out=step.attn_out(nh, hd, x.dtype),
                     max_query_len=step.q_len, max_seq_len=step.max_seq_len)
            x = x + o.view(T, nh * hd) @ layer["o"].T
            hN = self._rms(x, layer["ln2"])
            g, u = (hN @ layer["gate_up"].T).chunk(2, -1)
            x = x + (F.silu(g) * u) @ layer["down"].T
        self.last_hidden = x
        return self._rms(x, self.norm) @ self.lm_head.T


@dataclass
class StepInputs:
    tokens: object
    positions: object
    slots: object
    block_table: object
    seq_lens: object
    query_start_loc: object
    cu_num_nodes: object
    packed_mask: object
    depth: object
    q_len: int
    max_seq_len: int
    _out: object = None

    def attn_out(self, nh, hd, dtype):
        import torch

        if self._out is None or self._out.shape[1:] != (nh, hd):
            self._out = torch.empty(self.tokens.shape[0], nh, hd, device=self.tokens.device, dtype=dtype)
        return self._out


def tree_for_tokens(t: int):
    """The (t - 1)-node tree verified with t rows: Sequoia-optimal for the assumed profile (chain for t <= 2)."""
    import torch

    from vllm_tree_spec.build import optimal_static_trees
    from vllm_tree_spec.planner import depth_decay_table
    from vllm_tree_spec.tree import Tree

    n = t - 1
    if n <= 0:
        return Tree.chain(0, torch.zeros(0, dtype=torch.long))
    a = depth_decay_table(ASSUMED_PROFILE["ranks"], ASSUMED_PROFILE["decay"], ASSUMED_PROFILE["depth"])
    shape = optimal_static_trees(a, n, min(n, ASSUMED_PROFILE["depth"]))[n]
    return shape.with_tokens(torch.arange(1, n + 1, dtype=torch.long))


def make_step(trees, context: int, page: int, blocks_per_req: int, device, vocab: int, seed: int) -> StepInputs:
    """B requests, each with `context` cached tokens and a tree (root + nodes) to run, on a shuffled block pool."""
    import torch

    from vllm_tree_spec.tree import TreeBatch
    from vllm_tree_spec.tree_attention import tree_batch_kernel_inputs

    B = len(trees)
    t = trees[0].num_nodes + 1
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(B * blocks_per_req, generator=gen).to(torch.int32)
    bt = perm.view(B, blocks_per_req).contiguous()
    pos, slots = [], []
    for b, tree in enumerate(trees):
        depth = [0] + [int(d) for d in tree.depth.tolist()]
        for r in range(t):
            p = context + r  # the r-th row sits at slot/position context + r (vLLM's linear slots)
            slots.append(int(bt[b, p // page]) * page + p % page)
            pos.append(context + depth[r])  # RoPE at root + depth
    tin = tree_batch_kernel_inputs(TreeBatch.from_trees(list(trees)), device)
    return StepInputs(
        tokens=torch.randint(0, vocab, (B * t,), generator=gen).to(device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        block_table=bt.to(device), seq_lens=torch.full((B,), context + t, dtype=torch.int32, device=device),
        query_start_loc=(torch.arange(B + 1, dtype=torch.int32) * t).to(device),
        q_len=t, max_seq_len=context + t, **tin)


# ---------------------------------------------------------------------------
# Measurements


def measure_verify(model: RandomLlama, batches, tokens, contexts, page, timer, device, mode: str, over_budget,
                   results: list, skipped: list) -> None:
    import torch

    from vllm_tree_spec.kernels.tree_verify_launch import tree_verify_inputs, tree_verify_triton
    from vllm_tree_spec.tree import TreeBatch
    from vllm_tree_spec.verify import Mode, VerifyCoins

    vocab = model.s.vocab
    for ctx in contexts:
        bpr = -(-(ctx + max(tokens)) // page)
        for B in batches:
            for t in tokens:
                key = {"stage": "verify", "context": ctx, "batch": B, "tokens": t}
                if over_budget():
                    skipped.append(key)
                    continue
                trees = [tree_for_tokens(t)] * B
                step = make_step(trees, ctx, page, bpr, device, vocab, seed=B * 100 + t)
                if t == 1:
                    expo = torch.empty(B, vocab, device=device).exponential_()

                    def fn(step=step, expo=expo):
                        p = torch.softmax(model.forward(step).float(), -1)
                        return torch.argmax(p / expo, -1)  # one exponential-race draw per request
                else:
                    batch = TreeBatch.from_trees(trees)
                    tin = tree_verify_inputs(batch, device)
                    coins = VerifyCoins.draw(B, batch.max_depth, batch.max_children, vocab, device=device)
                    modes = torch.full((B,), int(Mode.parse(mode)), dtype=torch.int32, device=device)
                    d = tin.max_depth
                    out = (torch.empty(B, d + 1, dtype=torch.int64, device=device),
                           torch.empty(B, dtype=torch.int64, device=device),
                           torch.empty(B, d, dtype=torch.int64, device=device),
                           torch.empty(B, dtype=torch.int64, device=device))

                    def fn(step=step, tin=tin, coins=coins, modes=modes, out=out, d=d):
                        p = torch.softmax(model.forward(step).float(), -1)
                        return tree_verify_triton(tin.cu_num_rows, tin.node_tokens, tin.first_child,
                                                  tin.next_sibling, p, None, modes, coins.uniform,
                                                  coins.exponential, max_depth=d, out=out)

                def fwd_only(step=step):
                    return model.forward(step)

                try:
                    ms, how = timer(fn)
                    fwd_ms, _ = timer(fwd_only)
                    results.append({**key, "ms": ms, "forward_ms": fwd_ms, "timer": how, "mode": mode if t > 1
                                    else "sample", "tokens_in_batch": B * t})
                except Exception as e:
                    results.append({**key, "ms": None, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                del step
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def measure_draft(name: str, model: RandomLlama, batches, widths, ctx, page, timer, device, over_budget, results,
                  skipped, topk: int = 4) -> None:
    """One draft level: w rows per request (siblings over the draft's own context), LM head, top-k."""
    import torch

    from vllm_tree_spec.tree import Tree

    bpr = -(-(ctx + max(widths)) // page)
    for B in batches:
        for w in widths:
            key = {"stage": "draft", "drafter": name, "context": ctx, "batch": B, "width": w}
            if over_budget():
                skipped.append(key)
                continue
            tree = Tree(torch.full((w - 1,), -1, dtype=torch.long)).with_tokens(
                torch.arange(1, w, dtype=torch.long)) if w > 1 else Tree.chain(0)
            step = make_step([tree] * B, ctx, page, bpr, device, model.s.vocab, seed=B * 10 + w)
            hidden = torch.randn(B * w, model.s.hidden, device=device, dtype=model.dtype) if model.fc is not None \
                else None

            def fn(step=step, hidden=hidden):
                return torch.topk(model.forward(step, hidden).float(), topk, -1)

            try:
                ms, how = timer(fn)
                results.append({**key, "ms": ms, "timer": how, "rows": B * w})
            except Exception as e:
                results.append({**key, "ms": None, "error": f"{type(e).__name__}: {str(e)[:200]}"})


def measure_commit(model: RandomLlama, batches, nodes_list, ctx, page, timer, device, over_budget, results,
                   skipped) -> None:
    import torch

    from vllm_tree_spec.kernels.kv_commit_launch import kv_commit_triton
    from vllm_tree_spec.tree import TreeBatch

    layer_table = torch.tensor([c.data_ptr() for c in model.kv], dtype=torch.int64, device=device)
    for B in batches:
        for n in nodes_list:
            key = {"stage": "commit", "batch": B, "nodes": n}
            if over_budget():
                skipped.append(key)
                continue
            tree = tree_for_tokens(n + 1)
            bpr = -(-(ctx + n + 1) // page)
            step = make_step([tree] * B, ctx, page, bpr, device, model.s.vocab, seed=B + n)
            leaf = max(range(n), key=lambda i: (int(tree.depth[i]), i))
            path = tree.path_to(leaf)
            d = max(1, tree.max_depth)
            acc = torch.full((B, d), -1, dtype=torch.long)
            acc[:, : len(path)] = torch.tensor(path)
            num = torch.full((B,), len(path), dtype=torch.long, device=device)
            cu = TreeBatch.from_trees([tree] * B).cu_num_rows.to(device)
            acc = acc.to(device)

            def fn(step=step, cu=cu, acc=acc, num=num):
                return kv_commit_triton(model.kv, step.slots, cu, acc, num, layer_table=layer_table)

            try:
                ms, how = timer(fn)
                results.append({**key, "ms": ms, "timer": how, "accepted": len(path), "layers": model.s.layers})
            except Exception as e:
                results.append({**key, "ms": None, "error": f"{type(e).__name__}: {str(e)[:200]}"})


def measure_dsv4(device, dtype, quick: bool, budget_s: float, batches=None, nodes=None) -> dict:
    """DeepSeek-V4 reference (plain PyTorch) at V4-Flash attention widths: tree forward and commit vs replay."""
    import torch

    from vllm_tree_spec.reference.dsv4 import DSV4Model
    from vllm_tree_spec.reference.dsv4_cache import DSV4Cache
    from vllm_tree_spec.reference.dsv4_config import DSV4Config
    from vllm_tree_spec.reference.dsv4_tree import commit, commit_by_replay, tree_forward

    t0 = time.perf_counter()
    reps = 1 if quick else 3
    if quick:
        cfg, ctx, grid_b, grid_n = DSV4Config(), 40, [1], [0, 3]
    else:
        full = DSV4Config.deepseek_v4_flash()
        cfg = DSV4Config(**{**asdict(full), "num_hidden_layers": 3, "compress_ratios": (0, 4, 128),
                            "vocab_size": 32768})
        ctx, grid_b, grid_n = 1024, [1, 4, 16], [0, 3, 7, 15]
    batches, nodes = batches or grid_b, nodes or grid_n
    out = {"config": {k: v for k, v in asdict(cfg).items() if k in ("hidden_size", "num_hidden_layers",
                                                                        "num_attention_heads", "head_dim",
                                                                        "compress_ratios", "sliding_window",
                                                                        "index_topk", "vocab_size")},
           "context": ctx, "dtype": str(dtype).replace("torch.", ""), "rows": [], "skipped": []}
    model = DSV4Model(cfg, dtype=dtype, seed=0).to(device)  # weights drawn on the host, then moved
    out["init_s"] = time.perf_counter() - t0
    prev = torch.get_default_device() if hasattr(torch, "get_default_device") else None
    torch.set_default_device(device)  # the reference allocates plans/scratch without a device argument
    try:
        for B in batches:
            cache = DSV4Cache.empty(cfg, B, ctx + 32, dtype=dtype)
            for layer in cache.layers:
                for tns in layer.tensors.values():
                    tns.normal_()
            cache.lengths.fill_(ctx)
            for n in nodes:
                if time.perf_counter() - t0 > budget_s:
                    out["skipped"].append({"batch": B, "nodes": n})
                    continue
                tree = tree_for_tokens(n + 1)
                trees = [tree] * B
                roots = [1] * B
                fwd = wall_ms(lambda: tree_forward(model, cache, roots, trees), device, reps)
                row = {"batch": B, "nodes": n, "tree_forward_ms": fwd}
                if n:
                    leaf = max(range(n), key=lambda i: (int(tree.depth[i]), i))
                    path = [tree.path_to(leaf)] * B
                    step = tree_forward(model, cache, roots, trees)
                    row["commit_ms"] = wall_ms(lambda: commit(cache.clone(), step, path), device, reps)
                    row["replay_ms"] = wall_ms(lambda: commit_by_replay(model, cache.clone(), step, path), device,
                                               reps)
                    row["clone_ms"] = wall_ms(lambda: cache.clone(), device, reps)  # both include one clone
                out["rows"].append(row)
            cache = step = None  # free this batch size's state before the next one
    finally:
        if prev is not None:
            torch.set_default_device(prev)
    out["seconds"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------
# Fits and the planner


def fit_linear(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x with a, b >= 0 (clamped)."""
    n = len(points)
    if n == 0:
        return 0.0, 0.0
    if n == 1:
        return max(points[0][1], 0.0), 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    b = max(b, 0.0)
    a = max(my - b * mx, 0.0)
    return a, b


def cost_models(verify_rows, draft_rows, commit_rows, contexts, host_draft_ms: float) -> dict:
    """{(drafter, context): CostModel JSON} from the measurements."""
    from vllm_tree_spec.planner import CostModel

    commit_pts = [(r["batch"] * r["nodes"], r["ms"]) for r in commit_rows if r.get("ms") is not None]
    s0, s1 = fit_linear(commit_pts)
    # (draft_level_ms, draft_node_ms, extra fixed ms per step); host-side drafting is a per-step cost
    drafters = {"model_free": (0.0, 0.0, host_draft_ms)}
    for name in sorted({r["drafter"] for r in draft_rows}):
        pts = [(r["batch"] * r["width"], r["ms"]) for r in draft_rows if r["drafter"] == name and r.get("ms")]
        drafters[name] = (*fit_linear(pts), 0.0)
    out = {}
    for ctx in contexts:
        table: dict[int, dict[int, float]] = {}
        for r in verify_rows:
            if r["context"] == ctx and r.get("ms") is not None:
                table.setdefault(r["batch"], {})[r["tokens"]] = r["ms"]
        table = {b: row for b, row in table.items() if 1 in row and len(row) > 1}
        if not table:
            continue
        for name, (lvl, node, fixed) in drafters.items():
            cm = CostModel.model_validate({"verify": {"kind": "table", "ms": table}, "draft_level_ms": lvl,
                                           "draft_node_ms": node, "state_ms": s0 + fixed, "state_node_ms": s1})
            out[(name, ctx)] = cm
    return out


def load_profiles(extra: list[str]) -> dict[str, dict]:
    from vllm_tree_spec.planner import depth_decay_table

    a = ASSUMED_PROFILE
    profiles = {"assumed-eagle-like": {"table": depth_decay_table(a["ranks"], a["decay"], a["depth"]),
                                       "source": a["source"]}}
    if CPU_PROFILES_FILE.exists():
        for name, p in json.loads(CPU_PROFILES_FILE.read_text()).items():
            profiles[name] = p
    for item in extra:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"--acceptance {item!r}: write NAME=FILE (JSON a[d][r] or a[r])")
        profiles[name] = {"table": json.loads(Path(path).read_text()), "source": path}
    return profiles


def run_planner(models: dict, profiles: dict, batches, max_nodes: int, out_dir: Path) -> list[dict]:
    from vllm_tree_spec.planner import describe_tree, format_plan_table, plan_trees, shape_hint

    summary = []
    for (drafter, ctx), cm in sorted(models.items()):
        (out_dir / f"costs_{drafter}_ctx{ctx}.json").write_text(cm.model_dump_json(indent=1))
        for pname, prof in profiles.items():
            table = prof["table"]
            depth = len(table) if table and isinstance(table[0], list) else None
            plans = plan_trees(table, cm, batches, max_nodes, depth)
            rows = [{"batch_size": p.batch_size, "tree": describe_tree(p.tree),
                     "paths": None if p.tree is None else [list(x) for x in p.tree.to_paths()],
                     "shape_hint": None if p.tree is None else shape_hint(p.tree),
                     "nodes": 0 if p.tree is None else p.tree.num_nodes, "expected_tokens": p.expected_tokens,
                     "step_ms": p.step_ms, "baseline_ms": p.baseline_ms, "gain_vs_no_spec": p.gain,
                     "gain_vs_best_chain": None if p.tree is None or not p.best_chain_nodes else p.vs_best_chain,
                     "tokens_per_s": p.tokens_per_s} for p in plans]
            tag = f"{pname}_{drafter}_ctx{ctx}"
            (out_dir / f"plan_{tag}.json").write_text(json.dumps(rows, indent=1))
            budgets = {str(r["batch_size"]): r["nodes"] for r in rows}
            (out_dir / f"budgets_{tag}.json").write_text(json.dumps(budgets))
            summary.append({"profile": pname, "drafter": drafter, "context": ctx, "budgets": budgets,
                            "table": format_plan_table(plans)})
    return summary


# ---------------------------------------------------------------------------
# Report


def markdown(meta: dict, verify_rows, draft_rows, commit_rows, models, plans, dsv4) -> str:
    lines = [f"# GPU cost model: {meta['device']}", "",
             f"Date (UTC) {meta['date_utc']}; torch {meta['torch']}, triton {meta['triton']}; mode {meta['mode']}; "
             f"target {meta['target']}; dtype {meta['dtype']}; verify rule {meta['verify_mode']}; "
             f"total {meta['seconds']:.0f} s.", ""]
    if meta.get("warning"):
        lines += [f"**{meta['warning']}**", ""]
    for ctx in sorted({r["context"] for r in verify_rows}):
        ts = sorted({r["tokens"] for r in verify_rows if r["context"] == ctx})
        lines += [f"## verify(B, t) ms, context {ctx} (forward + softmax + verification kernel; t = rows per "
                  f"request)", "", "| B \\ t | " + " | ".join(map(str, ts)) + " |", "|---|" + "---|" * len(ts)]
        for b in sorted({r["batch"] for r in verify_rows if r["context"] == ctx}):
            cells = []
            for t in ts:
                r = next((r for r in verify_rows if r["context"] == ctx and r["batch"] == b and r["tokens"] == t),
                         None)
                cells.append("-" if r is None or r.get("ms") is None else f"{r['ms']:.3f}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    if draft_rows:
        lines += ["## draft level ms (w rows per request, LM head + top-k included)", "",
                  "| drafter | B | w | ms |", "|---|---|---|---|"]
        lines += [f"| {r['drafter']} | {r['batch']} | {r['width']} | {_f(r.get('ms'))} |" for r in draft_rows]
        lines.append("")
    if commit_rows:
        lines += ["## commit ms (all target layers, one launch)", "", "| B | nodes | accepted | ms |",
                  "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['nodes']} | {r.get('accepted', '-')} | {_f(r.get('ms'), 4)} |"
                  for r in commit_rows]
        lines.append("")
    if models:
        lines += ["## fitted cost models (planner.CostModel)", "", "| drafter | context | draft_level_ms | "
                  "draft_node_ms | state_ms | state_node_ms |", "|---|---|---|---|---|---|"]
        for (d, c), cm in sorted(models.items()):
            lines.append(f"| {d} | {c} | {cm.draft_level_ms:.4f} | {cm.draft_node_ms:.5f} | {cm.state_ms:.4f} | "
                         f"{cm.state_node_ms:.6f} |")
        lines.append("")
    for p in plans:
        lines += [f"## plan: profile {p['profile']}, drafter {p['drafter']}, context {p['context']}", "",
                  f"budgets: `{json.dumps(p['budgets'])}`", "", "```", p["table"], "```", ""]
    if dsv4:
        lines += ["## DeepSeek-V4 reference model (plain PyTorch, not fed to the planner)", "",
                  f"config {dsv4.get('config')}, context {dsv4.get('context')}", ""]
        if dsv4.get("error"):
            lines.append(f"failed: {dsv4['error']}")
        else:
            lines += ["| B | nodes | tree forward ms | commit ms | replay ms | (cache clone ms) |",
                      "|---|---|---|---|---|---|"]
            for r in dsv4["rows"]:
                lines.append(f"| {r['batch']} | {r['nodes']} | {r['tree_forward_ms']:.2f} | {_f(r.get('commit_ms'))} "
                             f"| {_f(r.get('replay_ms'))} | {_f(r.get('clone_ms'))} |")
        lines.append("")
    return "\n".join(lines)


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU cost model of tree speculation (no vLLM)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes; runs on CPU under the Triton interpreter")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_cost"), help="output folder (default runs/gpu_cost)")
    ap.add_argument("--time-budget", type=float, default=360.0,
                    help="measurement seconds before remaining points are skipped (V4 reference: the last 75)")
    ap.add_argument("--contexts", help="context lengths, e.g. 1024,4096")
    ap.add_argument("--verify-mode", default="deterministic", choices=["greedy", "deterministic"],
                    help="lossless rule timed in verify (default deterministic: sampling at T > 0)")
    ap.add_argument("--host-draft-ms", type=float, default=0.0,
                    help="model-free drafters: host draft ms per step (e.g. from the CPU serve runs)")
    ap.add_argument("--acceptance", action="append", default=[], help="NAME=FILE acceptance profile (repeatable)")
    ap.add_argument("--no-dsv4", action="store_true", help="skip the DeepSeek-V4 reference timings")
    ap.add_argument("--max-nodes", type=int, default=None, help="planner's largest budget (default max tokens - 1)")
    args = ap.parse_args(argv)

    import torch

    if args.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit import
    for p in (str(ROOT),):
        if p not in sys.path:
            sys.path.insert(0, p)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit("the full cost run needs a CUDA GPU; use --quick for a CPU smoke run")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("CPU smoke run needs TRITON_INTERPRET=1 set before Triton is imported")
    import triton

    from vllm_tree_spec.tree_attention import load_kernels_package

    load_kernels_package()
    t_start = time.perf_counter()
    grid = QUICK if args.quick else FULL
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else grid["contexts"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device, args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.time_budget
    dsv4_budget = 0.0 if args.no_dsv4 else (30.0 if args.quick else 75.0)

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget - dsv4_budget

    tgt_shape = QUICK_TARGET if args.quick else TARGET
    meta = {"mode": "quick" if args.quick else "full", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype).replace("torch.", ""),
            "target": asdict(tgt_shape), "verify_mode": args.verify_mode, "grid": {**grid, "contexts": contexts},
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cpu":
        meta["warning"] = "CPU + Triton interpreter: smoke test of the script only, not performance numbers"
    print(f"[gpu_cost] {meta['device']}, target {tgt_shape.name} ({tgt_shape.params / 1e9:.2f} B params), "
          f"contexts {contexts}", flush=True)

    page = grid["page"]
    target = RandomLlama(tgt_shape, device, dtype, seed=0)
    max_t = max(grid["tokens"])
    blocks = max(grid["batches"]) * -(-(max(contexts) + max_t) // page) + 1
    target.alloc_kv(blocks, page)
    if device.type == "cuda":
        meta["target_memory_gib"] = torch.cuda.memory_allocated() / 2**30
    verify_rows, draft_rows, commit_rows, skipped = [], [], [], []
    measure_verify(target, grid["batches"], grid["tokens"], contexts, page, timer, device, args.verify_mode,
                   over_budget, verify_rows, skipped)
    print(f"[gpu_cost] verify: {len(verify_rows)} points, {time.perf_counter() - t_start:.0f} s", flush=True)
    measure_commit(target, grid["batches"], grid["commit_nodes"], min(contexts), page, timer, device, over_budget,
                   commit_rows, skipped)
    # Drafters share the target's embedding/LM head where EAGLE does; their KV pools are their own.
    eagle = RandomLlama(QUICK_EAGLE if args.quick else EAGLE, device, dtype, seed=1, lm_head=target.lm_head,
                        embed=target.embed, eagle_fc=True)
    eagle.alloc_kv(max(grid["batches"]) * -(-(min(contexts) + max(grid["draft_widths"])) // page) + 1, page)
    measure_draft("eagle_head", eagle, grid["batches"], grid["draft_widths"], min(contexts), page, timer, device,
                  over_budget, draft_rows, skipped)
    del eagle
    small = RandomLlama(QUICK_DRAFT if args.quick else DRAFT_1B, device, dtype, seed=2)
    small.alloc_kv(max(grid["batches"]) * -(-(min(contexts) + max(grid["draft_widths"])) // page) + 1, page)
    measure_draft("draft_1b", small, grid["batches"], grid["draft_widths"], min(contexts), page, timer, device,
                  over_budget, draft_rows, skipped)
    del small
    print(f"[gpu_cost] draft + commit done, {time.perf_counter() - t_start:.0f} s", flush=True)

    models = cost_models(verify_rows, draft_rows, commit_rows, contexts, args.host_draft_ms)
    profiles = load_profiles(args.acceptance)
    max_nodes = args.max_nodes or (max_t - 1)
    plans = run_planner(models, profiles, grid["batches"], max_nodes, out)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()

    dsv4 = None
    if not args.no_dsv4:
        remaining = max(5.0, budget - (time.perf_counter() - t_start))
        try:
            dsv4 = measure_dsv4(device, dtype, args.quick, min(dsv4_budget, remaining))
        except Exception as e:  # reference code on a GPU: recorded, never fatal
            dsv4 = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    meta["seconds"] = time.perf_counter() - t_start
    meta["timer_fallbacks"] = timer.fallbacks[:10]
    report = {"meta": meta, "verify": verify_rows, "draft": draft_rows, "commit": commit_rows, "skipped": skipped,
              "cost_models": {f"{d}@ctx{c}": json.loads(cm.model_dump_json()) for (d, c), cm in models.items()},
              "profiles": profiles, "plans": plans, "dsv4": dsv4}
    (out / "gpu_cost.json").write_text(json.dumps(report, indent=1))
    md = markdown(meta, verify_rows, draft_rows, commit_rows, models, plans, dsv4)
    (out / "gpu_cost.md").write_text(md)
    print(md)
    print(f"[gpu_cost] {meta['seconds']:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
