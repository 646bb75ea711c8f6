"""Tree runs of the emulated NVIDIA DeepSeek-V4 engine, and what they are compared with.

* `tree_engine` / `run_tree`: the emulated engine (nvidia_harness) with `{"method": "tree", ...}`, optionally a
  test drafter (dsv4_harness.OracleTreeDrafter, injected through `proposer.make_drafter`) and callbacks on
  the live engine.
* `snapshot_nv(runner, req_index, length)`: every position-addressed store of one request, read through
  vLLM's block tables with the reference pack's byte layout (pooled, padded pages): SWA rows of the window,
  compressor state rows of the last pooling window, C4 / C128 entries, indexer keys; fp8 rows as 584 / 132 raw
  bytes (the format dsv4_harness.code_steps compares dequantized), state rows as float32.
* `record_base_snapshots` (engine without speculation: each request's stores after every step) and
  `record_tree_steps` (tree engine: every tree step's rows as log-probs, the accepted paths, and each
  request's stores after every refresh).
* `sequential_logprobs`: vLLM without speculation on context + path of every recorded node (the per-node
  reference).
* `plan_digests`, `cache_digests`, `tp_probe_report`: sha256 digests of a tree step's plan (host half, device
  half, the lists written into vLLM's metadata) and of every KV-cache tensor, computed inside each TP worker
  (test_tree_engine_tp.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import dsv4_harness
import nvidia_harness as H
from dsv4_harness import TreeRecord, worker_runner  # noqa: F401  (re-exported to the tests)


@dataclass
class TreeRun:
    outputs: list[list[int]]
    logprobs: list[list[float]]
    adapter_stats: dict
    tree_stats: dict
    adapter: str


@contextlib.contextmanager
def drafter(factory):
    """Replace the tree drafter (in-process engines only)."""
    from vllm_tree_spec.integration import proposer as proposer_mod

    orig = proposer_mod.make_drafter
    if factory is not None:
        proposer_mod.make_drafter = lambda cfg, vllm_config=None, **_: factory(cfg)
    try:
        yield
    finally:
        proposer_mod.make_drafter = orig


def run_tree(model: str, prompts, params, spec: dict, *, drafter_factory=None, on_llm=None, **engine_kwargs):
    with drafter(drafter_factory), H.nvidia_engine(model, speculative_config=spec, **engine_kwargs) as llm:
        try:
            if on_llm is not None:
                on_llm(llm)
            run = H.generate(llm, prompts, params)
            r = worker_runner(llm)
            return TreeRun(run.outputs, run.logprobs, dict(r.tree_adapter.stats), r.tree_stats.as_dict(),
                           type(r.tree_adapter).__name__)
        finally:
            restore = getattr(llm, "_tree_spec_restore", None)
            if restore is not None:
                restore()


# ---------------------------------------------------------------------------
# Snapshots (reference pack layout: vllm_tree_spec/reference/dsv4_gpu_ops/layout.py)


def _slots(bt_row: torch.Tensor, block_size: int, idx: torch.Tensor) -> torch.Tensor:
    return bt_row[idx // block_size].to(torch.long) * block_size + idx % block_size


def _fp8_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from vllm_tree_spec.reference.dsv4_gpu_ops import layout

    data, scale = layout.read_rows(cache, slots, cache.shape[1])
    return torch.cat([data, scale], dim=1)


def _key_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from vllm_tree_spec.reference.dsv4_gpu_ops import layout

    vals, scale = layout.read_index_keys(cache, slots, cache.shape[1])
    return torch.cat([vals.to(torch.float8_e4m3fn).view(torch.uint8), scale.contiguous().view(torch.uint8)
                      .view(-1, 4)], dim=1)


def snapshot_nv(runner, req_index: int, length: int) -> dict[str, torch.Tensor]:
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    ctx = runner.compilation_config.static_forward_context
    snap = {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        bt = runner.input_batch.block_table[gid].block_table.gpu[req_index]
        bs = group.kv_cache_spec.block_size
        for name in group.layer_names:
            layer = ctx[name]
            kv = layer.kv_cache
            if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
                continue
            if isinstance(layer, DeepseekV4SWACache):
                pos = torch.arange(max(0, length - layer.window_size), length)
                snap[name] = _fp8_rows(kv, _slots(bt, bs, pos))
            elif isinstance(layer, CompressorStateCache):
                pos = torch.arange(max(0, length - layer.sliding_window), length)
                s = _slots(bt, bs, pos)
                snap[name] = kv[s // bs, s % bs].clone()
            elif isinstance(layer, DeepseekV4Attention):
                w = torch.arange(length // layer.compress_ratio)
                snap[name] = _fp8_rows(kv, _slots(bt, bs // layer.compress_ratio, w))
            elif isinstance(layer, DeepseekV4IndexerCache):
                w = torch.arange(length // 4)
                snap[name] = _key_rows(kv, _slots(bt, bs // 4, w))
    return snap


def record_base_snapshots(store: dict):
    """on_llm: after every step of an engine without speculation, each request's stores (snapshot_nv), keyed
    (request index, L) with L the tokens whose rows are in the cache (dsv4_harness.record_base_snapshots)."""
    return dsv4_harness.record_base_snapshots(store, snapshot=snapshot_nv)


def record_tree_steps(records: list, snaps: dict | None = None, after_commit=None):
    """on_llm: every tree step's rows (log-probs) and accepted path; with snaps, each request's stores after
    every refresh (key (request index, root_pos + 1 + accepted)); after_commit(runner, step, result) runs
    after each refresh (planted controls)."""

    def on_llm(llm):
        from dsv4_harness import row_starts

        from vllm_tree_spec.integration import runner as runner_mod

        runner = worker_runner(llm)
        adapter = runner.tree_adapter
        real_tree_sample = runner_mod.tree_sample
        pending: dict[str, TreeRecord] = {}

        def tree_sample(rnr, logits, spec_meta, step):
            starts = row_starts(spec_meta)
            for r in step.requests:
                rows = logits[starts[r.req_index]: starts[r.req_index] + r.num_nodes + 1].float()
                ctx = rnr.input_batch.token_ids_cpu[r.req_index, : r.root_pos + 1].tolist()
                rec = TreeRecord(int(r.req_id.split("-")[0]), r.root_pos, ctx, r.tree.parents.tolist(),
                                 r.tree.tokens.tolist(), rows.log_softmax(-1))
                records.append(rec)
                pending[r.req_id] = rec
            return real_tree_sample(rnr, logits, spec_meta, step)

        orig_commit = adapter.commit

        def commit(rnr, step, result):
            n = orig_commit(rnr, step, result)
            acc, num = result.accepted_nodes.tolist(), result.num_accepted.tolist()
            if after_commit is not None:
                after_commit(rnr, step, result)
            for req, a, k in zip(step.requests, acc, num):
                path = a[:k]
                if req.req_id in pending:
                    pending.pop(req.req_id).accepted = list(path)
                if snaps is not None:
                    length = req.root_pos + 1 + len(path)
                    snaps[(int(req.req_id.split("-")[0]), length)] = snapshot_nv(rnr, req.req_index, length)
            return n

        runner_mod.tree_sample = tree_sample
        adapter.commit = commit
        llm._tree_spec_restore = lambda: setattr(runner_mod, "tree_sample", real_tree_sample)

    return on_llm


def leaf_paths(rec: TreeRecord) -> list[list[int]]:
    n = len(rec.tokens)
    children = {i: [] for i in range(-1, n)}
    for i, p in enumerate(rec.parents):
        children[p].append(i)
    out = []
    for leaf in [i for i in range(n) if not children[i]] or ([] if n else [-1]):
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = rec.parents[j]
        out.append(path[::-1])
    return out


def forced_decode(model: str, jobs: list[tuple[list[int], list[int]]], **engine_kwargs) -> list[torch.Tensor]:
    """vLLM without speculation decoding given tokens one by one (the decode path, as a tree's rows are).

    Job (context, path): the prompt is context[:-1]; the engine is made to sample context[-1], then each token
    of the path; returns per job the log-softmax of the rows after context + path[:d], d = 0 .. len(path)
    ([len(path) + 1, V]), each computed by a one-token decode step over the caches the stock engine wrote.
    """
    from vllm import SamplingParams

    forced: dict[str, list[int]] = {}
    rows: dict[str, list[torch.Tensor]] = {}

    def on_llm(llm):
        runner = worker_runner(llm)
        orig = runner._sample

        def _sample(logits, spec_decode_metadata):
            todo = []
            for i, full_id in enumerate(runner.input_batch.req_ids):
                rid = full_id.split("-")[0]  # vLLM appends a suffix to the id given to add_request
                f = forced.get(rid)
                if f is None:
                    continue
                k = len(rows[rid])  # tokens forced so far
                # every step after the prefill decodes the previously forced token (read before the sampler,
                # which may edit the logits in place)
                rows[rid].append(logits[i].float().log_softmax(-1).cpu() if k else None)
                if k < len(f):
                    todo.append((i, f[k]))
            out = orig(logits, spec_decode_metadata)
            for i, t in todo:
                out.sampled_token_ids[i, 0] = t
            return out

        runner._sample = _sample

    kwargs = dict(max_num_seqs=8)
    kwargs.update(engine_kwargs)
    with H.nvidia_engine(model, **kwargs) as llm:
        on_llm(llm)
        ids = []
        for n, (ctx, path) in enumerate(jobs):
            rid = str(n)
            forced[rid] = [ctx[-1]] + list(path)
            rows[rid] = []
            ids.append(rid)
            llm.llm_engine.add_request(rid, {"prompt_token_ids": ctx[:-1]},
                                       SamplingParams(temperature=0, max_tokens=len(path) + 2, ignore_eos=True))
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    return [torch.stack(rows[rid][1:]) for rid in ids]


def sequential_logprobs(model: str, records: list[TreeRecord], top_k: int, **engine_kwargs) -> dict:
    """(record index, row) -> {token: logprob} (top-K) of vLLM without speculation decoding context + path."""
    jobs, where = [], []
    for ri, rec in enumerate(records):
        for path in leaf_paths(rec):
            jobs.append((rec.context, [rec.tokens[j] for j in path]))
            where.append((ri, path))
    res = forced_decode(model, jobs, **engine_kwargs)
    seq = {}
    for (ri, path), lp in zip(where, res):
        for d, node in enumerate([-1] + path):
            v, t = lp[d].topk(top_k)
            seq[(ri, node + 1)] = dict(zip(t.tolist(), v.tolist()))
    return seq


def node_errors(records: list[TreeRecord], seq: dict, top_k: int, tie: float) -> tuple[torch.Tensor, int]:
    """Per checked row: max |logprob difference| over the reference's top-K; and argmax mismatches that are not
    near-ties of the reference (top-2 gap > tie)."""
    errs, argmax_bad = [], 0
    for (ri, row), ref in seq.items():
        lp = records[ri].logprobs[row]
        top = sorted(ref, key=lambda t: -ref[t])[:top_k]
        errs.append(max(abs(float(lp[t]) - ref[t]) for t in top))
        gap = ref[top[0]] - ref[top[1]] if len(top) > 1 else float("inf")
        argmax_bad += int(lp.argmax()) != top[0] and gap > tie
    return torch.tensor(errs), argmax_bad


def block_crossings(records: list[TreeRecord]) -> dict[str, int]:
    """How many recorded nodes complete a C4 / C128 block, and how many C4 blocks were completed by two
    siblings (what isolation is for)."""
    c4 = c128 = same = 0
    for rec in records:
        depth = []
        for p in rec.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        pos = [rec.root_pos + d for d in depth]
        done4 = [(p + 1) // 4 for p in pos if (p + 1) % 4 == 0]
        c4 += len(done4)
        c128 += sum((p + 1) % 128 == 0 for p in pos)
        same += len(done4) - len(set(done4))
    return {"c4": c4, "c128": c128, "same_block": same}


def emitted_logprob_deltas(a_out, a_lp, b_out, b_lp) -> list[float]:
    """|log-prob difference| of every emitted token on the shared prefix of two runs' outputs."""
    from dsv4_harness import first_difference

    out = []
    for oa, la, ob, lb in zip(a_out, a_lp, b_out, b_lp):
        j = first_difference(oa, ob)
        n = len(oa) if j is None else j
        out += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
    return out


# The emulated engine's own rounding floor, measured with the numerics control (trees whose nodes are all wrong:
# only root rows, computed with vLLM's own lists in multi-row verify steps, are emitted and committed): fp32 GEMMs
# on the CPU round differently for different batch shapes (the compressor projections, mHC, the MoE gate), so a
# row computed in a 9-row step can differ from one computed in a 1-row step (rarely the MoE routing flips and a
# whole hidden state moves: fp32 state rows up to 0.10 relative, emitted log-probs up to 0.023). fp8 rows keep the
# dsv4_harness tolerance (5 % of values more than one code step apart); fp32 state rows are held to 0.25 of the
# row's magnitude: a row of another branch or a stale one is 1.6-2.0 away (the negative controls).
STATE_REL_TOL = 0.25


def snapshot_mismatches(a: dict, b: dict) -> dict[str, float]:
    from dsv4_harness import ROW_STEP_TOL, compare_snapshots

    return {k: v for k, v in compare_snapshots(a, b).items()
            if v > (ROW_STEP_TOL if a[k].dtype == torch.uint8 else STATE_REL_TOL)}


def store_verdict(stock_outputs, stock_snaps: dict, tree_outputs, tree_snaps: dict) -> dict:
    """Greedy identity and the stores after every refresh of a tree run against the stock run (the refresh
    points both recorded)."""
    common = [k for k in tree_snaps if k in stock_snaps]
    bad = {k: d for k in common if (d := snapshot_mismatches(stock_snaps[k], tree_snaps[k]))}
    worst = max((v for d in bad.values() for v in d.values()), default=0.0)
    return {"greedy_identical": tree_outputs == stock_outputs, "points": len(common), "bad_points": len(bad),
            "bad_stores": sorted({s for d in bad.values() for s in d}), "worst": worst}


@dataclass
class RowError:
    """One checked row of a recorded tree step against sequential decoding."""

    record: int
    row: int  # 0 = root, 1 + i = node i
    depth: int
    top1: float  # |logprob difference| of the reference's argmax token
    prob: float  # max |probability difference| over the reference's top-K
    topk: float  # max |logprob difference| over the reference's top-K (low-probability tokens dominate)
    argmax_off: bool  # argmax differs from the reference's where its top-2 gap exceeds the tie margin
    in_tree_entry: dict  # ratio -> whether an ancestor-or-self draft node completes a block of that ratio


def row_errors(records: list[TreeRecord], seq: dict, tie: float, ratios=(4, 128)) -> list[RowError]:
    """Per row of `sequential_logprobs`' reference: the differences a per-node check reads. Rows below a draft
    node that completes a block read that entry from the tree's scratch (what the entry lists are for)."""
    import math

    out = []
    for (ri, row), ref in sorted(seq.items()):
        rec = records[ri]
        lp = rec.logprobs[row]
        top = sorted(ref, key=lambda t: -ref[t])
        path, j = [], row - 1
        while j >= 0:
            path.append(j)
            j = rec.parents[j]
        pos = [rec.root_pos + d for d in range(1, len(path) + 1)]  # the path's draft nodes, by depth
        gap = ref[top[0]] - ref[top[1]] if len(top) > 1 else float("inf")
        out.append(RowError(
            ri, row, len(path), abs(float(lp[top[0]]) - ref[top[0]]),
            max(abs(math.exp(float(lp[t])) - math.exp(ref[t])) for t in top),
            max(abs(float(lp[t]) - ref[t]) for t in top), int(lp.argmax()) != top[0] and gap > tie,
            {m: any((p + 1) % m == 0 for p in pos) for m in ratios}))
    return out


# ---------------------------------------------------------------------------
# Tensor parallelism: digests of what each rank holds (computed inside the workers; test_tree_engine_tp.py)

# Plan fields left out of a digest: the runner's TreeStep (the host half holds what the plan took from it), the
# per-layer virtual cos/sin tables (keyed by data_ptr, a per-process address; the tables are derived from the
# digested cos_src / cos_dst rows) and the C4 top-k call counter (the forward increments it).
PLAN_DIGEST_SKIP = frozenset({"step", "cos_tables", "topk_calls"})


def _feed(h, obj, skip=frozenset()) -> int:
    """Feed obj's bytes (tensors, arrays, dataclasses, containers, scalars) into hash h; returns the tensor /
    array bytes fed. Raises on a type it has no rule for, so nothing is silently left out."""
    import dataclasses

    import numpy as np

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        b = t.view(torch.uint8).numpy().tobytes()
        h.update(b)
        return len(b)
    if isinstance(obj, np.ndarray):
        b = np.ascontiguousarray(obj).tobytes()
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(b)
        return len(b)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(type(obj).__name__.encode())
        n = 0
        for f in dataclasses.fields(obj):
            if f.name not in skip:
                h.update(f.name.encode())
                n += _feed(h, getattr(obj, f.name), skip)
        return n
    if isinstance(obj, dict):
        n = 0
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            n += _feed(h, obj[k], skip)
        return n
    if isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        return sum(_feed(h, x, skip) for x in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, np.integer, np.floating)):
        h.update(repr(obj).encode())
        return 0
    raise TypeError(f"no digest rule for {type(obj).__name__}")


def digest(obj, skip=frozenset()) -> tuple[str, int]:
    import hashlib

    h = hashlib.sha256()
    n = _feed(h, obj, skip)
    return h.hexdigest(), n


def plan_metadata_lists(plan, md: dict, caches) -> dict[str, torch.Tensor]:
    """The decode rows of the lists a tree step's plan wrote into vLLM's metadata (device_plan.py): SWA window
    lists, entry write slots, the C128 list, the indexer's decode lengths and page table."""
    rd = plan.num_rows
    out = {}
    for g in caches.swa:
        m = md[g.layers[0]]
        out[f"swa{g.gid}.indices"] = m.decode_swa_indices[:rd]
        out[f"swa{g.gid}.lens"] = m.decode_swa_lens[:rd]
    for role, name in caches.metadata_keys.items():
        m = md[name]
        out[f"{role}.slot_mapping"] = m.slot_mapping[:rd]
        dense = getattr(m, "c128a_global_decode_topk_indices", None)
        if dense is not None:
            out[f"{role}.c128_list"] = dense[:rd]
            out[f"{role}.c128_lens"] = m.c128a_decode_topk_lens[:rd]
        dec = getattr(m, "decode", None)
        if role == "indexer" and dec is not None:
            out["indexer.seq_lens"] = dec.seq_lens.view(-1)[:rd]
            out["indexer.block_table"] = dec.block_table[:rd]
    return out


def plan_digests(plan, md: dict, caches) -> dict:
    """One tree step's plan on this rank: digests of its host half, its device half (every tensor it uploaded or
    built) and the lists it wrote into vLLM's metadata, with the bytes each covers."""
    host, host_b = digest(plan.host)
    dev, dev_b = digest(plan, PLAN_DIGEST_SKIP | {"host"})
    lists, lists_b = digest(plan_metadata_lists(plan, md, caches))
    return {"host": host, "device": dev, "metadata": lists, "bytes": host_b + dev_b + lists_b,
            "rows": int(plan.num_rows), "trees": len(plan.step.requests)}


def cache_digests(runner) -> dict[str, tuple[str, int]]:
    """Every KV-cache tensor of this rank (whole tensors, scratch blocks included: V4's caches are replicated
    across TP ranks): layer name -> (digest, bytes), and `allocation{i}` -> the same for each allocation the
    views live in."""
    ctx = runner.compilation_config.static_forward_context
    out, storages = {}, {}
    for group in runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            kv = getattr(ctx[name], "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0]
            if isinstance(kv, torch.Tensor) and kv.numel():
                out[name] = digest(kv)
                storages.setdefault(kv.untyped_storage().data_ptr(), kv.untyped_storage())
    # the views alias one pooled allocation (groups share blocks): also every allocation whole, padding included
    for i, st in enumerate(storages.values()):
        out[f"allocation{i}"] = digest(torch.empty(0, dtype=torch.uint8).set_(st))
    return out


# Filled in each worker by test_tree_engine_tp.py's probes: per tree step, plan_digests; per refresh,
# [request id, length, digest of snapshot_nv].
TP_PROBE: dict = {"plans": [], "refresh": []}


class _V2BlockRows:
    """V2's per-batch block tables (`BlockTables.input_block_tables`, batch order) in the shape `snapshot_nv`
    reads from V1's input batch."""

    def __init__(self, runner):
        self.runner = runner

    def __getitem__(self, gid):
        from types import SimpleNamespace

        return SimpleNamespace(block_table=SimpleNamespace(gpu=self.runner.block_tables.input_block_tables[gid]))


def snapshot_any(runner, req_index: int, length: int):
    """`snapshot_nv` on either runner (Model Runner V2 keeps its block tables outside an input batch)."""
    from types import SimpleNamespace

    if getattr(runner, "block_tables", None) is None:  # V1
        return snapshot_nv(runner, req_index, length)
    view = SimpleNamespace(compilation_config=runner.compilation_config, kv_cache_config=runner.kv_cache_config,
                           input_batch=SimpleNamespace(block_table=_V2BlockRows(runner)))
    return snapshot_nv(view, req_index, length)


def tp_probe_report(worker) -> dict:
    """collective_rpc target: this rank's probes, final cache digests and counters (timings left out)."""
    from vllm.distributed import get_tp_group

    runner = worker.model_runner
    adapter = getattr(runner, "tree_adapter", None)
    stats = getattr(runner, "tree_stats", None)
    untimed = lambda d: {k: v for k, v in d.items() if not k.endswith("_s")}  # noqa: E731
    drafter = getattr(getattr(runner, "drafter", None), "drafter", None)
    return {"rank": get_tp_group().rank_in_group, "plans": TP_PROBE["plans"], "refresh": TP_PROBE["refresh"],
            "runner": next(c.__module__ for c in type(runner).__mro__ if c.__module__.startswith("vllm.")),
            "drafter_head": type(getattr(drafter, "head", None)).__name__,
            "drafter_q_heads": getattr(getattr(getattr(drafter, "head", None), "cfg", None), "heads", None),
            "caches": cache_digests(runner), "adapter": type(adapter).__name__ if adapter is not None else None,
            "stats": untimed(adapter.stats) if adapter is not None else {},
            "tree_stats": untimed(stats.as_dict()) if stats is not None else {}}
