"""Benchmark: one DeepSeek-V4 tree step on vLLM's NVIDIA serving path (plan, per-layer launches, refresh).

What runs is the serving path's own code, not a copy: the NVIDIA adapter's `host_plan` (plan.py, host numpy)
and `device_plan` (device_plan.py: one upload, the lists written into vLLM's metadata buffers), the per-layer
launches of its layer overrides (hooks.py) and the accepted-path refresh `refresh_triton` over the adapter's
copy plan (`refresh_plan` below = `adapter._build_refresh_plan`; the test compares them). vLLM is not needed:
the metadata objects are SimpleNamespaces with the fields `device_plan` reads and writes, the caches are
views into pooled allocations laid out as vLLM 0.32 lays out DeepSeek-V4 (block-outermost; fp8_ds_mla and
indexer-key pages padded to a multiple of 576 bytes, so a layer's page stride is the pooled block).

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

from __future__ import annotations

import json
import math
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

# ---------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class V4Shape:
    name: str
    kinds: tuple[str, ...]  # per layer: "swa" / "csa" / "hca"
    hidden: int
    heads: int
    head_dim: int  # c
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    hca_ratio: int
    index_heads: int
    index_dim: int
    index_topk: int
    experts: int
    experts_per_tok: int
    moe_inter: int
    shared_experts: int
    vocab: int
    swa_block: int = 64  # vLLM block sizes: SWA KV, C4 / C128 state, compressed entries per 256 tokens
    c4_state_block: int = 4
    c128_state_block: int = 8
    entry_tokens_per_block: int = 256

    @property
    def kv_data_bytes(self) -> int:  # fp8_ds_mla: (c - r) fp8 + r bf16
        return self.head_dim - self.rope_dim + 2 * self.rope_dim

    def count(self, kind: str) -> int:
        return sum(k == kind for k in self.kinds)

    def describe(self) -> str:
        return (f"{self.name}: {len(self.kinds)} layers ({self.count('swa')} SWA, {self.count('csa')} CSA m=4, "
                f"{self.count('hca')} HCA m={self.hca_ratio}), hidden {self.hidden}, {self.heads} x {self.head_dim} "
                f"MQA, W {self.window}, indexer {self.index_heads} x {self.index_dim} top-{self.index_topk}, "
                f"MoE {self.experts} top-{self.experts_per_tok} + {self.shared_experts} x "
                f"{self.moe_inter}")  # fmt: skip


def flash_shape() -> V4Shape:
    from vllm_tree_spec.reference.dsv4_config import DSV4Config

    c = DSV4Config.deepseek_v4_flash()
    kinds = tuple(c.layer_kind(i) for i in range(c.num_hidden_layers))
    return V4Shape("DeepSeek-V4-Flash", kinds, c.hidden_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim,
                   c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window, 128, c.index_n_heads,
                   c.index_head_dim, c.index_topk, 256, 6, 2048, 1, c.vocab_size)  # fmt: skip


# The adapter's ratios are vLLM's (C4, C128) and its row formats are fp8_ds_mla (584 B) / FP8 keys (132 B), so
# the smoke shape keeps them and 256-token entry blocks; it shrinks layers, window and state rows.
QUICK_SHAPE = V4Shape("tiny V4-shaped (CPU smoke)", ("swa", "csa", "hca"), 64, 4, 32, 8, 16, 2, 16, 16, 128, 2, 16,
                      8, 8, 2, 32, 1, 97, swa_block=16)  # fmt: skip

FULL_GRID = {"context": [8192, 65536], "batch": [4, 1, 16, 64], "tree": ["s3_k2_d6", "chain7", "binary15"]}
QUICK_GRID = {"context": [256], "batch": [1], "tree": ["s3_k2_d6"]}
HEADLINE = {"batch": 4, "tree": "s3_k2_d6", "context": 8192}  # the fraction the issue asks for (quick: its row)
DEFAULT_BUDGET_S = 110.0
CSA, HCA = 4, 128


def make_tree(name: str):
    from vllm_tree_spec.tree import Tree

    if name == "s3_k2_d6":  # two root children, two best grandchildren, one great-grandchild (5 nodes)
        return Tree(torch.tensor([-1, -1, 0, 0, 2]))
    if name == "binary15":
        return Tree(torch.tensor([i // 2 - 1 for i in range(15)]))
    if name == "chain7":
        return Tree.chain(7)
    raise ValueError(name)


# ---------------------------------------------------------------------------
# vLLM's pooled cache layout


def _padded(raw: int) -> int:
    return -(-raw // 576) * 576


class Pool:
    """One pooled allocation of `num_blocks` blocks; a block holds one page of every layer added (vLLM packs
    DeepSeek-V4 caches block-outermost, so a layer's page stride is the whole block)."""

    def __init__(self):
        self.pages: list[tuple[str, int, int, int]] = []  # (kind, rows per page, row width, page bytes)

    def add(self, kind: str, rows: int, width: int, count: int) -> None:
        if kind == "fp8":  # fp8_ds_mla [bs, 584] uint8, padded page
            nbytes = _padded(rows * 584)
        elif kind == "key":  # FP8 indexer keys [bs, 132] uint8, padded page
            nbytes = _padded(rows * 132)
        else:  # compressor state [bs, width] float32
            nbytes = rows * width * 4
        self.pages += [(kind, rows, width, nbytes)] * count

    def build(self, num_blocks: int, device, gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
        block = sum(p[3] for p in self.pages)
        raw = torch.randint(0, 256, (num_blocks * block,), dtype=torch.uint8, generator=gen, device=device)
        views, off = [], 0
        for kind, rows, width, nbytes in self.pages:
            if kind == "state":
                v = torch.as_strided(raw.view(torch.float32), (num_blocks, rows, width), (block // 4, width, 1),
                                     off // 4)  # fmt: skip
                v.copy_(torch.randn(v.shape, generator=gen, device=device))  # finite floats
            else:
                w = 584 if kind == "fp8" else 132
                v = torch.as_strided(raw, (num_blocks, rows, w), (block, w, 1), off)
            views.append(v)
            off += nbytes
        return raw, views


class BlockTable:
    """Block table of B requests over `positions` slots: column j -> b * keep + j % keep. The last `keep`
    columns of a request (its window, tree rows and refresh destinations) are distinct from every other
    request's and its own; older columns alias, which changes which bytes a committed part points at, not
    the work."""

    def __init__(self, batch: int, positions: int, block: int, keep: int):
        self.block, self.keep = block, keep
        j = np.arange(max(1, -(-positions // block)))
        self.table = (np.arange(batch)[:, None] * keep + (j % keep)[None, :]).astype(np.int64)
        self.num_blocks = batch * keep

    def slots(self, b: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.table[b, pos // self.block] * self.block + pos % self.block


# ---------------------------------------------------------------------------
# One step: the runner's TreeStep, vLLM's metadata and caches, the adapter's plan inputs


@dataclass
class Case:
    shape: V4Shape
    batch: int
    tree_name: str
    context: int
    device: torch.device
    step: object
    qsl: np.ndarray
    start: np.ndarray
    rd: int
    long_ctx: bool
    caches: object  # Dsv4NvidiaCaches
    md: dict
    stock: dict  # host copies of vLLM's stock slot mappings / tables (stage 1)
    pools: list
    topk: list  # [R, K] int32 per CSA layer
    cos_sin: torch.Tensor
    result: SimpleNamespace  # the verifier's accepted paths
    scratch_first: int
    scratch_count: int
    refresh: object = None  # CopyPlan
    state_scratch: object = None  # hooks.StateScratch
    page_plans: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.rd


def _step(trees, starts, device):
    """The runner's TreeStep of B decode requests, each 1 + n rows (root first), as build_step makes it."""
    from vllm_tree_spec.integration.tree_step import TreeRequestStep, TreeStep, TreeStepMeta
    from vllm_tree_spec.tree import TreeBatch, long_tensor
    from vllm_tree_spec.verify import Mode

    batch = TreeBatch.from_trees(trees)
    cu = batch.host.cu_num_rows
    reqs = [TreeRequestStep(f"req{b}", b, cu[b], int(starts[b]), t, Mode.GREEDY, None) for b, t in enumerate(trees)]
    rows = [r for b in range(len(trees)) for r in range(cu[b], cu[b + 1])]
    nodes = [r for b in range(len(trees)) for r in range(cu[b] + 1, cu[b + 1])]
    pos = [int(starts[b]) + d for b, t in enumerate(trees) for d in t.depth.tolist()]
    meta = TreeStepMeta(batch, long_tensor(list(range(len(trees)))), long_tensor(cu[:-1]),
                        long_tensor(cu).to(device), long_tensor(rows).to(device), long_tensor(nodes).to(device),
                        long_tensor(pos).to(device))  # fmt: skip
    return TreeStep(reqs, meta=meta), np.asarray(cu, dtype=np.int64)


def make_case(shape: V4Shape, batch: int, tree_name: str, context: int, device, seed: int = 0,
              stagger: bool = False) -> Case:  # fmt: skip
    from vllm_tree_spec.integration.dsv4.layout import ScratchBlocks
    from vllm_tree_spec.integration.dsv4.nvidia.caches import CacheGroup, Dsv4NvidiaCaches
    from vllm_tree_spec.integration.dsv4.nvidia.hooks import StateScratch
    from vllm_tree_spec.integration.dsv4.nvidia.plan import host_plan

    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: the pools reach GBs at batch 64
    tree = make_tree(tree_name)
    n = tree.num_nodes
    starts = np.array([context - 2 - (b % 4 if stagger else 0) for b in range(batch)], dtype=np.int64)
    step, qsl = _step([tree] * batch, starts, device)
    rd = int(qsl[-1])
    row_req = np.repeat(np.arange(batch), 1 + n)
    lin = starts[row_req] + (np.arange(rd) - qsl[row_req])  # vLLM's linear positions of the step's rows
    end = int(starts.max()) + n + 1
    L, kinds = len(shape.kinds), shape.kinds
    csa = [i for i, k in enumerate(kinds) if k == "csa"]
    hca = [i for i, k in enumerate(kinds) if k == "hca"]
    epb = {CSA: shape.entry_tokens_per_block // CSA, HCA: shape.entry_tokens_per_block // HCA}
    long_ctx = context // CSA > shape.index_topk  # on_metadata's test (max_seq_len // 4 > index_topk)

    # block tables: SWA (one per group), C4 / C128 state, the entry group (C4, C128 entries and keys share it)
    swa_bt = BlockTable(batch, end, shape.swa_block, (shape.window + n) // shape.swa_block + 3)
    st_bt = {CSA: BlockTable(batch, end, shape.c4_state_block, (2 * CSA + n) // shape.c4_state_block + 3),
             HCA: BlockTable(batch, end, shape.c128_state_block, (HCA + n) // shape.c128_state_block + 3)}
    ent_bt = BlockTable(batch, end, shape.entry_tokens_per_block, 3)

    # scratch entry-group blocks: exactly what this step takes (the adapter reserves a worst case)
    probe = ScratchBlocks(ent_bt.num_blocks, 1 << 30)
    hp0 = host_plan(step, qsl, starts, rd, [CSA, HCA], epb, {CSA: shape.c4_state_block, HCA: shape.c128_state_block},
                    probe.take, long_ctx)  # fmt: skip
    del hp0
    scratch_count = max(1, probe.used)

    # pooled caches (vLLM groups SWA caches by the layers that share a block table: SWA-only + HCA, CSA)
    swa_groups = [[i for i, k in enumerate(kinds) if k != "csa"], csa]
    swa_groups = [g for g in swa_groups if g]
    pools, caches = [], Dsv4NvidiaCaches()
    md: dict = {}
    for gid, layers in enumerate(swa_groups):
        p = Pool()
        p.add("fp8", shape.swa_block, 584, len(layers))
        raw, views = p.build(swa_bt.num_blocks, device, gen)
        pools.append(raw)
        caches.swa.append(CacheGroup(gid, shape.swa_block, [f"swa{gid}"], views))
    c, ci = shape.head_dim, shape.index_dim
    for m, widths in ((CSA, [4 * c] * len(csa) + [4 * ci] * len(csa)), (HCA, [2 * c] * len(hca))):
        if not widths:
            continue
        p = Pool()
        for w in widths:
            p.add("state", shape.c4_state_block if m == CSA else shape.c128_state_block, w, 1)
        raw, views = p.build(st_bt[m].num_blocks, device, gen)
        pools.append(raw)
        caches.state[m] = CacheGroup(len(swa_groups) + len(caches.state), st_bt[m].block, [f"state{m}"], views)
    p = Pool()
    p.add("fp8", epb[CSA], 584, len(csa))
    p.add("fp8", epb[HCA], 584, len(hca))
    p.add("key", epb[CSA], 132, len(csa))
    raw, views = p.build(ent_bt.num_blocks + scratch_count, device, gen)
    pools.append(raw)
    caches.entry_gid = len(swa_groups) + len(caches.state)
    caches.entry_caches = {CSA: views[: len(csa)], HCA: views[len(csa): len(csa) + len(hca)]}
    caches.entry_caches = {m: v for m, v in caches.entry_caches.items() if v}
    caches.entries_per_block = {m: epb[m] for m in caches.entry_caches}
    caches.key_caches = views[len(csa) + len(hca):]
    caches.metadata_keys = {f"entries{m}": f"entries{m}" for m in caches.entry_caches}
    if csa:
        caches.metadata_keys["indexer"] = "indexer"

    # vLLM's stock metadata of the step (linear positions through the block tables)
    i64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    i32 = lambda a: i64(a).to(torch.int32)  # noqa: E731
    stock = {}
    for g in caches.swa:
        sm = swa_bt.slots(row_req, lin)
        stock[f"swa{g.gid}"] = (sm, swa_bt.table)
        md[f"swa{g.gid}"] = SimpleNamespace(
            slot_mapping=i64(sm), block_table=i32(swa_bt.table), block_size=shape.swa_block,
            decode_swa_width=shape.window, num_decode_tokens=rd, num_decodes=batch,
            decode_swa_indices=torch.full((rd, 1, shape.window), -7, dtype=torch.int32, device=device),
            decode_swa_lens=torch.full((rd,), -7, dtype=torch.int32, device=device))  # fmt: skip
    for m in caches.state:
        sm = st_bt[m].slots(row_req, lin)
        stock[f"state{m}"] = (sm, st_bt[m].table)
        md[f"state{m}"] = SimpleNamespace(slot_mapping=i64(sm), block_table=i32(st_bt[m].table),
                                          block_size=st_bt[m].block, num_decode_tokens=rd)  # fmt: skip
    for m in caches.entry_caches:
        w = (lin + 1) // m - 1
        col = np.maximum(w, 0) // epb[m]
        sm = np.where((lin + 1) % m == 0, ent_bt.table[row_req, col] * epb[m] + np.maximum(w, 0) % epb[m], -1)
        stock[f"entries{m}"] = (sm, ent_bt.table)
        ns = SimpleNamespace(slot_mapping=i64(sm), block_table=i32(ent_bt.table), num_decode_tokens=rd)
        if m == HCA:
            width = max(16, 1 << max(0, math.ceil(math.log2(max(1, end // HCA)))))  # vLLM's C128A list width
            ns.c128a_global_decode_topk_indices = torch.full((rd, 1, width), -7, dtype=torch.int32, device=device)
            ns.c128a_decode_topk_lens = torch.full((rd,), -7, dtype=torch.int32, device=device)
        md[f"entries{m}"] = ns
    if csa:
        sm = stock[f"entries{CSA}"][0]
        dec = SimpleNamespace(seq_lens=i32((lin + 1) // CSA).view(rd, 1), block_table=i32(ent_bt.table[row_req]),
                              schedule_metadata=None)  # fmt: skip
        md["indexer"] = SimpleNamespace(slot_mapping=i64(sm), block_table=i32(ent_bt.table), num_decode_tokens=rd,
                                        max_seq_len=context, decode=dec)  # fmt: skip
        stock["indexer_bt"] = ent_bt.table[row_req].copy()

    # the indexer's top-k ids per CSA layer: distinct visible entries, the two newest always (path entries)
    topk = []
    nv = (lin + 1) // CSA
    k = min(shape.index_topk, int(nv.max()))
    for _ in csa:
        score = torch.rand(rd, int(nv.max()), generator=gen, device=device)
        w = torch.arange(score.shape[1], device=device)[None, :]
        nvt = i64(nv)[:, None]
        score[w >= nvt - 2] = 2.0
        score[w >= nvt] = -1.0
        val, ids = score.topk(k, dim=1)
        topk.append(torch.where(val >= 0, ids, torch.full_like(ids, -1)).to(torch.int32))

    # the verifier's result: the deepest node's path accepted in every request
    path = tree.path_to(n - 1) if n else []
    acc = torch.full((batch, max(1, tree.max_depth)), -1, dtype=torch.long)
    if path:
        acc[:, : len(path)] = torch.tensor(path)
    result = SimpleNamespace(accepted_nodes=acc.to(device), num_accepted=torch.full((batch,), len(path)).to(device))
    cos_sin = torch.randn(end + HCA, shape.rope_dim, generator=gen, device=device)
    case = Case(shape, batch, tree_name, context, torch.device(device), step, qsl, starts, rd, long_ctx, caches, md,
                stock, pools, topk, cos_sin, result, ent_bt.num_blocks, scratch_count)  # fmt: skip
    case.refresh = refresh_plan(caches, device)
    case.state_scratch = StateScratch()
    return case


def refresh_plan(caches, device):
    """The adapter's refresh copy plan (`DeepseekV4NvidiaTreeAdapter._build_refresh_plan`, whose module needs
    vLLM-side imports the GPU machine lacks; tests/kernels/test_bench_smoke.py checks the two agree)."""
    from vllm_tree_spec.integration.dsv4.nvidia.device_plan import refresh_spaces
    from vllm_tree_spec.kernels import dsv4_refresh_launch as r

    planes = []
    for i, space in enumerate(refresh_spaces(caches)):
        kind, key = space.split(":")
        if kind == "swa":
            group = next(g for g in caches.swa if g.gid == int(key))
            planes += [(p, p, i) for cache in group.caches for p in r.fp8_ds_mla_planes(cache)]
        elif kind == "state":
            planes += [(r.state_plane(cache), r.state_plane(cache), i) for cache in caches.state[int(key)].caches]
        else:
            m = int(key)
            planes += [(p, p, i) for cache in caches.entry_caches[m] for p in r.fp8_ds_mla_planes(cache)]
            if m == CSA:
                planes += [(p, p, i) for cache in caches.key_caches for p in r.index_key_planes(cache)]
    return r.build_copy_plan(planes, device)


# ---------------------------------------------------------------------------
# The step's work, as the adapter and its layer overrides launch it


def run_host_plan(case: Case):
    from vllm_tree_spec.integration.dsv4.layout import ScratchBlocks
    from vllm_tree_spec.integration.dsv4.nvidia.plan import host_plan

    c = case.caches
    scratch = ScratchBlocks(case.scratch_first, case.scratch_count)
    return host_plan(case.step, case.qsl, case.start, case.rd, c.ratios, c.entries_per_block,
                     {m: c.state[m].block_size for m in c.ratios}, scratch.take, case.long_ctx)  # fmt: skip


def run_device_plan(case: Case, hp):
    from vllm_tree_spec.integration.dsv4.nvidia.device_plan import device_plan

    return device_plan(hp, case.step, case.md, case.caches, case.device, long_context=case.long_ctx, num_sms=None,
                       schedule_fn=None)  # fmt: skip


def run_layers(case: Case, plan, keep: dict | None = None) -> None:
    """The per-layer launches of the layer overrides (hooks.py), in the forward's layer order."""
    from vllm_tree_spec.kernels import dsv4_refresh_launch as r
    from vllm_tree_spec.kernels import dsv4_tree_meta_launch as meta

    c, s = case.caches, case.shape
    n_csa = s.count("csa")
    tables = {}
    for m, vc in plan.compress.items():  # N3's virtual cos/sin table (once per step and rotary table)
        t = torch.zeros(vc.cos_rows, case.cos_sin.shape[1], dtype=case.cos_sin.dtype, device=case.device)
        t[vc.cos_dst] = case.cos_sin[vc.cos_src]
        tables[m] = t

    def compressor(m: int, state: torch.Tensor, tag: str) -> None:  # N3
        vc = plan.compress.get(m)
        if vc is None:
            return
        scratch = case.state_scratch.tensor(state, vc.num_blocks)
        cp = case.state_scratch.copy_plan(state, scratch)
        if keep is not None:
            keep.setdefault("n3", []).append((tag, cp, scratch.clone(), vc.fill_src, vc.fill_dst))
        r.copy_rows_triton(cp, vc.fill_src, vc.fill_dst)
        if keep is not None:
            keep["n3"][-1] += (scratch.clone(),)

    j_csa = j_hca = 0
    for kind in s.kinds:
        if kind == "csa":
            j = j_csa
            j_csa += 1
            compressor(CSA, c.state[CSA].caches[n_csa + j], f"indexer compressor {j}")
            if plan.indexer is not None:  # N4
                k_cache = c.key_caches[j]
                key = k_cache.data_ptr()
                if key not in case.page_plans:
                    case.page_plans[key] = (
                        r.build_copy_plan([(r.index_page_plane(k_cache), r.index_page_plane(k_cache), 0)],
                                          k_cache.device),
                        r.build_copy_plan([(p, p, 0) for p in r.index_key_planes(k_cache)], k_cache.device))
                pages, keys = case.page_plans[key]
                ix = plan.indexer
                r.copy_rows_triton(pages, ix.page_src, ix.page_dst)
                r.copy_rows_triton(keys, ix.key_src, ix.key_dst)
            out = meta.tree_topk_slots_triton(plan.rows, case.topk[j], plan.entries[CSA],  # N2
                                              case.md[f"entries{CSA}"].block_table, c.entries_per_block[CSA])
            if keep is not None:
                keep.setdefault("topk", []).append(out)
            compressor(CSA, c.state[CSA].caches[j], f"CSA compressor {j}")
        elif kind == "hca":
            compressor(HCA, c.state[HCA].caches[j_hca], f"HCA compressor {j_hca}")
            j_hca += 1


def run_refresh(case: Case, plan) -> None:
    """adapter.commit's launch."""
    from vllm_tree_spec.kernels import dsv4_refresh_launch as r

    r.refresh_triton(case.refresh, plan.refresh.src, plan.refresh.dst, case.step.meta.cu_num_rows,
                     case.result.accepted_nodes, case.result.num_accepted)  # fmt: skip


# ---------------------------------------------------------------------------
# Launch counting and the capturable upload


class LaunchCounter:
    """Triton launches (calls of the kernel modules' launchers; each launches one kernel) and PyTorch kernels
    outside them (aten ops on the step's device, views and allocations excluded), plus device-to-host syncs."""

    LAUNCHERS = {"dsv4_tree_meta_launch": ("tree_window_slots_triton", "tree_entry_slots_triton",
                                           "tree_topk_slots_triton"),
                 "dsv4_refresh_launch": ("refresh_triton", "copy_rows_triton")}  # fmt: skip

    def __init__(self, device):
        self.device = torch.device(device)
        self.triton: dict[str, int] = {}
        self.torch_ops: dict[str, int] = {}
        self.syncs = 0
        self._inside = 0

    @contextmanager
    def counting(self):
        import importlib

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        saved = []
        for mod_name, names in self.LAUNCHERS.items():
            mod = importlib.import_module(f"vllm_tree_spec.kernels.{mod_name}")
            for name in names:
                fn = getattr(mod, name)

                def wrapped(*a, _fn=fn, _name=name, **kw):
                    counter.triton[_name] = counter.triton.get(_name, 0) + 1
                    counter._inside += 1
                    try:
                        return _fn(*a, **kw)
                    finally:
                        counter._inside -= 1

                saved.append((mod, name, fn))
                setattr(mod, name, wrapped)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if name == "_local_scalar_dense":
                    counter.syncs += 1
                elif not counter._inside and not func.is_view and not name.startswith("empty") \
                        and _on_device(args, out, counter.device):
                    counter.torch_ops[name] = counter.torch_ops.get(name, 0) + 1
                return out

        try:
            with Mode():
                yield self
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)

    def summary(self) -> dict:
        return {"triton": sum(self.triton.values()), "torch": sum(self.torch_ops.values()), "syncs": self.syncs,
                "triton_by_launcher": dict(self.triton), "torch_by_op": dict(self.torch_ops)}


def _on_device(args, out, device) -> bool:
    for x in (*args, *(out if isinstance(out, (tuple, list)) else (out,))):
        if isinstance(x, torch.Tensor) and x.device.type == device.type:
            return True
    return False


def count_launches(case: Case, fn) -> dict:
    counter = LaunchCounter(case.device)
    with counter.counting():
        fn()
    return counter.summary()


def profiled_kernels(fn) -> int | None:
    """Device activities (kernels, copies, fills) of one call, by torch.profiler (CUDA only)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # the profiler is a diagnostic; the wrapped counts stand on their own
        return None


@contextmanager
def staged_upload(device):
    """device_plan's upload for graph capture: a replay cannot re-read host numpy, so the step's bytes are
    uploaded once to a device staging buffer and every call copies them from there (one device copy, where
    the serving path has one host-to-device copy of the same bytes). Eager timings use the real upload."""
    from vllm_tree_spec.integration.dsv4.nvidia import device_plan as dp

    real = dp.upload_int64
    buf: dict = {}

    def upload(arrays, dev):
        flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]) if arrays else \
            np.zeros(0, dtype=np.int64)
        if "flat" not in buf or not np.array_equal(buf["flat"], flat):  # never inside a capture (warmed first)
            buf["flat"] = flat
            buf["stage"] = torch.from_numpy(flat).to(device)
            buf["dev"] = torch.empty_like(buf["stage"])
        buf["dev"].copy_(buf["stage"])
        out, o = [], 0
        for a in arrays:
            k = int(np.asarray(a).size)
            out.append(buf["dev"][o: o + k].view(np.asarray(a).shape))
            o += k
        return out

    dp.upload_int64 = upload
    try:
        yield
    finally:
        dp.upload_int64 = real


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
