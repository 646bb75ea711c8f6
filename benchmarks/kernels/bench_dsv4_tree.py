"""Benchmark: DeepSeek-V4 tree metadata, compressor and commit vs a DeepSeek-V4-Flash-shaped verify step.

The question: are commit plus index-list construction under 5 % of a verify step of a
DeepSeek-V4-shaped layer stack?

What one tree step costs us (all timed, one call = one step of the whole model):

  meta      index lists for every row, once per step (shared by all layers):
              SWA window (W = 128, vLLM's left-aligned layout)      tree_window_slots_triton
              CSA / HCA pooling gathers (8 / 128 state slots)        tree_window_slots_triton
              CSA entries (tail + write slots), HCA entries (dense)  tree_entry_slots_triton
            plus, per CSA layer, the indexer's top-k ids -> slots    tree_topk_slots_triton (21 launches;
              it replaces vLLM's own compute_global_topk_indices_and_lens, counted in full anyway)
  commit    accepted path -> persistent slots, every layer:
              SWA KV rows (43 layers, fp8_ds_mla 576 B data + 8 B scale), CSA main / indexer state
              rows (fp32, 8 KiB / 2 KiB), HCA state rows (4 KiB), CSA entries (584 B), indexer keys
              (128 B + 4 B), HCA entries (584 B): 11 launches through layer tables
  compress  branch-specific entries of block-completing nodes: 21 CSA main + 21 indexer + 20 HCA
            launches (reported separately: it replaces vLLM's stock compress kernels, it is not
            bookkeeping)

Workload: B requests, each at P = context - 2 so depth-1 nodes complete an HCA
(m' = 128) and a CSA block and depth-5 nodes another CSA block; trees
`s3_k2_d6` (5 nodes, depth 3), complete binary 15 nodes (depth 4), and a chain
of 7 (linear speculation through the same path); the deepest path is accepted.
Row slots follow vLLM (tree rows at the linear slots of positions P .. P + N;
scratch entries in extra blocks).

Verify step (the denominator) is a documented *lower bound* for a
DeepSeek-V4-Flash layer stack (43 layers: 2 SWA, 21 CSA, 20 HCA; hidden 4096,
64 heads x 512, MQA, q_lora 1024, o 8 x 1024, indexer 64 x 128 top-512, MoE
256 experts top-6 + 1 shared, inter 2048; R = B (1 + N) query rows):

  attention-side linears  timed: the real GEMM shapes in bf16 (wq_a, wq_b, wkv, grouped wo_a, wo_b,
                          compressor wkv|wgate, indexer wq_b / weights / compressor), divided by 2
                          (credit for FP8 weights and FP8 tensor cores)
  attention core          roofline: max(FLOPs / bf16 peak, fp8 KV bytes / copy bandwidth), K = V rows:
                          W + 512 (CSA), W + visible entries (HCA), W (SWA)
  indexer scores          roofline at FP8 peak (= 2 x measured bf16 peak) + key bytes
  MoE                     roofline: FP4 bytes of the expected distinct experts touched + shared
                          expert (FP8), FLOPs at FP8 peak
  LM head                 bf16 weight bytes / bandwidth

Every term is a lower bound of a real kernel, so the step is a lower bound and
the reported overhead percentages are upper bounds. Also reported: the same
overhead against step / 8 (an 8-GPU tensor-parallel node where every rank
repeats the metadata and the commit: the pessimistic reading).

On a machine without a GPU only `quick=True` works (Triton interpreter, a
tiny V4-shaped model, wall clock): a smoke test of the script, not
performance numbers.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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


QUICK_SHAPE = V4Shape("tiny V4-shaped (CPU smoke)", ("swa", "csa", "hca", "csa", "hca"), 64, 4, 32, 8, 16, 2, 16, 16,
                      16, 2, 16, 8, 8, 2, 32, 1, 97, swa_block=8, c4_state_block=4, c128_state_block=8,
                      entry_tokens_per_block=32)  # fmt: skip

FULL_GRID = {"batch": [1, 8, 64], "tree": ["s3_k2_d6", "binary15", "chain7"], "context": [8192, 65536]}
QUICK_GRID = {"batch": [2], "tree": ["s3_k2_d6"], "context": [64]}  # multiples of the HCA ratio
DEFAULT_BUDGET_S = 150.0  # the full GPU grid in ~2.5 min (run it alone: run_all.py --only bench_dsv4_tree)


def make_tree(name: str):
    from vllm_tree_spec.tree import Tree

    if name == "s3_k2_d6":  # two root children, two best grandchildren, one great-grandchild
        return Tree(torch.tensor([-1, -1, 0, 0, 2]))
    if name == "binary15":
        return Tree(torch.tensor([i // 2 - 1 for i in range(15)]))
    if name == "chain7":
        return Tree.chain(7)
    raise ValueError(name)


# ---------------------------------------------------------------------------
# One benchmark case: caches, slot maps and the step's inputs, vLLM layout


class Alias:
    """Block tables over a small block pool: request b's blocks j -> b * K + j % K.

    The last K blocks of a request (its window, tree rows and commit destinations)
    are distinct from every other block; older ones alias, which only changes
    which bytes the committed part of a list points at, not the work.
    """

    def __init__(self, batch: int, positions: int, block: int, keep: int, device):
        self.block = block
        self.k = keep
        nb = -(-positions // block)
        j = torch.arange(nb)
        self.table = (torch.arange(batch)[:, None] * keep + (j % keep)[None, :]).to(torch.int32).to(device)
        self.num_blocks = batch * keep

    def slots(self, b: int, positions: torch.Tensor) -> torch.Tensor:
        return self.table[b, positions // self.block].long().cpu() * self.block + positions % self.block


@dataclass
class Case:
    shape: V4Shape
    batch: int
    tree_name: str
    context: int
    rows: object  # DSV4TreeRows on the device
    acc: torch.Tensor
    num: torch.Tensor
    swa: Alias
    c4s: Alias
    c128s: Alias
    e4: Alias
    e128: Alias
    swa_row_slots: torch.Tensor
    c4_row_slots: torch.Tensor
    c128_row_slots: torch.Tensor
    e4_own: torch.Tensor
    e128_own: torch.Tensor
    hca_width: int
    topk_ids: torch.Tensor
    caches: dict = field(default_factory=dict)  # name -> (list of views, layer table, paged)
    compress: dict = field(default_factory=dict)
    outs: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows


def make_case(shape: V4Shape, batch: int, tree_name: str, context: int, device, seed: int = 0) -> Case:
    from vllm_tree_spec.kernels.dsv4_tree_meta_launch import DSV4TreeRows
    from vllm_tree_spec.tree import TreeBatch

    g = torch.Generator().manual_seed(seed)
    tree = make_tree(tree_name)
    batch_t = TreeBatch.from_trees([tree] * batch)
    P = context - 2
    rows_cpu = DSV4TreeRows.from_tree_batch(batch_t, [P] * batch)
    rc = rows_cpu
    rows = DSV4TreeRows(*(t.to(device) for t in (rc.row_req, rc.parent_rows, rc.depth, rc.start, rc.cu_num_rows)),
                        rc.max_depth)  # fmt: skip
    n = tree.num_nodes
    end = P + n + 1
    m4, m128 = 4, shape.hca_ratio
    swa = Alias(batch, end, shape.swa_block, (shape.window + n) // shape.swa_block + 3, device)
    c4s = Alias(batch, end, shape.c4_state_block, (8 + n) // shape.c4_state_block + 3, device)
    c128s = Alias(batch, end, shape.c128_state_block, (m128 + n) // shape.c128_state_block + 3, device)
    epb4, epb128 = shape.entry_tokens_per_block // m4, shape.entry_tokens_per_block // m128
    e4 = Alias(batch, end // m4 + 1, epb4, (n // m4 + 2) // epb4 + 2, device)
    e128 = Alias(batch, end // m128 + 1, epb128, 3, device)
    lin = torch.arange(n + 1)

    def linear(alias: Alias) -> torch.Tensor:  # vLLM: the tree rows take the slots of positions P .. P + N
        return torch.cat([alias.slots(b, P + lin) for b in range(batch)]).to(device)

    r = rows.num_rows
    path = tree.path_to(n - 1) if n else []  # the deepest node: the most copies
    d = max(1, tree.max_depth)
    acc = torch.full((batch, d), -1, dtype=torch.long)
    if path:
        acc[:, : len(path)] = torch.tensor(path)
    num = torch.full((batch,), len(path), dtype=torch.long)
    nv4 = (P + n + 1) // m4
    topk = min(shape.index_topk, max(1, nv4))
    ids = torch.stack([torch.randperm(nv4, generator=g)[:topk] for _ in range(r)])  # distinct visible entries
    e4_own = (e4.num_blocks * epb4 + torch.arange(r)).to(device)  # scratch entry slots, after the canonical blocks
    e128_own = (e128.num_blocks * epb128 + torch.arange(r)).to(device)
    hca_width = max(16, 1 << max(0, math.ceil(math.log2(max(1, end // m128)))))  # vLLM's C128A list width
    case = Case(shape, batch, tree_name, context, rows, acc.to(device), num.to(device), swa, c4s, c128s, e4, e128,
                linear(swa), linear(c4s), linear(c128s), e4_own, e128_own, hca_width,
                ids.to(torch.int32).to(device))  # fmt: skip

    # caches (one per layer; the commit launches group layers of one layout through a layer table)
    def pages(num_blocks: int, block: int, data: int, scale: int, layers: int):
        return [torch.randint(0, 256, (num_blocks, block * (data + scale)), dtype=torch.uint8, device=device)
                for _ in range(layers)]  # fmt: skip

    def split(pgs, block: int, data: int, scale: int):
        nb = pgs[0].shape[0]
        dv = [p[:, : block * data].view(nb, block, data) for p in pgs]
        sv = [p[:, block * data :].view(nb, block, scale) for p in pgs]
        return dv, sv

    def add(name, views, paged=True):
        table = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)
        case.caches[name] = (views, table, paged)

    L, n_csa, n_hca = len(shape.kinds), shape.count("csa"), shape.count("hca")
    kvd = shape.kv_data_bytes
    swa_pages = pages(swa.num_blocks, shape.swa_block, kvd, 8, L)
    dv, sv = split(swa_pages, shape.swa_block, kvd, 8)
    add("swa_kv.data", dv)
    add("swa_kv.scale", sv)
    c, ci = shape.head_dim, shape.index_dim
    c4_state = [torch.randn(c4s.num_blocks, shape.c4_state_block, 4 * c, device=device) for _ in range(n_csa)]
    c4_idx_state = [torch.randn(c4s.num_blocks, shape.c4_state_block, 4 * ci, device=device) for _ in range(n_csa)]
    c128_state = [torch.randn(c128s.num_blocks, shape.c128_state_block, 2 * c, device=device) for _ in range(n_hca)]
    add("csa_state", c4_state)
    add("csa_idx_state", c4_idx_state)
    add("hca_state", c128_state)
    e4_blocks = e4.num_blocks + -(-r // epb4)  # canonical + scratch
    e128_blocks = e128.num_blocks + -(-r // epb128)
    dv, sv = split(pages(e4_blocks, epb4, kvd, 8, n_csa), epb4, kvd, 8)
    add("csa_entries.data", dv)
    add("csa_entries.scale", sv)
    dv, sv = split(pages(e4_blocks, epb4, ci, 4, n_csa), epb4, ci, 4)
    add("idx_keys.data", dv)
    add("idx_keys.scale", sv)
    dv, sv = split(pages(e128_blocks, epb128, kvd, 8, n_hca), epb128, kvd, 8)
    add("hca_entries.data", dv)
    add("hca_entries.scale", sv)

    # compressor inputs (state caches as flat [slots, 2 coff d] fp32 rows; entries out in bf16)
    def flat(t):
        return t.view(-1, t.shape[-1])

    case.compress = {
        "csa": [(flat(s), 4, c, shape.rope_dim) for s in c4_state],
        "csa_idx": [(flat(s), 4, ci, shape.rope_dim) for s in c4_idx_state],
        "hca": [(flat(s), m128, c, shape.rope_dim) for s in c128_state],
        "out_c": torch.empty(e4_blocks * epb4 + e128_blocks * epb128, c, dtype=torch.bfloat16, device=device),
        "out_ci": torch.empty(e4_blocks * epb4, ci, dtype=torch.bfloat16, device=device),
        "norm_c": torch.ones(c, device=device),
        "norm_ci": torch.ones(ci, device=device),
    }
    from vllm_tree_spec.kernels.dsv4_compress_launch import rope_cos_sin_table

    case.compress["cos_sin"] = rope_cos_sin_table(160000.0, shape.rope_dim, end + 1, device=device)
    case.outs = {
        "swa": (torch.empty(r, shape.window, dtype=torch.int32, device=device),
                torch.empty(r, dtype=torch.int32, device=device)),
        "g4": (torch.empty(r, 8, dtype=torch.int32, device=device), torch.empty(r, dtype=torch.int32, device=device)),
        "g128": (torch.empty(r, m128, dtype=torch.int32, device=device),
                 torch.empty(r, dtype=torch.int32, device=device)),
        "topk": (torch.empty_like(case.topk_ids), torch.empty(r, dtype=torch.int32, device=device)),
    }  # fmt: skip
    return case


# ---------------------------------------------------------------------------
# The step's work


def run_meta(case: Case) -> dict:
    from vllm_tree_spec.kernels.dsv4_tree_meta_launch import (tree_entry_slots_triton, tree_topk_slots_triton,
                                                              tree_window_slots_triton)  # fmt: skip

    s, rows = case.shape, case.rows
    out = {"swa": tree_window_slots_triton(rows, case.swa_row_slots, case.swa.table, s.swa_block, s.window,
                                           align="left", out=case.outs["swa"])}  # fmt: skip
    out["g4"] = tree_window_slots_triton(rows, case.c4_row_slots, case.c4s.table, s.c4_state_block, 8,
                                         align="position", out=case.outs["g4"])  # fmt: skip
    out["g128"] = tree_window_slots_triton(rows, case.c128_row_slots, case.c128s.table, s.c128_state_block,
                                           s.hca_ratio, align="position", out=case.outs["g128"])  # fmt: skip
    out["e4"] = tree_entry_slots_triton(rows, case.e4_own, case.e4.table, case.e4.block, 4, root_committed=True)
    out["e128"] = tree_entry_slots_triton(rows, case.e128_own, case.e128.table, case.e128.block, s.hca_ratio,
                                          root_committed=True, dense_width=case.hca_width)  # fmt: skip
    for _ in range(s.count("csa")):  # per layer: the indexer's top-k ids differ per layer
        out["topk"] = tree_topk_slots_triton(rows, case.topk_ids, out["e4"], case.e4.table, case.e4.block,
                                             out=case.outs["topk"])  # fmt: skip
    return out


def run_commit(case: Case, meta: dict) -> None:
    from vllm_tree_spec.kernels.dsv4_tree_meta_launch import tree_commit_rows_triton

    s, rows, acc, num = case.shape, case.rows, case.acc, case.num
    plan = [("swa_kv.data", case.swa_row_slots, case.swa, 1), ("swa_kv.scale", case.swa_row_slots, case.swa, 1),
            ("csa_state", case.c4_row_slots, case.c4s, 1), ("csa_idx_state", case.c4_row_slots, case.c4s, 1),
            ("hca_state", case.c128_row_slots, case.c128s, 1),
            ("csa_entries.data", meta["e4"].write, case.e4, 4), ("csa_entries.scale", meta["e4"].write, case.e4, 4),
            ("idx_keys.data", meta["e4"].write, case.e4, 4), ("idx_keys.scale", meta["e4"].write, case.e4, 4),
            ("hca_entries.data", meta["e128"].write, case.e128, s.hca_ratio),
            ("hca_entries.scale", meta["e128"].write, case.e128, s.hca_ratio)]  # fmt: skip
    for name, src, alias, ratio in plan:
        views, table, paged = case.caches[name]
        if views:
            tree_commit_rows_triton(views, rows, src, alias.table, alias.block, acc, num, ratio=ratio, paged=paged,
                                    layer_table=table)  # fmt: skip


def run_compress(case: Case, meta: dict) -> None:
    from vllm_tree_spec.kernels.dsv4_compress_launch import dsv4_compress_triton

    cp, pos = case.compress, case.rows.positions
    for key, gather, write, out, norm in (("csa", meta["g4"][0], meta["e4"].write, cp["out_c"], cp["norm_c"]),
                                          ("csa_idx", meta["g4"][0], meta["e4"].write, cp["out_ci"], cp["norm_ci"]),
                                          ("hca", meta["g128"][0], meta["e128"].write, cp["out_c"], cp["norm_c"])):
        for state, ratio, d, _ in cp[key]:
            coff = 2 if ratio == 4 else 1
            dsv4_compress_triton(out, state[:, : coff * d], state[:, coff * d :], gather, pos, write, norm,
                                 cp["cos_sin"], ratio=ratio, eps=1e-6)  # fmt: skip


def commit_bytes(case: Case) -> int:
    """Bytes read + written by the commit (rows that actually move)."""
    s = case.shape
    a = int(case.num[0])
    P = case.context - 2
    moved_rows = sum(1 for k, node in enumerate([-1] + case.acc[0, :a].tolist()) if node + 1 != k)
    per_row = (len(s.kinds) * (s.kv_data_bytes + 8) + s.count("csa") * 4 * (4 * s.head_dim + 4 * s.index_dim)
               + s.count("hca") * 4 * 2 * s.head_dim)  # fmt: skip
    e4 = sum(1 for k in range(a + 1) if (P + k + 1) % 4 == 0 and k > 0)
    e128 = sum(1 for k in range(a + 1) if (P + k + 1) % s.hca_ratio == 0 and k > 0)
    per_req = (moved_rows * per_row + e4 * s.count("csa") * (s.kv_data_bytes + 8 + s.index_dim + 4)
               + e128 * s.count("hca") * (s.kv_data_bytes + 8))  # fmt: skip
    return 2 * case.batch * per_req


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
    out = {"total_ms": total * 1e3, **{k + "_ms": v * 1e3 for k, v in terms.items()}}
    cache[key] = out
    return out


def bf16_matmul_tflops(device, timer, quick: bool) -> float:
    n = 256 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    b = torch.randn_like(a)
    ms = timer(lambda: a @ b, timer.modes[0])
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------
# Correctness gate (kernels vs twins at the benchmark's layout, one small case)


def correctness(shape: V4Shape, device) -> list[dict]:
    from vllm_tree_spec.kernels.dsv4_compress_launch import dsv4_compress_reference
    from vllm_tree_spec.kernels.dsv4_tree_meta_launch import (DSV4TreeRows, tree_commit_rows_reference,
                                                              tree_entry_slots_reference, tree_topk_slots_reference,
                                                              tree_window_slots_reference)  # fmt: skip

    case = make_case(shape, 3, "binary15", 2 * shape.hca_ratio + 1, device, seed=1)
    meta = run_meta(case)
    r = case.rows
    rc = DSV4TreeRows(*(t.cpu() for t in (r.row_req, r.parent_rows, r.depth, r.start, r.cu_num_rows)), r.max_depth)
    s = shape
    checks = []

    def eq(name, got, want):
        checks.append({"check": name, "identical": bool(torch.equal(got.cpu(), want.cpu())), "gate": True})

    w = tree_window_slots_reference(rc, case.swa_row_slots.cpu(), case.swa.table.cpu(), s.swa_block, s.window)
    eq("SWA window list", meta["swa"][0], w[0])
    g = tree_window_slots_reference(rc, case.c128_row_slots.cpu(), case.c128s.table.cpu(), s.c128_state_block,
                                    s.hca_ratio, align="position")  # fmt: skip
    eq("HCA pooling gather", meta["g128"][0], g[0])
    e = tree_entry_slots_reference(rc, case.e128_own.cpu(), case.e128.table.cpu(), case.e128.block, s.hca_ratio,
                                   root_committed=True, dense_width=case.hca_width)  # fmt: skip
    eq("HCA entry list", meta["e128"].dense, e.dense)
    e4 = tree_entry_slots_reference(rc, case.e4_own.cpu(), case.e4.table.cpu(), case.e4.block, 4,
                                    root_committed=True)  # fmt: skip
    eq("CSA write slots", meta["e4"].write, e4.write)
    t = tree_topk_slots_reference(rc, case.topk_ids.cpu(), e4, case.e4.table.cpu(), case.e4.block)
    eq("CSA top-k slots", meta["topk"][0], t[0])
    # commit on a copy of the first SWA layer's data view vs the reference
    views, _, _ = case.caches["swa_kv.data"]
    ref = views[0].cpu().clone()
    tree_commit_rows_reference(ref, rc, case.swa_row_slots.cpu(), case.swa.table.cpu(), s.swa_block, case.acc.cpu(),
                               case.num.cpu(), paged=True)  # fmt: skip
    run_commit(case, meta)
    eq("commit (SWA KV rows)", views[0], ref)
    # compressor vs twin: the last HCA layer (every HCA layer writes the same output slots, the last one wins)
    cp = case.compress
    state, ratio, d, _ = cp["hca"][-1]
    want = cp["out_c"].clone().float().cpu()
    dsv4_compress_reference(want, state[:, :d].cpu(), state[:, d:].cpu(), meta["g128"][0].cpu(), rc.positions,
                            meta["e128"].write.cpu(), cp["norm_c"].cpu(), cp["cos_sin"].cpu(), ratio=ratio,
                            eps=1e-6)  # fmt: skip
    run_compress(case, meta)
    got = cp["out_c"].float().cpu()
    rows = (meta["e128"].write >= 0).nonzero().flatten().cpu()
    slots = meta["e128"].write.cpu().long()[rows]
    ok = bool(torch.allclose(got[slots], want[slots], atol=3e-2, rtol=3e-2)) and rows.numel() > 0
    checks.append({"check": "HCA compressor vs twin (bf16 out)", "identical": ok, "gate": True})
    for c in checks:
        c["ok"] = c["identical"]
    return checks


# ---------------------------------------------------------------------------
# Driver


def run(quick: bool = False, out_dir: str | Path | None = None, time_budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Run the benchmark; write bench_dsv4_tree.{json,md} into out_dir; return the JSON dict."""
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
    budget = min(float(time_budget_s), DEFAULT_BUDGET_S)
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
        "workload": "P = context - 2 (depth 1 completes HCA + CSA blocks), deepest path accepted, vLLM row slots",
    }
    if device.type == "cpu":
        meta["warning"] = ("CPU + Triton interpreter: smoke test of the script only, not performance numbers "
                           "(no GPU was available when this report was produced)")  # fmt: skip
    meta["copy_gbps"] = copy_bandwidth_gbps(device, timer, quick)
    meta["bf16_tflops"] = bf16_matmul_tflops(device, timer, quick)
    checks = correctness(shape, device)
    results, skipped, step_cache = [], [], {}
    for context in grid["context"]:
        for batch in grid["batch"]:
            for tree_name in grid["tree"]:
                key = {"batch": batch, "tree": tree_name, "context": context}
                if time.perf_counter() - t_start > budget:
                    skipped.append(key)
                    continue
                case = make_case(shape, batch, tree_name, context, device, seed=batch + context)
                m0 = run_meta(case)
                providers: dict[str, Callable[[], object]] = {
                    "meta": lambda: run_meta(case),
                    "commit": lambda: run_commit(case, m0),
                    "meta+commit": lambda: run_commit(case, run_meta(case)),
                    "compress": lambda: run_compress(case, m0),
                }
                for tmode in timer.modes:
                    row = {**key, "timer": tmode, "rows": case.num_rows, "accepted": int(case.num[0]),
                           "commit_bytes": commit_bytes(case)}  # fmt: skip
                    for name, fn in providers.items():
                        try:
                            row[name + "_ms"] = timer(fn, tmode)
                        except Exception as e:  # record and go on
                            row[name + "_ms"] = None
                            row.setdefault("notes", []).append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
                    try:
                        step = verify_step_lower_bound(shape, batch, case.num_rows, context, device, timer,
                                                       timer.modes[0], meta["copy_gbps"], meta["bf16_tflops"],
                                                       step_cache)  # fmt: skip
                    except Exception as e:
                        step = {"total_ms": None, "note": f"{type(e).__name__}: {str(e)[:160]}"}
                    row["verify_step"] = step
                    st_ms = step.get("total_ms")
                    if st_ms and row.get("meta+commit_ms") is not None:
                        row["pct_meta_commit"] = 100 * row["meta+commit_ms"] / st_ms
                        row["pct_meta_commit_tp8"] = 800 * row["meta+commit_ms"] / st_ms
                        if row.get("compress_ms") is not None:
                            row["pct_incl_compress"] = 100 * (row["meta+commit_ms"] + row["compress_ms"]) / st_ms
                    results.append(row)
                del case
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    meta["elapsed_s"] = time.perf_counter() - t_start
    report = {"meta": meta, "correctness": checks, "results": results, "skipped_over_budget": skipped}
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
        "# DeepSeek-V4 tree metadata, compressor and commit vs a V4-Flash-shaped verify step",
        "",
        f"- device: {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, interpreter: "
        f"{meta['interpreter']})",
        f"- model: {meta['shape']}",
        f"- workload: {meta['workload']}",
        f"- measured copy bandwidth {meta['copy_gbps']:.1f} GB/s, matmul {meta['bf16_tflops']:.1f} TFLOP/s; "
        f"elapsed {meta['elapsed_s']:.1f} s (budget {meta['time_budget_s']:.0f} s)",
        "- verify step = lower bound (see the module docstring), so every % below is an upper bound; "
        "'TP-8 %' = against step / 8",
    ]
    if "warning" in meta:
        lines += ["", f"**{meta['warning']}**"]
    gate = report["correctness"]
    verdict = "PASS" if all(c["ok"] for c in gate) else "FAIL"
    lines += ["", f"Correctness gate (kernels vs PyTorch twins at this layout): {verdict} "
              f"({', '.join(c['check'] for c in gate)})"]  # fmt: skip
    for tmode in meta["timer_modes"]:
        lines += ["", f"## {tmode} (ms per step, whole model)", ""]
        lines.append("| ctx | B | tree | rows | meta | commit | meta+commit | compress | step LB | % meta+commit "
                     "| TP-8 % | % incl. compress | commit MB |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in report["results"]:
            if r["timer"] != tmode:
                continue
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['tree']} | {r['rows']} | {_f(r.get('meta_ms'))} "
                f"| {_f(r.get('commit_ms'))} | {_f(r.get('meta+commit_ms'))} | {_f(r.get('compress_ms'))} "
                f"| {_f(r['verify_step'].get('total_ms'), '{:.3f}')} | {_f(r.get('pct_meta_commit'), '{:.2f}')} "
                f"| {_f(r.get('pct_meta_commit_tp8'), '{:.2f}')} | {_f(r.get('pct_incl_compress'), '{:.2f}')} "
                f"| {r['commit_bytes'] / 1e6:.2f} |")  # fmt: skip
    first = next((r for r in report["results"] if r["verify_step"].get("total_ms")), None)
    if first:
        lines += ["", "Verify-step lower bound, terms of the first row (ms): "
                  + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in first["verify_step"].items()
                              if k.endswith("_ms") and k != "total_ms")]  # fmt: skip
    notes = [n for r in report["results"] for n in r.get("notes", [])]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in dict.fromkeys(notes)]
    if report["skipped_over_budget"]:
        lines += ["", f"Skipped (time budget): {report['skipped_over_budget']}"]
    return "\n".join(lines) + "\n"
