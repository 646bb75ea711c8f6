"""Tree speculation on vLLM 0.32's emulated NVIDIA DeepSeek-V4 path past the CSA indexer's short-context bypass.

Prompts of LONG_PROMPTS tokens hold more C4 entries than index_topk (512), so every CSA layer of every verify
step runs the lightning indexer: the builder's flattened decode rows (N6), the DeepGEMM schedule, the paged MQA
logits over the indexer keys, the radix top-k and the tree's top-k mapping (N2). A tree row whose path holds a
draft node that completes a C4 block reads that node's indexer key from a virtual page (the canonical page with
the path's keys overlaid, N4); the adapter rewrites the rows' indexer `seq_lens` to their depth positions and
rebuilds the DeepGEMM schedule for them (N7). Oracle trees as in test_tree_engine.py; the generated tokens cross
C4 blocks and the C128 boundary at 2175.

* greedy output identical to the same engine without speculation, and every store of the request after every
  refresh equal to it (test_tree_engine.py's comparisons);
* tree steps really took the long-context path: per tree step, the plan's virtual pages, the schedule rebuilt
  inside the adapter, the paged MQA logits op run in the forward (nvidia_harness.OpCalls), and the indexer's
  decode `seq_lens` of every row equal to `(t + 1) // 4` at its depth position t;
* negative controls planted in the adapter (test-local), each rejected:
  - `stale-schedule`: the adapter rewrites the rows' `seq_lens` but keeps the schedule vLLM's builder made for
    the query-order lengths: the reference pack's paged MQA logits op refuses it (`StaleScheduleError`) in the
    first tree step;
  - `no-path-keys`: virtual pages are built but get only the canonical page, not the path's keys (tree rows read
    the canonical slots of entries completed inside the tree, which nobody wrote): a row's top-k reads NaN logits
    inside its valid range and the engine refuses the step (the check also accepts a rejection by greedy
    identity, the stores or the emitted log-probs, should the unwritten bytes decode finite);
* wide, shallow trees (no draft node completes a C4 block, so no virtual page): every row's indexer length is
  still `(t + 1) // 4` at its depth position (vLLM's query-order lengths would let a row read C4 keys not yet
  written), and the run is identical to the stock engine's.

Not checked here: every node's row against sequential decoding (test_tree_engine_slow.py's per-node check):
vLLM disables prefix caching for MLA on the CPU platform, so each leaf path would be a fresh ~2100-token
prefill (~15 leaf paths, well over ten minutes); the emitted-token check covers the accepted rows, among them
rows below draft nodes that complete a C4 block (the rows that read virtual pages).

Slow (each prefill of a long prompt interprets vLLM's Triton kernels over ~2100 tokens): extended set only.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.extended]

LONG_PROMPTS = (2104, 2166)  # 526 / 541 C4 entries > index_topk 512; the second crosses C128 at 2175
MAX_TOKENS = 14
MAX_MODEL_LEN = 2240
SPEC = {"method": "tree", "drafter": "ngram", "num_speculative_tokens": 8}
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
EMITTED_LOGPROB_TOL = 5e-2  # test_tree_engine.py's bound (the emulation's batch-shape floor)


def prompts(seed=7):
    rng = random.Random(seed)
    return [[rng.randrange(7, 500) for _ in range(n)] for n in LONG_PROMPTS]


@pytest.fixture(scope="module")
def base(decisive_model):
    import nvidia_harness as H
    import nv_tree_harness as T
    from vllm import SamplingParams

    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    snaps: dict = {}
    with H.nvidia_engine(decisive_model, **ENGINE) as llm:
        T.record_base_snapshots(snaps)(llm)
        run = H.generate(llm, prompts(), params)
    print(f"stock run: {time.perf_counter() - t0:.0f} s")
    return params, run, snaps


# ---------------------------------------------------------------------------------------------------------------
# What each tree step ran


def track_steps(calls, steps: list):
    """on_llm (after record_tree_steps): per tree step, the ops counted by `calls` while the adapter built the
    plan (the schedule rebuild) and between the plan and the commit (the forward), the plan's indexer part, and
    whether the indexer's decode seq_lens match the rows' depth positions."""

    def on_llm(llm):
        from nv_tree_harness import worker_runner

        from vllm_tree_spec.integration.dsv4.nvidia.caches import CSA

        runner = worker_runner(llm)
        adapter = runner.tree_adapter
        orig_md, orig_commit = adapter.on_metadata, adapter.commit
        cur: dict = {}

        def on_metadata(rnr, step, md):
            before = Counter(calls.count)
            orig_md(rnr, step, md)
            plan = adapter.plan
            if plan is None:
                return
            rec = {"plan_ops": calls.count - before, "after_plan": Counter(calls.count),
                   "virtual_pages": len(plan.indexer.page_dst) if plan.indexer is not None else 0,
                   "nodes": len(plan.host.node_rows), "seq_lens_off": None}
            i_key = adapter.caches.metadata_keys.get("indexer")
            i_md = md[i_key] if i_key is not None else None
            if i_md is not None and i_md.decode is not None and i_md.max_seq_len // CSA > adapter.index_topk:
                got = i_md.decode.seq_lens.view(-1)[: plan.num_rows].tolist()
                want = ((plan.host.positions + 1) // CSA).tolist()
                rec["seq_lens_off"] = [(r, g, w) for r, (g, w) in enumerate(zip(got, want)) if g != w]
            cur["rec"] = rec
            steps.append(rec)  # recorded before the forward: a step that raises keeps its facts

        def commit(rnr, step, result):
            rec = cur.pop("rec", None)
            if rec is not None:
                rec["forward_ops"] = calls.count - rec.pop("after_plan")
            return orig_commit(rnr, step, result)

        adapter.on_metadata = on_metadata
        adapter.commit = commit

    return on_llm


def oracle_run(model, base, plant=None):
    """The oracle tree run, with the ops and per-step indexer facts recorded; an optional plant throughout."""
    import nvidia_harness as H
    import nv_tree_harness as T
    from dsv4_harness import OracleTreeDrafter

    params, run, _ = base
    truth = {tuple(p): o for p, o in zip(prompts(), run.outputs)}
    records, snaps, steps = [], {}, []
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if plant is not None:
            plant(stack)
        calls = stack.enter_context(H.OpCalls())

        def on_llm(llm):
            T.record_tree_steps(records, snaps)(llm)
            track_steps(calls, steps)(llm)

        tr = T.run_tree(model, prompts(), params, SPEC,
                        drafter_factory=lambda cfg: OracleTreeDrafter(truth, "random", seed=11, p_full=0.7),
                        on_llm=on_llm, **ENGINE)
    print(f"tree run: {time.perf_counter() - t0:.0f} s")
    return tr, records, snaps, steps, calls


@pytest.fixture(scope="module")
def tree(decisive_model, base):
    return oracle_run(decisive_model, base)


def verdict(base, tree) -> dict:
    from nv_tree_harness import store_verdict

    _, run, base_snaps = base
    tr, _, snaps, _, _ = tree
    return store_verdict(run.outputs, base_snaps, tr.outputs, snaps)


def passes(v: dict) -> bool:
    return v["greedy_identical"] and v["points"] >= 6 and v["bad_points"] == 0


# ---------------------------------------------------------------------------------------------------------------
# The unplanted run


def test_greedy_identical_and_stores_equal_stock(base, tree):
    import nv_tree_harness as T

    _, run, _ = base
    tr, records, _, steps, _ = tree
    v = verdict(base, tree)
    d = T.emitted_logprob_deltas(tr.outputs, tr.logprobs, run.outputs, run.logprobs)
    cross = T.block_crossings(records)
    print(f"long context: {v}; emitted |dlogprob| max {max(d):.2e} over {len(d)}; crossings {cross}; "
          f"adapter {tr.adapter_stats}; tree {tr.tree_stats}")
    assert tr.adapter == "DeepseekV4NvidiaTreeAdapter"
    assert passes(v), v
    assert len(d) == sum(map(len, run.outputs)) and max(d) <= EMITTED_LOGPROB_TOL
    assert cross["c4"] > 5 and cross["c128"] > 0 and cross["same_block"] > 0, cross
    assert tr.adapter_stats["emitters_c4"] > 0 and tr.adapter_stats["emitters_c128"] > 0
    assert tr.tree_stats["off_first_branch"] > 0


def test_tree_steps_took_the_long_context_path(tree):
    tr, _, _, steps, calls = tree
    paged = [s for s in steps if s["virtual_pages"]]
    print(f"{len(steps)} tree steps, {len(paged)} with virtual pages ({tr.adapter_stats['virtual_pages']} pages); "
          f"schedule shapes {sorted(calls.schedule_rows)}")
    assert tr.adapter_stats["virtual_pages"] > 0 and len(paged) >= 3
    assert all(s["seq_lens_off"] is not None for s in steps), "a tree step stayed in the short-context bypass"
    for s in paged:
        assert s["plan_ops"]["_get_paged_mqa_logits_metadata_impl"] == 1, s  # the rebuild for the tree rows
        assert s["forward_ops"]["_fp8_fp4_paged_mqa_logits_impl"] >= 2, s  # both CSA layers' indexer
    assert all(s["forward_ops"]["_fp8_fp4_paged_mqa_logits_impl"] >= 2 for s in steps), steps
    assert any(r > 2 for r, _ in calls.schedule_rows)  # flattened tree rows: one schedule row per query token


def test_indexer_seq_lens_follow_depth_positions(tree):
    """Every tree step past the bypass: each decode row's indexer length is the C4 entries visible at its
    depth position, `(t + 1) // 4`, not vLLM's query-order expansion `(P + i + 1) // 4`."""
    _, _, _, steps, _ = tree
    off = [(i, s["nodes"], s["virtual_pages"], s["seq_lens_off"]) for i, s in enumerate(steps) if s["seq_lens_off"]]
    print(f"steps with rows whose indexer seq_len is not (t + 1) // 4: {off}")
    assert not off, off


# ---------------------------------------------------------------------------------------------------------------
# Negative controls


def _set(stack, owner, name, value) -> None:
    orig = getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, orig)


def plant_stale_schedule(stack, acted):
    """The adapter writes the rows' seq_lens but keeps the schedule vLLM's builder made for its own lengths."""
    from vllm_tree_spec.integration.dsv4.nvidia.adapter import DeepseekV4NvidiaTreeAdapter

    real = DeepseekV4NvidiaTreeAdapter._schedule

    def schedule(self):
        fn, sms = real(self)
        acted["calls"] += fn is not None
        return None, sms

    _set(stack, DeepseekV4NvidiaTreeAdapter, "_schedule", schedule)


def plant_no_path_keys(stack, acted):
    """Virtual pages get the canonical page only: tree rows read the canonical keys of entries completed inside
    the tree (never written there: draft nodes' slots are -1)."""
    import dataclasses

    import numpy as np

    from vllm_tree_spec.integration.dsv4.nvidia import plan as plan_mod

    real = plan_mod._host_indexer

    def host_indexer(*args, **kwargs):
        ix, blocks = real(*args, **kwargs)
        acted["calls"] += len(ix.key_src)
        none = np.zeros(0, dtype=np.int64)
        return dataclasses.replace(ix, key_src=none, key_dst=none), blocks

    _set(stack, plan_mod, "_host_indexer", host_indexer)


def test_stale_schedule_is_refused(decisive_model, base):
    from vllm_tree_spec.reference.dsv4_gpu_ops.indexer import StaleScheduleError

    acted = {"calls": 0}
    with pytest.raises(Exception) as err:
        oracle_run(decisive_model, base, lambda stack: plant_stale_schedule(stack, acted))
    print(f"stale-schedule: plant acted {acted['calls']} times; {type(err.value).__name__}: {err.value}")
    assert acted["calls"] > 0
    assert isinstance(err.value, StaleScheduleError) or "StaleScheduleError" in repr(err.value) \
        or "rebuild the schedule" in str(err.value), repr(err.value)


def rejected(base, run) -> tuple[bool, dict]:
    """Whether the checks of the unplanted run reject a run: greedy identity, stores, emitted log-probs."""
    import nv_tree_harness as T

    _, stock, _ = base
    v = verdict(base, run)
    tr = run[0]
    d = T.emitted_logprob_deltas(tr.outputs, tr.logprobs, stock.outputs, stock.logprobs)
    v["emitted_max"] = max(d, default=0.0)
    return not passes(v) or v["emitted_max"] > EMITTED_LOGPROB_TOL, v


# The reference pack's top-k refuses a row whose logits are NaN inside its valid range: keys of slots nobody wrote
# (the emulation's stand-in for a GPU reading unwritten key bytes).
UNWRITTEN_KEY_READ = "reads NaN logits inside its valid range"


def run_or_error(fn):
    """(result, None) or (None, the exception) when it is the emulation refusing an unwritten key read."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001  (the engine re-raises the worker's error; matched by its message)
        if UNWRITTEN_KEY_READ not in str(e):
            raise
        return None, e


def test_no_path_keys_is_rejected(decisive_model, base):
    """Rejected either way: a row's indexer reads a key slot nobody wrote (refused inside the engine), or the
    output / stores / emitted log-probs differ from the stock engine's."""
    acted = {"calls": 0}
    run, err = run_or_error(lambda: oracle_run(decisive_model, base, lambda st: plant_no_path_keys(st, acted)))
    assert acted["calls"] > 0, "no-path-keys: the plant never acted"
    if err is not None:
        print(f"no-path-keys: plant dropped {acted['calls']} path keys; refused in the engine: {err}")
        return
    bad, v = rejected(base, run)
    print(f"no-path-keys: plant dropped {acted['calls']} path keys; {v}")
    assert bad, f"no-path-keys: the planted run passed greedy identity, the stores and the emitted log-probs {v}"


# ---------------------------------------------------------------------------------------------------------------
# Wide, shallow trees: rows whose query index runs past their depth, no draft node completing a C4 block


def shallow_wide_drafter(truth):
    """Oracle trees of depth <= the last position before the next C4 block completes, the true chain after
    wrong siblings of the root: no node completes a C4 block, and the true chain's query-order index exceeds its
    depth by the number of wrong siblings."""
    import torch
    from dsv4_harness import OracleTreeDrafter

    from vllm_tree_spec.drafters.base import TreeProposal, deterministic_mode
    from vllm_tree_spec.tree import Tree

    class ShallowWide(OracleTreeDrafter):
        def _propose(self, requests, budgets):
            out = []
            for r, b in zip(requests, budgets):
                mode = deterministic_mode(r.temperature)
                cont = self._continuation(list(r.token_ids))
                root = len(r.token_ids) - 1  # position P of the root row
                depth = 0
                while depth < min(len(cont), b) and (root + depth + 2) % 4:
                    depth += 1  # node at depth + 1 sits at P + depth + 1; stop before it completes a block
                if depth == 0:
                    out.append(TreeProposal.empty(mode))
                    continue
                wrong = [self._wrong({cont[0]}) for _ in range(b - depth)]
                parents = [-1] * len(wrong) + [-1] + [len(wrong) + d for d in range(depth - 1)]
                tokens = wrong + list(cont[:depth])
                out.append(TreeProposal(Tree(torch.tensor(parents, dtype=torch.long),
                                             torch.tensor(tokens, dtype=torch.long)), mode))
            return out

    return lambda cfg: ShallowWide(truth, seed=5)


def test_shallow_wide_trees_indexer_seq_lens(decisive_model, base):
    """Tree steps past the bypass where no draft node completes a C4 block (so the plan builds no virtual page):
    every row's indexer length must still be `(t + 1) // 4` at its depth position, and the run identical to the
    stock engine's."""
    import nvidia_harness as H
    import nv_tree_harness as T

    params, stock, _ = base
    truth = {tuple(p): o for p, o in zip(prompts(), stock.outputs)}
    records, snaps, steps = [], {}, []
    with H.OpCalls() as calls:
        def on_llm(llm):
            T.record_tree_steps(records, snaps)(llm)
            track_steps(calls, steps)(llm)

        tr, err = run_or_error(lambda: T.run_tree(decisive_model, prompts(), params, SPEC,
                                                  drafter_factory=shallow_wide_drafter(truth), on_llm=on_llm,
                                                  **ENGINE))
    off = [(i, s["nodes"], s["virtual_pages"], s["seq_lens_off"]) for i, s in enumerate(steps) if s["seq_lens_off"]]
    print(f"shallow-wide: {len(steps)} tree steps (virtual pages {[s['virtual_pages'] for s in steps]}); "
          f"error {err}; rows with indexer seq_len != (t + 1) // 4 (step, nodes, virtual pages, "
          f"[(row, got, want)]): {off}")
    if not (steps and all(s["virtual_pages"] == 0 and s["seq_lens_off"] is not None for s in steps)):
        pytest.fail(f"the run did not make long-context tree steps without virtual pages: {steps}")
    assert not off, off
    if err is not None:
        pytest.fail(f"rows read unwritten keys: {err}")
    bad, v = rejected(base, (tr, records, snaps, steps, calls))
    print(f"shallow-wide: adapter {tr.adapter_stats}; checks {v}")
    if tr.adapter_stats["emitters_c4"] or len(steps) < 2 or bad:
        pytest.fail(f"shallow-wide run: adapter {tr.adapter_stats}, {len(steps)} steps, checks {v}")
