"""A DeepSeek-V4 tree step on vLLM's NVIDIA serving path, run without vLLM (bench_dsv4_tree.py's workload).

The runner's `TreeStep` (trees of B decode requests), vLLM's metadata for the step as SimpleNamespaces with
the fields the NVIDIA adapter's `device_plan` reads and writes (stock slot mappings and block tables over
vLLM's linear positions, decode list buffers), and the caches as `Dsv4NvidiaCaches` of views into pooled
allocations with vLLM's layout (block-outermost; fp8_ds_mla and FP8-key pages padded to a multiple of 576
bytes). The step's work is the serving path's own code: `host_plan`, `device_plan`, the per-layer launches
of the layer overrides (hooks.py N2-N4) and the refresh `adapter.commit` launches. Also: counting a call's
launches and a capturable stand-in for `device_plan`'s upload.

Layout assumption: vLLM groups the SWA window caches by the layers that share a block table; two groups here
(SWA-only + HCA layers, CSA layers), as in caches.py's example.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

CSA, HCA = 4, 128

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
    from vllm_tree_spec.integration.dsv4.nvidia.device_plan import refresh_copy_plan
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
    kinds = shape.kinds
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
    case.refresh = refresh_copy_plan(caches)  # the adapter's own (built once after allocation)
    case.state_scratch = StateScratch()
    return case


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
